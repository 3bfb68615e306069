"""The model on every rank, before any byte moves (all ranks; imports ``common``, ``integrations``).

``_meta``: ``model_fn`` built on meta, its tensors, ties and buffers described (``ModelLayout``);
``_shard``: the default ``fully_shard`` policy and its dtype-group check; ``_layout``: which rows
of each tensor this rank holds under its placements.
"""
