"""The load after the manifest: the model's steps, the plan and the data movement (all ranks).

Imports ``checkpoint``, ``model``, ``common``, ``integrations``. ``_model``: build, allocate,
initialise and finish the model; ``_plan``: the pieces each rank receives; ``_messages``: pieces
grouped into messages; ``_stream``: rank 0's reads; ``_transfer``: the rounds of sends and
receives; ``_local`` / ``_localread``: ranks on rank 0's host reading through its descriptors;
``_sink``: where arriving bytes land on this rank.
"""
