"""Where the checkpoint is and what it holds (rank 0 alone; ``inspect`` in one process).

Imports ``model``, ``common``, ``integrations``. ``_source``: a path, index or Hub repo resolved to
its files; ``_files``: opened once, identity-checked; ``_format``: safetensors headers parsed and
validated; ``_fp8``: float8 block scales; ``_entries``: one entry per model tensor from the matched
headers; ``_manifest`` and ``_runs``: the headers matched to the model (all at once, or run by run)
into the manifest every rank receives; ``_inspect``: the dry run behind ``python -m rank0load``.
"""
