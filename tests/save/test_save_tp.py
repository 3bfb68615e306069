"""save_sharded of tensor-parallel DTensors (``Shard(1)``, ``Shard(2)``, ``_StridedShard``, TP + FSDP2)
through the block path: nothing gathered whole, every message within the staging budget, the files
bit for bit the single-process state dict (2 and 3 ranks, uneven; 4 ranks dp=2 x tp=2 with the
README's recipe, read back by from_pretrained); MoE experts sharded on dimension 1 saved back per
expert; and the block arithmetic itself, on one process, for layouts and slot sizes no spawn covers."""

from __future__ import annotations

import errno
import gc
import itertools
import math
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tests import _dist, hf
from tests.models import assert_same, read_checkpoint, shard_tp, trained_net

# --------------------------------------------------------------------------------- one process


def _local(full: torch.Tensor, runs) -> torch.Tensor:
    """The local shard a rank holding ``runs`` has: the cross product of its index runs."""
    for dim, dim_runs in enumerate(runs):
        full = full.index_select(dim, torch.cat([torch.arange(a, b) for a, b in dim_runs]))
    return full.contiguous()


LAYOUTS = [
    ((7, 5), [Shard(1)], (2,)),
    ((7, 5), [Shard(1)], (3,)),
    ((5, 7, 9), [Shard(2)], (3,)),
    ((11, 4), [_StridedShard(0, split_factor=2)], (3,)),
    ((4, 11), [_StridedShard(1, split_factor=2)], (3,)),
    ((7, 6), [_StridedShard(0, split_factor=2), Shard(0)], (2, 2)),  # colwise TP, then FSDP2
    ((5, 7), [Shard(0), Shard(1)], (2, 2)),  # rowwise TP, then FSDP2
    ((5, 7), [Shard(1), Replicate()], (2, 2)),
    ((2, 5, 7), [Replicate(), Shard(0)], (2, 3)),
    ((3, 300), [Shard(1)], (3,)),  # rows wider than most slots: chunks of columns
    ((5, 3, 40), [Shard(1), Shard(2)], (2, 3)),
    ((4, 9, 13), [_StridedShard(2, split_factor=3), Shard(2)], (2, 2)),
    ((13,), [Shard(0)], (3,)),
]


@pytest.mark.parametrize("shape,placements,mesh_shape", LAYOUTS)
def test_chunks_rebuild_the_tensor_from_every_rank_shard(shape, placements, mesh_shape) -> None:
    """Rank 0's side of the block path on one process: the chunks tile the tensor in byte order,
    each at most half a slot, their parts (each a contiguous range of its sender's real local shard,
    cut here with DTensor's split) fill the chunk's receive area exactly once, and placing them
    gives the tensor bit for bit; for half-slots from one element to the whole tensor, and a cast."""
    from rank0load.common._blocks import block_chunks
    from rank0load.save._saveplan import SaveKind, _senders
    from rank0load.save._write import place

    # What _senders reads of a DTensor, for a mesh no process group backs.
    mesh = SimpleNamespace(mesh=torch.arange(math.prod(mesh_shape)).reshape(mesh_shape), shape=mesh_shape)
    tensor = SimpleNamespace(device_mesh=mesh, placements=placements, shape=shape)
    blocks = _senders(tensor, SaveKind.BLOCK, 4)[1]  # type: ignore[arg-type]
    replicas = math.prod(n for n, p in zip(mesh_shape, placements) if type(p) is Replicate)
    assert len(blocks) <= math.prod(mesh_shape) // replicas
    for dtype, half in itertools.product((torch.float32, torch.bfloat16), (32, 64, 96, 512, 1 << 20)):
        full = torch.randn(shape).to(dtype)
        shards = {rank: _local(full, runs).reshape(-1) for rank, runs in blocks}
        out = torch.full((full.numel(),), float("nan"), dtype=torch.float64)
        at = 0
        for chunk, parts in block_chunks(shape, full.element_size(), tuple(blocks), half):
            assert chunk.start == at and 0 < chunk.nbytes <= half
            at += chunk.nbytes
            assert sum(p.nbytes for p in parts) == chunk.nbytes
            first = chunk.start // full.element_size()
            rows = out[first : first + chunk.nbytes // full.element_size()].view(chunk.shape)
            for p in parts:
                local = p.local_offset // full.element_size()
                place(rows, shards[p.rank][local : local + math.prod(p.shape)].view(p.shape), p)
        assert at == full.numel() * full.element_size()
        assert torch.equal(out.view(shape), full.double()), (dtype, half)
        # A sender derives its own parts alone, in the order rank 0 receives them.
        size = full.element_size()
        every = [
            (c, p.rank, p.local_offset, p.nbytes, p.rows)
            for c, ps in block_chunks(shape, size, blocks, half)
            for p in ps
        ]
        for rank, runs in blocks:
            alone = [
                (c, p.rank, p.local_offset, p.nbytes, p.rows)
                for c, ps in block_chunks(shape, size, [(rank, runs)], half)
                for p in ps
            ]
            assert alone == [e for e in every if e[1] == rank]


# ------------------------------------------------------------------------------------- ranks


def _held(model: nn.Module, sends) -> int:
    """Bytes of this rank's local shards of the sharded DTensors (``Shard``, ``_StridedShard``: not
    only ``Replicate``) that ``sends(p)`` says it sends."""
    from torch.distributed.tensor import DTensor

    return sum(
        p.to_local().numel() * p.element_size()
        for p in model.parameters()
        if isinstance(p, DTensor) and any(type(q) is not Replicate for q in p.placements) and sends(p)
    )


class _Messages:
    """Counts what this rank sends and receives (bytes per message) and fails any full_tensor()."""

    def __init__(self) -> None:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        self.sent: list[int] = []
        self.received: list[int] = []
        real_send, real_recv = dist.isend, dist.irecv

        def isend(tensor, dst, *args, **kwargs):
            self.sent.append(tensor.numel() * tensor.element_size())
            return real_send(tensor, dst, *args, **kwargs)

        def irecv(tensor, src, *args, **kwargs):
            self.received.append(tensor.numel() * tensor.element_size())
            return real_recv(tensor, src, *args, **kwargs)

        def full_tensor(self, *args, **kwargs):
            raise AssertionError("full_tensor() called during save")

        dist.isend, dist.irecv = isend, irecv
        DTensor.full_tensor = full_tensor  # type: ignore[method-assign]

    def summary(self) -> dict:
        return {"sent": sum(self.sent), "largest": max(self.sent + self.received, default=0)}


def _tp_net(rank: int, world: int, out: str, small: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import rank0load

    model = trained_net()
    shard_tp(model, init_device_mesh("cpu", (world,)))
    messages = _Messages()
    report = rank0load.save_sharded(model, out)
    result = {"report": report, "default": messages.summary(), "held": _held(model, lambda p: True)}
    messages.sent.clear()
    messages.received.clear()
    # 4 KiB: 1 KiB slots, 512-byte chunks; `wide`'s 1200-byte rows are cut into column ranges.
    report = rank0load.save_sharded(model, small, max_staging_bytes=4096, dtype=torch.bfloat16)
    result.update(small_report=report, small=messages.summary())
    return result


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_tensor_parallel_blocks_round_trip(tmp_path, world: int) -> None:
    out, small = str(tmp_path / "out"), str(tmp_path / "small")
    results = _dist.ok(_dist.run(_tp_net, world, out, small))
    want = trained_net().state_dict()
    assert_same(read_checkpoint(out), want)
    assert_same(
        read_checkpoint(small),
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in want.items()},
    )
    for r in results:
        assert r["report"].gathered_whole == () and r["small_report"].gathered_whole == ()
        assert r["small"]["largest"] <= 1024  # every message within a 1 KiB staging slot
    # Each rank sends exactly its own shards, once (the replicated biases: rank 0 alone has them).
    for r in results[1:]:
        assert r["default"]["sent"] == r["held"] > 0


def _fallback_and_failure(rank: int, world: int, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import rank0load
    from rank0load.save import _write

    mesh = init_device_mesh("cpu", (world,))
    model = trained_net()
    shard_tp(model, mesh)
    # Shard(1) held transposed: a non-contiguous local shard, which only full_tensor() can save.
    local = odd_tensor(world).t().contiguous()[2 * rank : 2 * rank + 2].t()
    model.odd = nn.Parameter(DTensor.from_local(local, mesh, [Shard(1)], run_check=False))
    result: dict = {"report": rank0load.save_sharded(model, out)}
    with open(os.path.join(out, "model.safetensors"), "rb") as f:
        result["before"] = f.read()
    real, calls = _write.place, []

    def failing(*args):
        calls.append(1)
        if rank == 0 and len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(*args)

    _write.place = failing
    try:
        rank0load.save_sharded(model, out, max_staging_bytes=4096)
    except rank0load.SaveError as exc:
        result["error"] = str(exc)
    finally:
        _write.place = real
    with open(os.path.join(out, "model.safetensors"), "rb") as f:
        result["unchanged"] = f.read() == result["before"]
    result["again"] = rank0load.save_sharded(model, out, max_staging_bytes=4096)  # the group still works
    return result


def odd_tensor(world: int) -> torch.Tensor:
    return torch.arange(12.0 * world).reshape(6, 2 * world) / 7


def test_fallback_gathers_and_a_block_failure_fails_every_rank(tmp_path) -> None:
    """A non-contiguous local shard still saves (gathered whole, reported); a failure while rank 0
    places a block is the same SaveError on every rank, leaves the previous checkpoint as it was,
    and the next save in the same process group succeeds."""
    out = str(tmp_path / "out")
    results = _dist.ok(_dist.run(_fallback_and_failure, 2, out))
    for r in results:
        assert r["report"].gathered_whole == ("odd",)
        assert r["error"] == results[0]["error"] and r["unchanged"]
    assert (
        "writing the checkpoint failed on 1 of 2 ranks: rank 0: OSError: [Errno 28] No space left on device"
        in (results[0]["error"])
    )
    assert_same(read_checkpoint(out), {**trained_net().state_dict(), "odd": odd_tensor(2)})


def _llama_tp(rank: int, world: int, source: str, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import rank0load

    hf._quiet()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = rank0load.load_sharded(hf.TPLlama(), source, mesh, shard_fn=hf.TPThenFSDP())
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    tp = mesh.get_coordinate()[1]
    # TP weights live on the 2-D mesh; the rest on mesh["dp"], whose tp=1 slice holds replicas.
    held = _held(model, lambda p: p.device_mesh.ndim == 2 or tp == 0)
    messages = _Messages()
    report = rank0load.save_sharded(model, out, max_staging_bytes=4096, max_shard_size="20KB")
    return {"report": report, "messages": messages.summary(), "placements": placements, "held": held}


@pytest.mark.slow
def test_tensor_parallel_then_fsdp2_to_from_pretrained(tmp_path) -> None:
    """The README's recipe on dp=2 x tp=2: colwise weights are FSDP2's uneven ``_StridedShard`` (38
    rows, 19 per tp rank), rowwise ones ``(Shard(0), Shard(1))``, norms and embeddings on the "dp"
    sub-mesh. Saved with 4 KiB of staging, nothing gathered, read back by from_pretrained exactly."""
    from transformers import AutoModelForCausalLM

    source, out = str(tmp_path / "source"), str(tmp_path / "out")
    torch.manual_seed(1)
    ref = hf.TPLlama()()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.5)
    ref.save_pretrained(source, max_shard_size="20KB")
    results = _dist.ok(_dist.run(_llama_tp, 4, source, out, timeout=240))
    placements = results[0]["placements"]
    assert "_StridedShard" in placements["model.layers.0.mlp.up_proj.weight"]
    assert placements["model.layers.0.mlp.down_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
    for r in results:
        assert r["report"].gathered_whole == ()
        assert r["messages"]["largest"] <= 1024
    # Each rank sends exactly its own shards, once: ranks 1 and 3 (tp=1) only their TP blocks.
    for r in results[1:]:
        assert r["messages"]["sent"] == r["held"] > 0
    assert results[1]["held"] < results[2]["held"]
    got = read_checkpoint(out)
    assert_same(got, {k: v for k, v in ref.state_dict().items() if k in got})
    back = AutoModelForCausalLM.from_pretrained(out)
    assert_same(dict(back.state_dict()), dict(ref.state_dict()))


def expert_cols(model: nn.Module, mesh) -> None:
    """FSDP2 on each decoder layer, then the root, with the fused experts sharded on dimension 1."""
    from torch.distributed.fsdp import fully_shard

    def placement(p: torch.Tensor) -> Shard:
        return Shard(1) if p.ndim == 3 else Shard(0)

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)


def _moe(rank: int, world: int, source: str, out: str, staging: int) -> dict:
    from transformers import AutoModelForCausalLM

    import rank0load
    from tests import moe_models

    moe_models._quiet()
    cfg = moe_models.config("mixtral")
    model = rank0load.load_sharded(
        lambda: AutoModelForCausalLM.from_config(cfg), source, shard_fn=expert_cols
    )
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    report = rank0load.save_sharded(model, out, max_shard_size=moe_models.SHARD, max_staging_bytes=staging)
    return {"placements": str(experts.placements), "report": report}


@pytest.mark.slow
@hf.needs_transformers_5("fused MoE experts")
@pytest.mark.parametrize("staging", [5120, 16 << 20])
def test_moe_experts_sharded_on_dim_1_saved_per_expert(tmp_path, staging: int) -> None:
    """Fused experts (gate_up_proj [5, 48, 32], down_proj [5, 32, 24]) under FSDP2's Shard(1) on 2
    ranks (FSDP2 refuses uneven shards off dimension 0), saved with original_format: each chunk's
    rows land in the right per-expert tensors. 5 KiB of staging: an expert (6 KiB) is wider than
    half a slot (640 bytes), so a chunk is 5 rows of one expert, and the chunk of rows 20-24 of
    gate_up_proj straddles w1 (rows 0-23) and w3; 16 MiB: several whole experts per chunk."""
    from safetensors import safe_open

    from tests import moe_models

    source, out = str(tmp_path / "source"), str(tmp_path / "out")
    moe_models.save("mixtral", source)
    results = _dist.ok(_dist.run(_moe, 2, source, out, staging))
    assert results[0]["placements"] == "(Shard(dim=1),)"
    want = {}
    for file in sorted(set(moe_models.weight_map(source).values())):
        with safe_open(os.path.join(source, file), "pt") as f:
            want.update({k: f.get_tensor(k) for k in f.keys()})
    got = read_checkpoint(out)
    assert any(".experts.4.w1." in k for k in got)
    assert_same(got, want)
    assert all(r["report"].gathered_whole == () for r in results)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _bounded(rank: int, world: int, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    import rank0load

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096, bias=False))  # 64 MiB in fp32, Shard(1): 32 MiB each
    parallelize_module(model, init_device_mesh("cpu", (world,)), {"0": RowwiseParallel()})
    # The first save pays torch's one-time lazy imports and the writer's first pages; measure the second.
    rank0load.save_sharded(model, out)
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    report = rank0load.save_sharded(model, out)
    return {"transient": _status("VmHWM") - before, "report": report}


@pytest.mark.slow  # a 64 MiB weight, saved twice
def test_tensor_parallel_save_ram_stays_bounded(tmp_path) -> None:
    out = str(tmp_path / "out")
    results = _dist.ok(_dist.run(_bounded, 2, out, timeout=180))
    full = 4096 * 4096 * 4
    for r in results:
        assert r["report"].gathered_whole == ()
        # full_tensor() would cost every rank 64 MiB. Staging is 16 MiB of which rank 0 touches at
        # most all, the others only what a cast needs (none here); the rest is allocator slack.
        assert r["transient"] < full // 3, [f"{x['transient'] / 2**20:.0f} MiB" for x in results]
    torch.manual_seed(0)
    want = nn.Sequential(nn.Linear(4096, 4096, bias=False)).state_dict()
    assert_same(read_checkpoint(out), want)
