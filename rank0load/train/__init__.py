"""Training helpers for the models rank0load loads (all ranks): ``_clip.clip_grad_norm_``."""
