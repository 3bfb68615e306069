"""What the load and the save share (all ranks; imports only ``integrations`` and ``errors``).

``_distribute``: every collective the ranks agree through (a step every rank runs, a value rank 0
computes, the agreement on the model, the rounds of a transfer and their settling: every rank
raises the same error); ``_failure``: what a rank's failure is (the caller's code, the machine's,
rank0load's own) and how every rank words it; ``_staging``: the staging geometry both transfers use
and the queues of a round's sends and receives in flight; ``_blocks``: a tensor-parallel tensor's
chunks of whole rows and each rank's part of one; ``_memory``: host memory (staging
reservations, shards faulted in); ``_progress``: the progress bar and peak RSS; ``_report``: the
phase clock, :class:`~rank0load.LoadReport` and the model's FSDP groups
(:class:`~rank0load.FSDPGroup`).
"""
