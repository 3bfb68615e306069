"""``save_sharded`` (all ranks; rank 0 writes): imports ``checkpoint`` (the header format), ``model``,
``common``, ``integrations``.

``_save``: the pipeline; ``_saveplan`` / ``_saveblock``: which rank sends which rows of which tensor
to which file offset; ``_write``: the rounds of gathers and rank 0's writes; ``_outputs``: the
files, their headers and index, written atomically.
"""
