"""``save_sharded`` (all ranks; rank 0 writes): imports ``checkpoint`` (the header format), ``model``,
``common``, ``integrations``. The pipeline is ``_save``.
"""
