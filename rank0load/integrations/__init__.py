"""What knows other libraries' internals (the bottom layer: imports only ``errors``; all ranks).

``_compat``: private torch, transformers and diffusers APIs, one function each; ``_peft``: PEFT;
``_convert``: checkpoint-to-model key conversions (``StackExperts``, transformers' own); ``_resolve``:
``KeyResolver``; ``_remote_code``: ``trust_remote_code``.
"""
