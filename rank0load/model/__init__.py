"""The model on every rank, before any byte moves (all ranks; imports ``common``, ``integrations``).

``_meta``: the meta build and ``ModelLayout``; ``_shard``: the ``fully_shard`` policy and its checks;
``_layout``: what of each tensor this rank holds.
"""
