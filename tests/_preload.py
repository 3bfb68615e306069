"""Imported once by the server the test ranks fork from (``_dist.PRELOAD``): what most ranks import
anyway. Each library is optional (the oldest-transformers leg has no diffusers). peft is left out
on purpose: rank0load behaves differently when ``model_fn`` is what imports it
(``model._meta.build_on_meta``), and the ranks must see that as a user's process would."""

import contextlib

import torch
import torch.distributed.fsdp
import torch.distributed.tensor  # noqa: F401

import rank0load  # noqa: F401
import tests.fakes
import tests.models  # noqa: F401

for _name in ("transformers.modeling_utils", "diffusers"):
    with contextlib.suppress(Exception):
        __import__(_name)
