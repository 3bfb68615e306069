"""Tensor-parallel layouts (``Shard(1)``, ``Shard(2)``, uneven) go point to point as blocks cut by
rank 0, not broadcast whole: bit-exact on 3 ranks, with a cast and with chunks of a few rows, and
with host RAM bounded by the staging budget on every rank (a 64 MiB rowwise weight on 2 ranks).
"""

from __future__ import annotations

import copy
import gc
import json
import os
import struct

import pytest
import torch
from torch import nn

from tests import _dist
from tests.models import assert_same, gather, reference, save_state, shard_tp, tp_net, trained_net


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _kinds(model, mesh) -> dict[str, str]:
    return {n: model.rank0load_report.kinds[n] for n, _ in model.named_parameters()}


def _runs(model) -> dict[str, object]:
    from rank0load.model import _layout

    return {n: _layout.block_runs(getattr(model, n)) for n in ("strided_rows", "strided_cols")}


def _three_ranks(rank: int, world: int, f32: str, bf16: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import rank0load

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    model = rank0load.load_sharded(tp_net, f32, mesh, shard_fn=shard_tp)
    out["f32"] = {
        "kinds": _kinds(model, mesh),
        "runs": _runs(model),
        "tensors": gather(model),
        "whole": model.rank0load_report.broadcast_whole,
    }
    # 4 KiB of staging: chunks of a few rows, blocks split across chunks; the 1200-byte rows of
    # `wide` no longer fit half a slot and take the broadcast path. bf16 on disk, fp32 in the model.
    model = rank0load.load_sharded(tp_net, bf16, mesh, shard_fn=shard_tp, max_staging_bytes=4096)
    out["bf16"] = {"tensors": gather(model), "whole": model.rank0load_report.broadcast_whole}
    return out


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blocks")
    ref = trained_net()
    save_state(ref, str(tmp / "f32.safetensors"))
    save_state(copy.deepcopy(ref), str(tmp / "bf16.safetensors"), dtype=torch.bfloat16)  # .to() is in place
    results = _dist.ok(
        _dist.run(_three_ranks, 3, str(tmp / "f32.safetensors"), str(tmp / "bf16.safetensors"))
    )
    return ref, results


def test_tensor_parallel_blocks_are_exact_on_three_ranks(three):
    ref, results = three
    for r in results:
        kinds = r["f32"]["kinds"]
        assert kinds["up.weight"] == "sharded"
        for name in ("emb.weight", "down.weight", "wide.weight", "cube", "strided_rows", "strided_cols"):
            assert kinds[name] == "block", (name, kinds)
        runs = r["f32"]["runs"]
        assert len(runs["strided_rows"][0]) == 2 and len(runs["strided_cols"][1]) == 2, runs
        assert_same(r["f32"]["tensors"], reference(ref))
        assert r["f32"]["whole"] == ()


def test_blocks_cast_and_span_chunks(three):
    ref, results = three
    want = {
        k: v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v for k, v in reference(ref).items()
    }
    want["scale"] = ref.scale.clone()  # buffers come from model_fn (the checkpoint has none)
    for r in results:
        got = r["bf16"]["tensors"]
        assert all(t.dtype == torch.float32 for t in got.values())
        assert r["bf16"]["whole"] == ("wide.weight",)  # 1200-byte rows, 512 bytes of half a slot
        assert_same(got, want)


def _bounded(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    import rank0load

    mesh = init_device_mesh("cpu", (world,))

    def shard(model, mesh):
        parallelize_module(model, mesh, {"0": RowwiseParallel()})

    def make():
        return nn.Sequential(nn.Linear(4096, 4096, bias=False))

    # The first load pays torch's one-time lazy imports (tens of MiB); measure the second.
    rank0load.load_sharded(make, path, mesh, shard_fn=shard)  # dropped at once
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    model = rank0load.load_sharded(make, path, mesh, shard_fn=shard)
    peak = _status("VmHWM")
    local = model[0].weight.to_local()
    resident = local.numel() * local.element_size()
    return {
        "kind": model.rank0load_report.kinds["0.weight"],
        "transient": peak - before - resident,
        "checksum": float(model[0].weight.detach().full_tensor().double().sum()),
    }


@pytest.mark.slow  # a 64 MiB weight, loaded twice
def test_tensor_parallel_host_ram_stays_bounded(tmp_path):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4096, 4096, bias=False))  # 64 MiB in fp32
    save_state(ref, str(tmp_path / "big.safetensors"))
    results = _dist.ok(_dist.run(_bounded, 2, str(tmp_path / "big.safetensors"), timeout=180))
    full = 4096 * 4096 * 4
    for r in results:
        assert r["kind"] == "block"
        # Broadcasting the weight whole would cost every rank at least 64 MiB. Staging is 16 MiB
        # (rank 0 only); the rest is allocator slack.
        assert r["transient"] < full // 2, [f"{x['transient'] / 2**20:.0f} MiB" for x in results]
        assert r["checksum"] == float(ref[0].weight.detach().double().sum())


def _different_budgets(rank: int, world: int, path: str) -> None:
    import rank0load
    from tests.models import toy

    rank0load.load_sharded(toy, path, max_staging_bytes=(1 + rank) << 20)


def test_ranks_with_different_staging_budgets_fail_together(toy_checkpoint):
    err = _dist.same_error(_dist.run(_different_budgets, 2, toy_checkpoint), "RankMismatchError")
    assert "max_staging_bytes" in err.message


def _byte_range(path: str, key: str) -> tuple[int, int]:
    """Where ``key``'s bytes are in a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        start, stop = json.loads(f.read(n))[key]["data_offsets"]
    return 8 + n + start, 8 + n + stop


def _read_error_then_good_load(rank: int, world: int, f32: str, bad: tuple[int, int]) -> dict:
    """A read error on rank 0 inside a Shard(1) weight's bytes, then a good load in the same group:
    once while rank 0 streams the BLOCK chunks (``local_reads=False``: its reader thread, then
    ``fan_out``), once while every rank reads its own blocks (rank 0's own reads)."""
    import errno

    from torch.distributed.device_mesh import init_device_mesh

    import rank0load
    import rank0load.load._readahead as reads_mod

    mesh = init_device_mesh("cpu", (world,))
    original = reads_mod.read_vectored

    def failing(fd, buf, offset, path):
        if bad[0] <= offset < bad[1]:  # a chunk of the BLOCK entry
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return original(fd, buf, offset, path)

    out: dict = {}
    for local_reads in (False, True):
        if rank == 0:
            reads_mod.read_vectored = failing
        error = None
        try:
            rank0load.load_sharded(
                tp_net, f32, mesh, shard_fn=shard_tp, max_staging_bytes=4096, local_reads=local_reads
            )
        except rank0load.LoadError as exc:
            error = (type(exc).__name__, str(exc))
        finally:
            reads_mod.read_vectored = original
        model = rank0load.load_sharded(tp_net, f32, mesh, shard_fn=shard_tp)
        out[local_reads] = {"error": error, "tensors": gather(model)}
    return out


@pytest.mark.slow
def test_read_error_while_blocks_stream_fails_every_rank(tmp_path):
    ref = trained_net()
    path = str(tmp_path / "f32.safetensors")
    save_state(ref, path)
    results = _dist.ok(_dist.run(_read_error_then_good_load, 3, path, _byte_range(path, "down.weight")))
    for local_reads in (False, True):
        errors = {r[local_reads]["error"] for r in results}
        assert len(errors) == 1 and None not in errors, (local_reads, errors)
        ((name, message),) = errors
        assert "f32.safetensors" in message and "Input/output error" in message, message
        for r in results:
            assert_same(r[local_reads]["tensors"], reference(ref))


def _dies_while_cutting(rank: int, world: int, path: str, marker: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    import rank0load
    import rank0load.common._distribute as d

    mesh = init_device_mesh("cpu", (world,))
    if rank == 0:
        original = d.dist.isend
        calls = [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:
                open(marker, "w").close()
                os._exit(17)
            return original(*args, **kwargs)

        d.dist.isend = failing
    # local_reads=False: the stream itself (local readers would cut their own blocks, no isend)
    rank0load.load_sharded(tp_net, path, mesh, shard_fn=shard_tp, max_staging_bytes=4096, local_reads=False)
    return "loaded"


@pytest.mark.slow
def test_rank0_dying_while_blocks_stream_fails_the_others(tmp_path):
    path = str(tmp_path / "f32.safetensors")
    save_state(trained_net(), path)
    marker = str(tmp_path / "died")
    results, codes, _ = _dist.spawn(
        _dies_while_cutting, 3, path, marker, timeout=90, pg_timeout=5.0, exit_at_once=True
    )
    assert codes[0] == 17 and os.path.exists(marker), codes
    for r in results[1:]:
        assert isinstance(r, _dist.Raised) and "LoadError" in r.bases, r
        assert "died or stalled" in r.message, r.message
