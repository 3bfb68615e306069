"""The manifest made run by run (``rank0load.checkpoint._manifest``) settles what spans runs.

On 2 and 3 gloo ranks, a Mixtral checkpoint in MiniMax-M2's FP8 layout (16x16 blocks), re-sharded
so that what the runs must settle between them is there: one layer's expert group split across two
files (transformers 5 fuses it), an expert's ``weight_scale_inv`` in another file than its weight,
and an attention weight's likewise. Each file
is its own run (``RUN_TENSORS = 1``, as in the whole suite). The load must equal transformers'
``from_pretrained`` of the dequantised checkpoint bit for bit, in one run per file
(``LoadReport.manifest_runs``). A checkpoint whose keys do not match raises the same error with
and without a ``key_map``, on every rank.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests import _dist
from tests import moe_models as mm
from tests.models import assert_same, gather, reference

pytestmark = pytest.mark.transformers

FAMILY = "mixtral"  # FP8 as MiniMax-M2 stores it; built into transformers 4.57 and 5.x


def _reshard(path: str, files: int, where) -> None:
    """Rewrite the checkpoint at ``path`` as ``files`` files, key ``k`` in file ``where(k)``, with its index."""
    from safetensors.torch import load_file, save_file

    old = sorted(set(mm.weight_map(path).values()))
    tensors: dict[str, torch.Tensor] = {}
    for name in old:
        tensors.update(load_file(os.path.join(path, name)))
        os.remove(os.path.join(path, name))
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    parts: list[dict[str, torch.Tensor]] = [{} for _ in names]
    for key in sorted(tensors):
        parts[where(key)][key] = tensors[key]
    weight_map = {}
    for name, part in zip(names, parts):
        assert part, "every file holds something"
        save_file(part, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _where(key: str) -> int:
    """Layer 0 in file 0 but experts 2.. of its w1 (an expert group, fused by transformers 5) (and expert 1's w1 scale) in file 1; layer 0's
    q_proj scale in file 2; everything else in file 2."""
    layer0 = key.startswith("model.layers.0.")
    if layer0 and ".experts." in key and ".w1." in key:
        expert = int(key.split(".experts.")[1].split(".")[0])
        if expert >= 2 or key.endswith("experts.1.w1.weight_scale_inv"):
            return 1
    if key == "model.layers.0.self_attn.q_proj.weight_scale_inv":
        return 2
    return 0 if layer0 else 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("runs")
    path, ref = str(root / "fp8"), str(root / "ref")
    mm.save_fp8(FAMILY, path, (16, 16))
    _reshard(path, 3, _where)
    mm.save_dequantized(path, ref)
    return {"path": path, "ref": ref}


def _loads(rank: int, world: int, path: str) -> dict:
    from transformers import AutoModelForCausalLM

    import rank0load

    mm._quiet()
    cfg = mm.config(FAMILY)
    model = rank0load.load_sharded(lambda: AutoModelForCausalLM.from_config(cfg), path, dtype=torch.float32)
    out = {"tensors": gather(model), "runs": model.rank0load_report.manifest_runs}
    errors = {}
    short = mm.config(FAMILY)
    short.num_hidden_layers = 1  # the checkpoint's layer 1 is then unexpected
    for name, key_map in (("plain", None), ("key_map", lambda k: k)):
        try:
            rank0load.load_sharded(lambda: AutoModelForCausalLM.from_config(short), path, key_map=key_map)
            errors[name] = None
        except rank0load.LoadError as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    out["errors"] = errors
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_runs_settle_what_spans_files(ckpt, world):
    from transformers import AutoModelForCausalLM

    mm._quiet()
    want = reference(AutoModelForCausalLM.from_pretrained(ckpt["ref"], dtype=torch.float32))
    results = _dist.ok(_dist.run(_loads, world, ckpt["path"], timeout=300))
    for res in results:
        assert res["runs"] == 3, "one run per file"
        assert_same(res["tensors"], want)
        assert res["errors"]["plain"] is not None and res["errors"]["plain"] == res["errors"]["key_map"]
        assert "unexpected in the checkpoint" in res["errors"]["plain"]
    assert len({res["errors"]["plain"] for res in results}) == 1


def test_listing_checks_each_file(tmp_path):
    """The index kept as counts and hash sums: a header's keys agree with it exactly when they are the
    keys it lists for that file."""
    from rank0load.checkpoint._source import resolve

    path = str(tmp_path / "fp8")
    mm.save_fp8(FAMILY, path, (16, 16))
    source = resolve(path)
    assert source.listing is not None
    listed = mm.weight_map(path)
    for f in source.files:
        keys = [k for k, name in listed.items() if os.path.join(path, name) == f]
        assert source.listing.agrees(f, reversed(keys))
        assert not source.listing.agrees(f, keys[:-1])
        assert not source.listing.agrees(f, [*keys[:-1], keys[-1] + "x"])
    assert source.listing.total == len(listed)
    assert source.listing.read_map() == {
        k: os.path.join(os.path.realpath(path), v) for k, v in listed.items()
    }
