"""A per-expert MoE as remote code defines it, shaped like the public MiniMax-M2 ports: the two files a
checkpoint ships beside its weights (``configuration_tiny_moe.py``, ``modeling_tiny_moe.py``, the second
importing the first relatively, as real remote code does). Tests import them as this package; the
remote-code tests copy them into a checkpoint folder under ``auto_map`` (tests/hf.py)."""
