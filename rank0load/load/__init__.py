"""The load after the manifest: the model's steps, the plan and the data movement (all ranks).

Imports ``checkpoint``, ``model``, ``common``, ``integrations``. ``_options``: ``load_sharded``'s
arguments checked, the staging default; ``_model``: build, allocate, initialise and finish the
model; ``_plan``: the plan's vocabulary (kinds, routes, pieces; a BLOCK entry's chunks and parts
are ``common._blocks``'s, shared with the save), the pieces each rank receives and the messages
they are grouped into; ``_transfer``: the rounds, and where a message's bytes come from on
this rank (rank 0's reader thread and its sends; receives; a local reader, ``_localread``), one
interface; ``_readahead``: ``preadv`` at file offsets, and rank 0's reader thread; ``_handover``: rank
0 lending its descriptors to the ranks on its host; ``_sink``: where arriving bytes land on this rank.
"""
