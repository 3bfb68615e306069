"""``save_sharded`` (all ranks; rank 0 writes): imports ``checkpoint`` (the header format), ``model``,
``common``, ``integrations``.

``_save``: the pipeline; ``_configs``: the files' names and config files each library reads;
``_saveplan`` / ``_saveblock``: which rank sends which rows of which tensor to which file offset
(a tensor-parallel one's chunks and parts: ``common._blocks``, shared with the load);
``_pieces``: the messages every rank cuts from that plan; ``_write``: the rounds of gathers and
rank 0's writes; ``_outputs``: the files, their headers and index, written atomically.
"""
