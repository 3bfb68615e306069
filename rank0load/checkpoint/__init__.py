"""Where the checkpoint is and what it holds (rank 0 alone; ``inspect`` in one process).

Imports ``model``, ``common``, ``integrations``. ``_source``: a path, index or Hub repo resolved to
its files; ``_index``: an index read and checked, its file names kept inside the checkpoint;
``_files``: opened once, identity-checked; ``_json``: untrusted JSON (headers, index) decoded,
repeated keys found; ``_format``: safetensors headers parsed and validated; ``_headers``: all of
them read, checked against each other and the index; ``_fp8``: float8 block scales; ``_entries``:
one entry per model tensor, the data every rank reads; ``_fit``: the matched headers checked
against the model and made into entries; ``_match``: which model key each checkpoint key loads
into; ``_manifest``: rank 0 opens the checkpoint and makes the manifest every rank receives, run
by run (the entry points); ``_inspect``: the dry run behind ``python -m rank0load``.
"""
