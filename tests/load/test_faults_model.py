"""Fault corpus, checkpoint against model: missing and unexpected keys, shapes, dtypes, tied weights
that differ, a key_map that collides, raises or returns a non-string, and strict=False with a
reset_parameters() that writes nothing. The cases that span files (tied weights, a key_map
collision, one tensor under two names) are also written as two files: the suite makes every file
its own run of the manifest, so these are settled where the runs merge.

Every case raises the same LoadError on every rank before any data moves; all cases run in one pair
of gloo ranks (see tests/faults_common.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from tests.faults_common import (
    Case,
    check_fault,
    check_good_load,
    check_never_written,
    good_state,
    run_corpus,
    single,
    without,
)
from tests.models import Toy, save_state

# --------------------------------------------------------------------------------------------
# Picklable model_fn / key_map variants (spawned ranks import this module).


class _NoopInitLinear(torch.nn.Linear):
    def reset_parameters(self) -> None:  # claims to initialise, writes nothing
        pass


def toy_noop_init() -> Toy:
    model = Toy()
    model.blocks[1].fc = _NoopInitLinear(5, 5)
    return model


def collide_biases(key: str) -> str:
    return "blocks.0.fc.bias" if key == "blocks.1.fc.bias" else key


def int_key_map(key: str) -> object:
    return 7 if key == "step" else key


def raising_key_map(key: str) -> str:
    if key == "bn.bias":
        raise KeyError(key)
    return key


# --------------------------------------------------------------------------------------------
# Building checkpoints that do not fit the model.


def _with_extra(d: str) -> str:
    sd = good_state()
    sd["extra.bias"] = torch.ones(3)
    return single(d, sd)


def _tied_differ(d: str) -> str:
    sd = good_state()
    sd["head.weight"] = sd["emb.weight"] + 1
    return single(d, sd)


def _two_files(d: str, sd: dict[str, torch.Tensor], second: set[str]) -> str:
    """``sd`` as two files with an index, the keys in ``second`` in the second file."""
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    parts = ({k: v for k, v in sd.items() if k not in second}, {k: v for k, v in sd.items() if k in second})
    for name, part in zip(names, parts):
        save_file(part, os.path.join(d, name))
    weight_map = {k: names[k in second] for k in sd}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return d


def _tied_differ_two_files(d: str) -> str:
    sd = good_state()
    sd["head.weight"] = sd["emb.weight"] + 1
    return _two_files(d, sd, {"head.weight"})


def _collide_two_files(d: str) -> str:
    return _two_files(d, good_state(), {"blocks.1.fc.bias"})


def _twice_two_files(d: str) -> str:
    sd = good_state()
    sd["_orig_mod.bn.bias"] = sd["bn.bias"].clone()  # the same tensor under a compiled model's name
    return _two_files(d, sd, {"_orig_mod.bn.bias"})


def _wider(d: str) -> str:
    torch.manual_seed(0)
    path = os.path.join(d, "model.safetensors")
    save_state(Toy(vocab=8), path)
    return path


# --------------------------------------------------------------------------------------------
# The corpus.


CASES = [
    Case(
        "shape_mismatch",
        _wider,
        "ModelMismatchError",
        ("'emb.weight'", "(8, 5)", "(7, 5)", "model.safetensors"),
        ("model_fn",),
    ),
    Case(
        "dtype_int_into_int64",
        lambda d: single(d, {**good_state(), "step": torch.tensor(42, dtype=torch.int32)}),
        "ModelMismatchError",
        ("'step'", "I32", "torch.int64", "model.safetensors"),
        ("Build the model",),
    ),
    Case(
        "strict_missing",
        without("bn.running_var"),
        "ModelMismatchError",
        ("'bn.running_var'", "missing"),
        ("strict=False",),
    ),
    Case(
        "strict_unexpected", _with_extra, "ModelMismatchError", ("'extra.bias'", "unexpected"), ("key_map",)
    ),
    Case(
        "tied_differ",
        _tied_differ,
        "ModelMismatchError",
        ("'emb.weight'", "'head.weight'", "different values"),
        ("keep one",),
    ),
    Case(
        "key_map_collision",
        single,
        "ModelMismatchError",
        ("'blocks.0.fc.bias'", "'blocks.1.fc.bias'"),
        ("one checkpoint key only",),
        kwargs={"key_map": collide_biases},
    ),
    Case(
        "tied_differ_two_files",
        _tied_differ_two_files,
        "ModelMismatchError",
        ("'emb.weight'", "'head.weight'", "different values"),
        ("keep one",),
    ),
    Case(
        "key_map_collision_two_files",
        _collide_two_files,
        "ModelMismatchError",
        ("'blocks.0.fc.bias'", "'blocks.1.fc.bias'"),
        ("one checkpoint key only",),
        kwargs={"key_map": collide_biases},
    ),
    Case(
        "stored_twice_two_files",
        _twice_two_files,
        "ModelMismatchError",
        ("'bn.bias'", "'_orig_mod.bn.bias'", "several checkpoint keys"),
        ("Keep one",),
    ),
    Case(
        "key_map_raises",
        single,
        "ModelMismatchError",
        ("key_map('bn.bias')", "KeyError"),
        ("fix it",),
        kwargs={"key_map": raising_key_map},
    ),
    Case(
        "key_map_returns_int",
        single,
        "ModelMismatchError",
        ("key_map(", "returned 7"),
        ("Fix key_map",),
        kwargs={"key_map": int_key_map},
    ),
    Case(
        "init_missing_writes_nothing",
        without("blocks.1.fc.weight"),
        "ModelMismatchError",
        ("blocks.1.fc.weight", "not initialised"),
        ("reset_parameters()",),
        kwargs={"model_fn": toy_noop_init, "strict": False},
    ),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return run_corpus(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(corpus, case):
    """Every rank raises the same LoadError subclass, fast, naming what is wrong and what to do."""
    check_fault(corpus, case)


def test_checkpoint_never_written(corpus):
    check_never_written(corpus)


def test_good_load_after_failures(corpus, toy_reference):
    """After every failing case, in the same process group, a good load is bit-exact."""
    check_good_load(corpus, toy_reference)
