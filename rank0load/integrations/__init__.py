"""What knows other libraries' internals (the bottom layer: imports only ``errors``).

``_compat``: torch's private FSDP2 / DTensor APIs and transformers' (its fp32-kept modules, init
weights, no-split modules, per version), each behind one function; ``_compat_convert``: the same for
transformers' checkpoint conversions (``conversion_mapping``, ``core_model_loading``, per version);
``_peft``: PEFT's tuner layers and adapter files; ``_convert``: checkpoint-to-model key conversions
(transformers' conversion mapping, ``StackExperts``); ``_resolve``: which conversion places each
checkpoint key, decided once per key pattern (``KeyResolver``); ``_remote_code``: a checkpoint's own
code (``trust_remote_code``). Used on every rank by everything above.
"""
