"""Where the checkpoint is and what it holds (rank 0 alone; ``inspect`` in one process).

Imports ``model``, ``common``, ``integrations``. Entry points: ``_manifest`` (rank 0 makes the
manifest every rank receives, run by run) and ``_inspect`` (the dry run behind ``python -m rank0load``).
"""
