"""What the load and the save share (all ranks; imports only ``integrations`` and ``errors``).

``_distribute``: every collective the ranks agree through (settling failures so every rank raises
the same error, sharing objects, the agreement on the model); ``_failure``: what a rank's failure is
(the caller's code, the machine's, rank0load's own) and how every rank words it; ``_rounds``: a
transfer's rounds, its sends and receives in flight, and the settling at each round's end (the
load's stream and the save's writes); ``_memory``: host memory (staging reservations, shards
faulted in); ``_progress``:
the progress bar and peak RSS; ``_report``: the phase clock, :class:`~rank0load.LoadReport` and the
model's FSDP groups (:class:`~rank0load.FSDPGroup`).
"""
