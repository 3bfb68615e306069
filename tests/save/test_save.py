"""save_sharded on gloo ranks: the files (split, index, alignment, padding), round trips through
load_sharded and transformers' from_pretrained bit for bit, dtype casting, HSDP replicas sent once,
and faults (out_dir not writable, disk full, a rank killed), each leaving the old checkpoint intact."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator

import pytest
import torch

from tests import _dist, hf
from tests.models import Toy, assert_same, gather, read_checkpoint

pytestmark = pytest.mark.torch_range  # its slow tests run on the torch-range CI legs too

SAVED_SUFFIXES = (".safetensors", ".json")


def trained(dim: int = 5, seed: int = 0) -> Toy:
    """A Toy with random weights and BatchNorm statistics, the same on every rank for a seed."""
    torch.manual_seed(seed)
    m = Toy(dim=dim)
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(-1, 1)
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.num_batches_tracked.fill_(11)
        m.step.fill_(42)
    return m.eval()


def expected(dim: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    """What the checkpoint of ``trained(dim, seed)`` holds: the tied head once."""
    return {k: v for k, v in trained(dim, seed).state_dict().items() if k != "head.weight"}


def sharded(dim: int = 5, seed: int = 0, mesh_shape: tuple[int, ...] | None = None) -> Toy:
    """``trained(dim, seed)`` under fully_shard (blocks, then the root); HSDP on a 2-D mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape = mesh_shape or (dist.get_world_size(),)
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = trained(dim, seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def leftovers(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


# ---------------------------------------------------------------------------------------------- ranks


def _round_trip(rank: int, world: int, out: str, kwargs: dict) -> dict:
    import rank0load
    from tests.models import toy

    model = sharded()
    report = rank0load.save_sharded(model, out, **kwargs)
    again = rank0load.load_sharded(toy, out, dtype=kwargs.get("dtype"))
    return {"tensors": gather(again), "report": report}


@pytest.mark.parametrize("world", [2, 3])
def test_round_trip(tmp_path, world: int) -> None:
    """save -> load gives every tensor bit for bit; the file holds the tied head once."""
    out = str(tmp_path / "ckpt")
    results = _dist.ok(_dist.run(_round_trip, world, out, {}))
    want = {k: v for k, v in trained().state_dict(keep_vars=False).items()}
    want["head.weight"] = want["emb.weight"]
    for r in results:
        got = {k: v for k, v in r["tensors"].items() if k != "scale"}
        assert_same(got, want)
    assert_same(read_checkpoint(out), expected())
    report = results[0]["report"]
    assert report.files == ("model.safetensors",) and report.bytes == sum(
        t.numel() * t.element_size() for t in expected().values()
    )
    assert report.gathered_whole == () and leftovers(out) == []


def test_several_files_replace_an_older_save(tmp_path) -> None:
    """A small max_shard_size: several files and an index; a later save into the same directory
    with one file removes the earlier files, and the other way round."""
    out = str(tmp_path / "ckpt")
    os.makedirs(out)
    with open(os.path.join(out, "model-00001-of-00009.safetensors"), "wb") as f:
        f.write(b"stale")
    _dist.ok(_dist.run(_round_trip, 2, out, {"max_shard_size": "0.0002MB"}))
    names = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in names and "model-00001-of-00009.safetensors" not in names
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 2 and all(n.endswith(f"-of-{len(shards):05d}.safetensors") for n in shards)
    assert_same(read_checkpoint(out), expected())
    _dist.ok(_dist.run(_round_trip, 2, out, {}))
    assert sorted(os.listdir(out)) == ["model.safetensors"]


def test_dtype_casts_floats_only(tmp_path) -> None:
    out = str(tmp_path / "ckpt")
    results = _dist.ok(_dist.run(_round_trip, 3, out, {"dtype": torch.bfloat16}))
    got = read_checkpoint(out)
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in expected().items()}
    assert_same(got, want)
    assert got["step"].dtype == torch.int64 and got["bn.num_batches_tracked"].dtype == torch.int64
    assert results[0]["report"].bytes == sum(t.numel() * t.element_size() for t in want.values())


def test_split_matches_huggingface_hub() -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    from rank0load.save._saveplan import _split, parse_size

    sizes = [30, 70, 10, 200, 50, 50, 1, 99]
    state = {f"t{i}": torch.zeros(s, dtype=torch.uint8) for i, s in enumerate(sizes)}
    for limit in ["100KB", "0.0001MB", 60, 1000]:
        split = split_torch_state_dict_into_shards(state, max_shard_size=limit)
        groups = [[int(k[1:]) for k in ks] for ks in split.filename_to_tensors.values()]
        assert _split(sizes, parse_size(limit)) == groups, limit


def _hsdp(rank: int, world: int, out: str) -> int:
    import torch.distributed as dist

    import rank0load

    sends = []
    real = dist.isend

    def counting(tensor, dst, *args, **kwargs):
        sends.append(tensor.numel())
        return real(tensor, dst, *args, **kwargs)

    dist.isend = counting
    rank0load.save_sharded(sharded(mesh_shape=(2, 2)), out)
    return len(sends)


def test_hsdp_replicas_sent_once(tmp_path) -> None:
    out = str(tmp_path / "ckpt")
    sends = _dist.ok(_dist.run(_hsdp, 4, out))
    assert sends[0] == 0 and sends[1] > 0 and sends[2] == sends[3] == 0  # ranks 2, 3: replica 1
    assert_same(read_checkpoint(out), expected())


def _tp(rank: int, world: int, out: str) -> dict:
    """fc rowwise-parallel over "tp" then FSDP2 over "dp": fc.weight is (Shard(0), Shard(1)), sent
    as blocks (tests/save/test_save_tp.py); the rest lives on the "dp" sub-mesh and is sent row by row."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    import rank0load

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = trained(dim=6)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"fc": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return {"report": rank0load.save_sharded(model, out)}


@pytest.mark.slow
def test_tensor_parallel_gathers_nothing(tmp_path) -> None:
    out = str(tmp_path / "ckpt")
    results = _dist.ok(_dist.run(_tp, 4, out))
    assert all(r["report"].gathered_whole == () for r in results)
    assert_same(read_checkpoint(out), expected(dim=6))


# -------------------------------------------------------------------------------------- transformers


def _hf_save(rank: int, world: int, name: str, source: str, out: str) -> bool:
    import rank0load

    hf._quiet()
    model = rank0load.load_sharded(hf.Factory(name), source)
    rank0load.save_sharded(model, out, max_shard_size="20KB")
    return True  # run() takes None for a rank that left no result


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_from_pretrained(tmp_path, name: str) -> None:
    """Loaded from a save_pretrained checkpoint on 2 ranks, saved back, read by from_pretrained."""
    from transformers import AutoModelForCausalLM

    source, out = str(tmp_path / "source"), str(tmp_path / "out")
    ref = hf.pretrained(name)
    ref.save_pretrained(source)
    _dist.ok(_dist.run(_hf_save, 2, name, source, out))
    assert os.path.exists(os.path.join(out, "config.json"))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"
    if name == "llama":
        assert "lm_head.weight" not in read_checkpoint(out)
    back = AutoModelForCausalLM.from_pretrained(out)
    assert_same(dict(back.state_dict()), dict(ref.state_dict()))


# --------------------------------------------------------------------------------------------- faults


@contextlib.contextmanager
def tmpfs(path: str, options: str) -> Iterator[str]:
    os.makedirs(path)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        yield path
    finally:
        subprocess.run(["umount", path], check=True)


def fill(path: str, keep: int) -> None:
    """Fill the filesystem of ``path``, then give ``keep`` bytes (whole pages) back."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
        size = os.fstat(fd).st_size
        os.ftruncate(fd, max(0, size // 4096 * 4096 - keep))
    finally:
        os.close(fd)


def _save(rank: int, world: int, out: str, dim: int, seed: int) -> bool:
    import rank0load

    rank0load.save_sharded(sharded(dim, seed), out)
    return True


def _snapshot(directory: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


def test_out_dir_under_a_file(tmp_path) -> None:
    (tmp_path / "file").write_text("not a directory")
    err = _dist.same_error(_dist.run(_save, 2, str(tmp_path / "file" / "ckpt"), 5, 0), "SaveError")
    assert "creating the output files failed on 1 of 2 ranks: rank 0: NotADirectoryError" in err.message


@pytest.mark.slow
def test_read_only_and_disk_full_keep_the_old_checkpoint(tmp_path) -> None:
    with tmpfs(str(tmp_path / "ro"), "size=1m,ro") as ro:
        err = _dist.same_error(_dist.run(_save, 2, ro, 5, 0), "SaveError")
        assert "rank 0: OSError: [Errno 30] Read-only file system" in err.message
    with tmpfs(str(tmp_path / "small"), "size=64k") as small:
        _dist.ok(_dist.run(_save, 2, small, 40, 0))
        before = _snapshot(small)
        fill(os.path.join(small, "filler"), keep=4096)  # the new header fits, its data does not
        err = _dist.same_error(_dist.run(_save, 2, small, 40, 1), "SaveError")
        assert "writing the checkpoint failed on 1 of 2 ranks: rank 0: OSError: [Errno 28]" in err.message
        os.unlink(os.path.join(small, "filler"))
        assert _snapshot(small) == before and leftovers(small) == []
        assert_same(read_checkpoint(small), expected(40, 0))


def _killed(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    import rank0load

    if rank == 1:
        real = dist.isend
        calls = []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                os._exit(3)
            return real(*args, **kwargs)

        dist.isend = dying
    rank0load.save_sharded(sharded(40, 1), out, max_staging_bytes=4096)


@pytest.mark.slow
def test_killed_rank_keeps_the_old_checkpoint(tmp_path) -> None:
    out = str(tmp_path / "ckpt")
    _dist.ok(_dist.run(_save, 2, out, 40, 0))
    before = _snapshot(out)
    results, codes, elapsed = _dist.spawn(_killed, 2, out, pg_timeout=20, timeout=90, exit_at_once=True)
    assert codes[1] == 3 and isinstance(results[0], _dist.Raised), results
    assert "SaveError" in results[0].bases and "writing the checkpoint failed" in results[0].message
    assert _snapshot(out) == before and leftovers(out) == []


def _crash_while_renaming(rank: int, world: int, out: str) -> None:
    import rank0load

    if rank == 0:
        real, renamed = os.replace, []

        def dying(src, dst, *args, **kwargs):
            real(src, dst, *args, **kwargs)
            if str(dst).endswith(".safetensors"):
                renamed.append(dst)
                if len(renamed) == 1:
                    os._exit(3)  # rank 0 dies after the first new shard took its final name

        os.replace = dying
    rank0load.save_sharded(sharded(40, 1), out, max_shard_size="0.003MB")


@pytest.mark.slow
def test_crash_while_renaming_keeps_the_earlier_checkpoint(tmp_path) -> None:
    """Rank 0 dies between the renames of a save whose files have the names of an earlier save's
    (same number of files): the earlier files were hard-linked aside and its index pointed at them
    first, so the directory still holds the earlier checkpoint, whole, through its index; the next
    save removes the extra names."""
    from safetensors import safe_open

    out = str(tmp_path / "ckpt")
    _dist.ok(_dist.run(_save_sharded_files, 2, out, 0))
    first = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in first and len(first) > 2
    _, codes, _ = _dist.spawn(_crash_while_renaming, 2, out, pg_timeout=20, timeout=90, exit_at_once=True)
    assert codes[0] == 3, codes
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert any(".old-" in name for name in weight_map.values()), weight_map  # it did cross the window
    got = {}
    for key, name in weight_map.items():
        with safe_open(os.path.join(out, name), "pt") as f:
            got[key] = f.get_tensor(key)
    assert_same(got, expected(40, 0))
    _dist.ok(_dist.run(_save_sharded_files, 2, out, 1))
    assert not [n for n in os.listdir(out) if ".old-" in n]
    assert_same(read_checkpoint(out), expected(40, 1))


def _save_sharded_files(rank: int, world: int, out: str, seed: int) -> bool:
    import rank0load

    rank0load.save_sharded(sharded(40, seed), out, max_shard_size="0.003MB")
    return True


# ------------------------------------------------------------------------------- MoE, original format


def _moe_save(rank: int, world: int, name: str, source: str, out: str) -> dict:
    from transformers import AutoModelForCausalLM

    import rank0load
    from rank0load.integrations._convert import TransformersReversal
    from tests import moe_models

    moe_models._quiet()
    cfg = moe_models.config(name)
    model = rank0load.load_sharded(lambda: AutoModelForCausalLM.from_config(cfg), source)
    # fully_shard renamed the classes: transformers finds the mapping through config.model_type
    found = (type(model).__name__, len(TransformersReversal(model)._converters))
    report = rank0load.save_sharded(model, out, max_shard_size=moe_models.SHARD)
    return {"found": found, "tensors": report.tensors, "files": len(report.files)}


@pytest.mark.slow
@hf.needs_transformers_5("fused MoE experts")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_back_to_per_expert_tensors(tmp_path, name: str, world: int) -> None:
    """Loaded from save_pretrained's per-expert checkpoint into fused experts, saved back with
    original_format=True: the same key set, every tensor bit for bit, and from_pretrained agrees."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tests import moe_models

    source, out = str(tmp_path / "source"), str(tmp_path / "out")
    moe_models.save(name, source)
    results = _dist.ok(_dist.run(_moe_save, world, name, source, out))
    want = {}
    for file in sorted(set(moe_models.weight_map(source).values())):
        with safe_open(os.path.join(source, file), "pt") as f:
            want.update({k: f.get_tensor(k) for k in f.keys()})
    got = read_checkpoint(out)
    assert sorted(got) == sorted(want)
    assert any(".experts.4." in k for k in got) and not any(k.endswith("gate_up_proj") for k in got)
    assert_same(got, want)
    assert results[0]["found"][0].startswith("FSDP") and results[0]["found"][1] == 2
    assert results[0]["tensors"] == len(want) and results[0]["files"] > 2
    back, ref = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(source)
    assert_same(dict(back.state_dict()), dict(ref.state_dict()))


@pytest.mark.slow
def test_t5_four_way_tie(tmp_path) -> None:
    """T5 ties shared, encoder.embed_tokens, decoder.embed_tokens and lm_head: saved once, as
    ``shared.weight`` (what save_pretrained writes), and from_pretrained gives every tensor back."""
    from safetensors import safe_open
    from transformers import T5ForConditionalGeneration

    source, out = str(tmp_path / "source"), str(tmp_path / "out")
    ref = hf.pretrained("t5")
    ref.save_pretrained(source)
    _dist.ok(_dist.run(_hf_save, 2, "t5", source, out))
    with safe_open(os.path.join(source, "model.safetensors"), "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}
    got = read_checkpoint(out)
    assert sorted(got) == sorted(want) and "shared.weight" in got
    assert not {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"} & set(got)
    assert_same(got, want)
    back = T5ForConditionalGeneration.from_pretrained(out)
    assert_same(dict(back.state_dict()), dict(ref.state_dict()))
    tied = [back.shared.weight, back.encoder.embed_tokens.weight, back.decoder.embed_tokens.weight]
    assert all(t is back.lm_head.weight for t in tied)
