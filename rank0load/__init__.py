"""rank0load: stream a safetensors checkpoint from rank 0 into an FSDP2-sharded model.

model = rank0load.load_sharded(model_fn, ckpt_path, mesh)
model = rank0load.load_pretrained(AutoModelForCausalLM, ckpt_path, mesh)  # transformers models
rank0load.save_sharded(model, out_dir, optimizer=optimizer, training_state={"step": step})
state = rank0load.load_training_state(model, optimizer, out_dir)  # after loading model from out_dir
rank0load.clip_grad_norm_(model.parameters(), max_norm=1.0)
"""

from __future__ import annotations

from ._api import DEFAULT_STAGING_BYTES, LoadReport, load_sharded
from ._pretrained import load_pretrained
from ._resume import load_training_state
from .common._report import FSDPGroup
from .errors import (
    CheckpointChangedError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    InternalError,
    LoadError,
    ModelMismatchError,
    RankMismatchError,
    SaveError,
)
from .integrations._convert import StackExperts
from .model._shard import default_shard_fn
from .save._save import SaveReport, save_sharded
from .train._clip import clip_grad_norm_

__all__ = [
    "load_sharded",
    "load_pretrained",
    "save_sharded",
    "load_training_state",
    "clip_grad_norm_",
    "SaveReport",
    "default_shard_fn",
    "StackExperts",
    "LoadReport",
    "FSDPGroup",
    "DEFAULT_STAGING_BYTES",
    "LoadError",
    "CheckpointNotFoundError",
    "CheckpointFormatError",
    "ModelMismatchError",
    "RankMismatchError",
    "CheckpointChangedError",
    "SaveError",
    "InternalError",
]
__version__ = "0.1.0"
