"""Meshes beyond 1-D, on 4 gloo ranks: HSDP with the default policy, tensor parallel + FSDP2 through a
caller's shard_fn, CPUOffloadPolicy and MixedPrecisionPolicy. Every parameter's full tensor and
every buffer is compared bit for bit with the single-process model, and the forward output too.

All scenarios run in one 4-rank spawn (a spawn costs more than a load on 2 cores); each test
checks one scenario's result.
"""

from __future__ import annotations

import pytest
import torch

from tests import _dist, hf
from tests.models import assert_same, gather, reference, toy, trained_toy

# Slow: one 4-rank spawn that imports transformers, 25-30 s on 2 cores.
pytestmark = [pytest.mark.slow, pytest.mark.torch_range]

IDS = torch.tensor([[1, 2, 3, 6], [0, 5, 4, 4]])


class OnForeignMesh:
    """shard_fn that ignores the mesh it is given and shards over a slice of another mesh."""

    def __call__(self, model, mesh) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))["b"])


class WithPolicy:
    """shard_fn: the default layout (blocks, then root) with extra fully_shard keyword arguments."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs

    def __call__(self, model, mesh) -> None:
        from torch.distributed.fsdp import fully_shard

        from rank0load.model._shard import _owners, find_blocks, routed_modules

        for block in find_blocks(model, routed_modules(model), _owners(model)):
            fully_shard(block, mesh=mesh, **self.kwargs)
        fully_shard(model, mesh=mesh, **self.kwargs)


def _summary(model, mesh) -> dict:
    from torch.distributed.tensor import DTensor

    return {
        "placements": {n: str(p.placements) for n, p in model.named_parameters()},
        "submesh": sorted(n for n, p in model.named_parameters() if p.device_mesh != mesh),
        "kinds": {n: model.rank0load_report.kinds[n] for n, _ in model.named_parameters()},
        "local_dtypes": {p._local_tensor.dtype for p in model.parameters() if isinstance(p, DTensor)},
        "devices": {p._local_tensor.device.type for p in model.parameters()}
        | {b.device.type for b in model.buffers()},
        "tensors": gather(model),
    }


def _scenarios(rank: int, world: int, toy_path: str, llama_path: str, tp_path: str, tp_fp8_path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    import rank0load

    hf._quiet()
    out: dict = {}
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = rank0load.load_sharded(toy, toy_path, hsdp)
    out["hsdp_toy"] = _summary(model, hsdp)
    with torch.no_grad():
        out["hsdp_toy"]["out"] = model.eval()(IDS)
    out["hsdp_toy"]["tied"] = model.head.weight is model.emb.weight

    model = rank0load.load_sharded(hf.Factory("llama"), llama_path, hsdp)
    out["hsdp_llama"] = _summary(model, hsdp)
    with torch.no_grad():
        out["hsdp_llama"]["out"] = model(**hf.sample_inputs("llama")).logits

    dptp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = rank0load.load_sharded(hf.TPLlama(), tp_path, dptp, shard_fn=hf.TPThenFSDP())
    out["tp"] = _summary(model, dptp)
    with torch.no_grad():
        out["tp"]["out"] = model(**hf.sample_inputs("llama")).logits
    # 4 KiB of staging: chunks of 3-5 rows cut through the strided runs and the Shard(1) blocks.
    model = rank0load.load_sharded(
        hf.TPLlama(), tp_path, dptp, shard_fn=hf.TPThenFSDP(), max_staging_bytes=4096
    )
    out["tp_small_chunks"] = gather(model)

    # FP8 block-quantised projections under TP + FSDP2: blocks cut by rank 0 as float8, each
    # dequantised by the rank that holds it (whole chunks, then chunks of 3-5 rows).
    for name, staging in (("tp_fp8", None), ("tp_fp8_small_chunks", 4096)):
        kwargs = {"max_staging_bytes": staging} if staging else {}
        model = rank0load.load_sharded(hf.TPLlama(), tp_fp8_path, dptp, shard_fn=hf.TPThenFSDP(), **kwargs)
        out[name] = {"tensors": gather(model), "kinds": model.rank0load_report.kinds}
        out[name]["dequantised"] = model.rank0load_report.dequantised

    flat = init_device_mesh("cpu", (world,))
    model = rank0load.load_sharded(
        toy, toy_path, flat, shard_fn=WithPolicy(offload_policy=CPUOffloadPolicy(pin_memory=False))
    )
    out["offload"] = _summary(model, flat)
    with torch.no_grad():
        out["offload"]["out"] = model.eval()(IDS)

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = rank0load.load_sharded(hf.Factory("llama"), llama_path, flat, shard_fn=WithPolicy(mp_policy=mp))
    out["mixed"] = _summary(model, flat)
    with torch.no_grad():
        out["mixed"]["out"] = model(**hf.sample_inputs("llama")).logits

    try:
        rank0load.load_sharded(toy, toy_path, flat, shard_fn=OnForeignMesh())
    except rank0load.LoadError as exc:
        out["foreign"] = (type(exc).__name__, str(exc))
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, toy_checkpoint):
    tmp = tmp_path_factory.mktemp("meshes")
    toy_ref = trained_toy()
    llama_ref = hf.pretrained("llama")
    llama_ref.save_pretrained(tmp / "llama", max_shard_size="20KB")
    torch.manual_seed(1)
    tp_ref = hf.TPLlama()()
    with torch.no_grad():
        for p in tp_ref.parameters():
            p.normal_(0, 0.5)
    tp_ref.save_pretrained(tmp / "tp", max_shard_size="20KB")
    tp_ref.save_pretrained(tmp / "tp_fp8", max_shard_size="20KB")
    fp8_ref = _quantise_projections(tmp / "tp_fp8", reference(tp_ref))
    paths = [str(tmp / name) for name in ("llama", "tp", "tp_fp8")]
    results = _dist.ok(_dist.run(_scenarios, 4, toy_checkpoint, *paths, timeout=240))
    return {"toy": toy_ref, "llama": llama_ref, "tp": tp_ref, "tp_fp8": fp8_ref}, results


FP8_BLOCK = (8, 8)  # partial blocks: 38 MLP rows and columns are no multiple of 8


def _quantise_projections(path, want: dict) -> dict:
    """Rewrite the decoder layers' projections as float8 + ``weight_scale_inv`` (the Hub's FP8 layout,
    DeepSeek-V3 style); returns ``want`` with those weights dequantised: what a load must give."""
    from tests import moe_models as mm

    def edit(key: str, tensor: torch.Tensor) -> dict:
        if not key.endswith("_proj.weight"):
            return {key: tensor}
        q, scale = mm.quantize(tensor, FP8_BLOCK)
        want[key] = mm.dequantize(q, scale, FP8_BLOCK)
        return {key: q, key + "_scale_inv": scale}

    mm.rewrite(path, edit, mm.fp8_config(FP8_BLOCK))
    return want


def _toy_out(ref):
    with torch.no_grad():
        return ref(IDS)


def _llama_out(ref):
    with torch.no_grad():
        return ref(**hf.sample_inputs("llama")).logits


def test_hsdp_default_policy_takes_the_row_path(loaded):
    refs, results = loaded
    for r in results:
        s = r["hsdp_toy"]
        assert_same(s["tensors"], reference(refs["toy"]))
        assert s["tied"]
        assert set(s["placements"].values()) == {"(Replicate(), Shard(dim=0))"}
        assert set(s["kinds"].values()) == {"sharded"}, s["kinds"]  # no distribute_tensor fallback
        torch.testing.assert_close(s["out"], _toy_out(refs["toy"]), rtol=0, atol=1e-6)
        s = r["hsdp_llama"]
        assert_same(s["tensors"], reference(refs["llama"]))
        assert set(s["kinds"].values()) == {"sharded"}
        torch.testing.assert_close(s["out"], _llama_out(refs["llama"]), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_then_fsdp(loaded):
    refs, results = loaded
    for r in results:
        s = r["tp"]
        # The layouts this test is about really occur: strided shards (colwise TP + FSDP), Shard(1)
        # (rowwise TP), and parameters FSDP2 left on the "dp" sub-mesh (embeddings, norms).
        q = s["placements"]["model.layers.0.mlp.up_proj.weight"]
        assert "_StridedShard" in q or "_S(" in q, q
        assert "Shard(dim=1)" in s["placements"]["model.layers.0.mlp.down_proj.weight"]
        assert "model.embed_tokens.weight" in s["submesh"]
        assert s["kinds"]["model.embed_tokens.weight"] == "sharded"  # lifted onto the 2-D mesh
        assert s["kinds"]["model.layers.0.mlp.up_proj.weight"] == "block"  # strided: cut by rank 0
        assert s["kinds"]["model.layers.0.mlp.down_proj.weight"] == "block"  # Shard(1)
        assert_same(s["tensors"], reference(refs["tp"]))
        torch.testing.assert_close(s["out"], _llama_out(refs["tp"]), rtol=1e-5, atol=1e-5)
        assert_same(r["tp_small_chunks"], reference(refs["tp"]))


def test_fp8_under_tensor_parallel(loaded):
    """Float8 weights travel as float8 blocks cut by rank 0 (strided colwise and Shard(1) rowwise),
    and each rank dequantises its block with the scales of the rows and columns it holds."""
    refs, results = loaded
    for r in results:
        for name in ("tp_fp8", "tp_fp8_small_chunks"):
            s = r[name]
            assert s["dequantised"] == 14  # 7 projections in each of 2 layers
            assert s["kinds"]["model.layers.0.mlp.up_proj.weight"] == "block"
            assert s["kinds"]["model.layers.0.mlp.down_proj.weight"] == "block"
            assert_same(s["tensors"], refs["tp_fp8"])


def test_cpu_offload_policy(loaded):
    """``pin_memory=False``: pinning needs an accelerator. On a CPU mesh this shows that the offload
    policy loads exactly and runs (FSDP2 re-places offloaded shards in ``to_empty``); that parameters
    stay on the host while the mesh is on an accelerator needs a GPU to test."""
    refs, results = loaded
    for r in results:
        s = r["offload"]
        assert s["devices"] == {"cpu"}
        assert_same(s["tensors"], reference(refs["toy"]))
        torch.testing.assert_close(s["out"], _toy_out(refs["toy"]), rtol=0, atol=1e-6)


def test_mixed_precision_policy_keeps_storage_dtype(loaded):
    refs, results = loaded
    for r in results:
        s = r["mixed"]
        assert s["local_dtypes"] == {torch.float32}  # sharded parameters: storage dtype, not bf16
        assert_same(s["tensors"], reference(refs["llama"]))
        # The forward runs in bf16 (the policy is in force): close to the fp32 reference, not equal.
        assert s["out"].dtype == torch.bfloat16
        torch.testing.assert_close(s["out"].float(), _llama_out(refs["llama"]), rtol=0.05, atol=0.1)


def test_parameters_on_a_foreign_mesh_fail_on_every_rank(loaded):
    """rank 0 could not reach every shard through an unrelated mesh: refused before any data moves."""
    _, results = loaded
    errors = {r.get("foreign") for r in results}
    assert len(errors) == 1, errors
    name, message = errors.pop()
    assert name == "RankMismatchError" and "neither the load mesh" in message, message
