"""The benchmark: host RAM and time of loading one checkpoint into an FSDP2 model, per method.

``python -m benchmarks.bench [args]`` runs it (see :mod:`benchmarks.bench.driver` for the flags).
:mod:`~.driver` drives the runs and writes the tables, :mod:`~.worker` is one rank of one run
(``python -m benchmarks.bench.worker '<json spec>'``), :mod:`~.methods` holds the loading methods
compared, :mod:`~.model` the benchmark's Llama-style model and checkpoint writer, and :mod:`~.moe`
the MoE one (``--model moe``: a per-expert Qwen3-MoE checkpoint into transformers' fused experts).
``--save`` measures the save methods (:data:`~.methods.SAVE_METHODS`) instead of the loads, and
``--resume`` the training-state methods of :mod:`~.resume` (model + AdamW state saved, then restored
in fresh processes).
"""

from __future__ import annotations

from .driver import (
    ensure_checkpoint,
    environment,
    main,
    parse_args,
    plot,
    readme_section,
    results_table,
    run_once,
    run_size,
    summarise,
    sweep_table,
    update_readme,
    warm_page_cache,
)
from .methods import METHOD_NOTES, METHODS, SAVE_METHOD_NOTES, SAVE_METHODS
from .model import BenchConfig, cached_checkpoint, config_for_size, tensor_specs, write_checkpoint
from .moe import MoeConfig
from .resume import RESUME_METHOD_NOTES, RESUME_METHODS

__all__ = [
    "main",
    "parse_args",
    "run_once",
    "run_size",
    "summarise",
    "ensure_checkpoint",
    "warm_page_cache",
    "environment",
    "results_table",
    "sweep_table",
    "plot",
    "readme_section",
    "update_readme",
    "METHODS",
    "METHOD_NOTES",
    "SAVE_METHODS",
    "SAVE_METHOD_NOTES",
    "RESUME_METHODS",
    "RESUME_METHOD_NOTES",
    "BenchConfig",
    "MoeConfig",
    "cached_checkpoint",
    "config_for_size",
    "tensor_specs",
    "write_checkpoint",
]
