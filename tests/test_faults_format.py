"""Fault corpus: every bad input or failure raises the same LoadError on every rank, never a hang.

Each case builds a broken checkpoint (or a broken model_fn / shard_fn / key_map) from a good toy
checkpoint in ``tmp_path``. All cases run in ONE pair of gloo ranks, one after the other in the same
process group, then a good load that must be bit-exact: so every case also proves that the process
group is still usable after the failure. The parametrised test reports each case on its own.

While loading, an audit hook on every rank records any attempt to open a checkpoint file for
writing or to rename / remove / truncate / chmod anything under the checkpoint tree; afterwards
every file's bytes and mtime are compared with a snapshot taken before.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests import _dist
from tests.models import Toy, assert_same, gather, reference, save_state, toy, trained_toy

PG_TIMEOUT = 30.0  # seconds; every failing case must finish well within it
CASE_LIMIT = 10.0  # seconds one failing case may take on a rank (they take well under one)


# --------------------------------------------------------------------------------------------
# Picklable model_fn / shard_fn / key_map variants (spawned ranks import this module).


class RaiseOnRank:
    """model_fn that raises on one rank only."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self) -> Toy:
        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            raise RuntimeError(f"model_fn failed on purpose on rank {self.rank}")
        return Toy()


class ShardRaiseOnRank:
    """shard_fn that raises on one rank only, after doing the default sharding elsewhere."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, model, mesh) -> None:
        import torch.distributed as dist

        from rank0load import default_shard_fn

        if dist.get_rank() == self.rank:
            raise ValueError(f"shard_fn failed on purpose on rank {self.rank}")
        default_shard_fn(model, mesh)


class WiderOnRank:
    """model_fn whose output differs on one rank (dim 6 instead of 5)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self) -> Toy:
        import torch.distributed as dist

        return Toy(dim=6) if dist.get_rank() == self.rank else Toy()


class _FailingInitLinear(torch.nn.Linear):
    def reset_parameters(self) -> None:
        import torch.distributed as dist

        # Fine during the meta build; fails when the loader initialises a missing weight on rank 1.
        if not self.weight.is_meta and dist.get_rank() == 1:
            raise MemoryError("reset_parameters failed on purpose on rank 1")
        super().reset_parameters()


def toy_failing_init() -> Toy:
    model = Toy()
    model.blocks[1].fc = _FailingInitLinear(5, 5)
    return model


class _NoopInitLinear(torch.nn.Linear):
    def reset_parameters(self) -> None:  # claims to initialise, writes nothing
        pass


def toy_noop_init() -> Toy:
    model = Toy()
    model.blocks[1].fc = _NoopInitLinear(5, 5)
    return model


def not_a_module():
    return "not a module"


def collide_biases(key: str) -> str:
    return "blocks.0.fc.bias" if key == "blocks.1.fc.bias" else key


def int_key_map(key: str) -> object:
    return 7 if key == "step" else key


def raising_key_map(key: str) -> str:
    if key == "bn.bias":
        raise KeyError(key)
    return key


# --------------------------------------------------------------------------------------------
# Building broken checkpoints.


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_st(path: str) -> tuple[dict, bytes]:
    raw = _read(path)
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_st(
    path: str,
    header: dict | None,
    data: bytes,
    *,
    header_bytes: bytes | None = None,
    length: int | None = None,
) -> None:
    hb = header_bytes if header_bytes is not None else json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb) if length is None else length) + hb + data)


def good_state() -> dict[str, torch.Tensor]:
    """The trained toy's state dict as save_model stores it (head.weight is an alias of emb.weight)."""
    sd = {k: v.detach().clone() for k, v in trained_toy().state_dict().items()}
    sd.pop("head.weight")
    return sd


def write_sharded(d: str, sd: dict[str, torch.Tensor], weight_map: dict[str, str] | None = None) -> str:
    """Two shards and an index, as save_pretrained writes them."""
    keys = sorted(sd)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    wm = {}
    for name, part in zip(names, halves):
        save_file({k: sd[k] for k in part}, os.path.join(d, name))
        wm.update({k: name for k in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map if weight_map is not None else wm}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return d


def _single(d: str, sd: dict | None = None) -> str:
    path = os.path.join(d, "model.safetensors")
    save_file(sd if sd is not None else good_state(), path)
    return path


def _mutate_header(d: str, fn: Callable[[dict, bytes], tuple[dict, bytes]]) -> str:
    path = _single(d)
    header, data = read_st(path)
    header, data = fn(header, data)
    write_st(path, header, data)
    return path


def _set(key: str, field_: str, value: Any) -> Callable[[dict, bytes], tuple[dict, bytes]]:
    def fn(h: dict, data: bytes) -> tuple[dict, bytes]:
        h[key][field_] = value
        return h, data

    return fn


def _overlap(h: dict, data: bytes) -> tuple[dict, bytes]:
    h["blocks.1.fc.bias"]["data_offsets"] = list(h["blocks.0.fc.bias"]["data_offsets"])
    return h, data


def _gap_in_middle(h: dict, data: bytes) -> tuple[dict, bytes]:
    first = min((v for k, v in h.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0])
    cut = first["data_offsets"][1]
    for k, v in h.items():
        if k != "__metadata__" and v["data_offsets"][0] >= cut:
            v["data_offsets"] = [o + 4 for o in v["data_offsets"]]
    return h, data[:cut] + b"\0" * 4 + data[cut:]


def _raw_file(d: str, edit: Callable[[bytes], bytes]) -> str:
    path = _single(d)
    raw = _read(path)
    with open(path, "wb") as f:
        f.write(edit(raw))
    return path


def _header_len(raw: bytes) -> int:
    return struct.unpack("<Q", raw[:8])[0]


def _garbage_header(raw: bytes) -> bytes:
    n = _header_len(raw)
    return raw[:8] + b"{" + b"#" * (n - 1) + raw[8 + n :]


def _non_utf8_header(raw: bytes) -> bytes:
    n = _header_len(raw)
    return raw[:8] + b"{\xff\xfe" + raw[11 : 8 + n] + raw[8 + n :]


def _index_with(d: str, edit: Callable[[dict, str], None]) -> str:
    write_sharded(d, good_state())
    ipath = os.path.join(d, "model.safetensors.index.json")
    index = json.loads(_read(ipath))
    edit(index, d)
    with open(ipath, "w") as f:
        json.dump(index, f)
    return d


def _outside_file(d: str) -> str:
    """A valid safetensors file next to (not inside) the checkpoint directory ``d``."""
    outside = os.path.join(os.path.dirname(d), os.path.basename(d) + "-outside")
    os.makedirs(outside, exist_ok=True)
    return _single(outside)


def _escape_absolute(index: dict, d: str) -> None:
    index["weight_map"]["bn.bias"] = _outside_file(d)


def _escape_dotdot(index: dict, d: str) -> None:
    path = _outside_file(d)
    index["weight_map"]["bn.bias"] = os.path.join(
        "..", os.path.basename(os.path.dirname(path)), "model.safetensors"
    )


def _escape_symlink(index: dict, d: str) -> None:
    os.symlink(_outside_file(d), os.path.join(d, "model-00003-of-00003.safetensors"))
    index["weight_map"]["bn.bias"] = "model-00003-of-00003.safetensors"


def _index_names_missing_file(index: dict, d: str) -> None:
    index["weight_map"]["bn.bias"] = "model-00003-of-00003.safetensors"


def _index_wrong_file(index: dict, d: str) -> None:
    wm = index["weight_map"]
    key = next(k for k, v in sorted(wm.items()) if v.startswith("model-00001"))
    wm[key] = "model-00002-of-00002.safetensors"
    index["_key"] = key


def _index_lists_phantom(index: dict, d: str) -> None:
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"


def _index_omits_key(index: dict, d: str) -> None:
    del index["weight_map"]["bn.bias"]


def _stored_twice(d: str) -> str:
    sd = good_state()
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:8]}, os.path.join(d, "a.safetensors"))
    save_file({k: sd[k] for k in keys[7:]}, os.path.join(d, "b.safetensors"))
    return d


def _without(key: str) -> Callable[[str], str]:
    def build(d: str) -> str:
        sd = good_state()
        del sd[key]
        return _single(d, sd)

    return build


def _with_extra(d: str) -> str:
    sd = good_state()
    sd["extra.bias"] = torch.ones(3)
    return _single(d, sd)


def _tied_differ(d: str) -> str:
    sd = good_state()
    sd["head.weight"] = sd["emb.weight"] + 1
    return _single(d, sd)


def _wider(d: str) -> str:
    torch.manual_seed(0)
    path = os.path.join(d, "model.safetensors")
    save_state(Toy(vocab=8), path)
    return path


def _write_text(name: str, text: str) -> Callable[[str], str]:
    def build(d: str) -> str:
        write_sharded(d, good_state())
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
        return d

    return build


# --------------------------------------------------------------------------------------------
# The corpus.


@dataclass
class Case:
    id: str
    build: Callable[[str], str]  # case directory -> ckpt_path
    error: str  # the LoadError subclass every rank must raise
    names: tuple[str, ...]  # the message must name these (file, key, expected / found)
    todo: tuple[str, ...]  # ... and say what to do: one of these
    kwargs: dict = field(default_factory=dict)
    fault: str | None = None  # a failure injected in the stream phase (see _inject)


REDO = ("Re-download", "re-save", "Re-save", "re-download")
CASES = [
    Case(
        "path_missing",
        lambda d: os.path.join(d, "nope"),
        "CheckpointNotFoundError",
        ("nope", "does not exist"),
        ("Pass a directory",),
    ),
    Case(
        "dir_without_safetensors",
        lambda d: (open(os.path.join(d, "README.md"), "w").close(), d)[1],
        "CheckpointNotFoundError",
        ("holds no *.safetensors",),
        ("save_file", "save_pretrained"),
    ),
    Case(
        "index_not_json",
        _write_text("model.safetensors.index.json", '{"weight_map": {'),
        "CheckpointFormatError",
        ("model.safetensors.index.json", "not valid JSON"),
        REDO,
    ),
    Case(
        "index_without_weight_map",
        _write_text("model.safetensors.index.json", '{"metadata": {}}'),
        "CheckpointFormatError",
        ("model.safetensors.index.json", "weight_map"),
        REDO,
    ),
    Case(
        "index_names_missing_file",
        lambda d: _index_with(d, _index_names_missing_file),
        "CheckpointNotFoundError",
        ("model-00003-of-00003.safetensors", "does not exist"),
        REDO,
    ),
    Case(
        "index_absolute_path",
        lambda d: _index_with(d, _escape_absolute),
        "CheckpointFormatError",
        ("refusing", "-outside"),
        ("relative paths inside the checkpoint directory",),
    ),
    Case(
        "index_dotdot",
        lambda d: _index_with(d, _escape_dotdot),
        "CheckpointFormatError",
        ("refusing", "..", "-outside"),
        ("relative paths inside the checkpoint directory",),
    ),
    Case(
        "index_symlink_escapes",
        lambda d: _index_with(d, _escape_symlink),
        "CheckpointFormatError",
        ("refusing", "model-00003-of-00003.safetensors", "outside the checkpoint directory"),
        ("symlink",),
    ),
    Case(
        "index_key_in_other_file",
        lambda d: _index_with(d, _index_wrong_file),
        "CheckpointFormatError",
        ("model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors", "stored in"),
        REDO,
    ),
    Case(
        "index_lists_unstored_key",
        lambda d: _index_with(d, _index_lists_phantom),
        "CheckpointFormatError",
        ("'ghost.weight'", "model-00001-of-00002.safetensors", "no file stores it"),
        REDO,
    ),
    Case(
        "index_omits_stored_key",
        lambda d: _index_with(d, _index_omits_key),
        "CheckpointFormatError",
        ("'bn.bias'", "does not list"),
        REDO,
    ),
    Case(
        "key_stored_twice",
        _stored_twice,
        "CheckpointFormatError",
        ("stored twice", "a.safetensors", "b.safetensors"),
        ("Remove one copy",),
    ),
    Case(
        "file_tiny",
        lambda d: _raw_file(d, lambda raw: raw[:5]),
        "CheckpointFormatError",
        ("model.safetensors", "5 bytes"),
        REDO,
    ),
    Case(
        "file_truncated_in_header",
        lambda d: _raw_file(d, lambda raw: raw[:40]),
        "CheckpointFormatError",
        ("model.safetensors", "runs past the end"),
        REDO,
    ),
    Case(
        "file_truncated_in_data",
        lambda d: _raw_file(d, lambda raw: raw[:-10]),
        "CheckpointFormatError",
        ("model.safetensors", "truncated"),
        REDO,
    ),
    Case(
        "header_length_past_end",
        lambda d: _raw_file(d, lambda raw: struct.pack("<Q", len(raw)) + raw[8:]),
        "CheckpointFormatError",
        ("model.safetensors", "runs past the end"),
        REDO,
    ),
    Case(
        "header_length_huge",
        lambda d: _raw_file(d, lambda raw: struct.pack("<Q", 2**63 + 5) + raw[8:]),
        "CheckpointFormatError",
        ("model.safetensors", "exceeds"),
        REDO,
    ),
    Case(
        "header_not_json",
        lambda d: _raw_file(d, _garbage_header),
        "CheckpointFormatError",
        ("model.safetensors", "not valid JSON"),
        REDO,
    ),
    Case(
        "header_not_utf8",
        lambda d: _raw_file(d, _non_utf8_header),
        "CheckpointFormatError",
        ("model.safetensors", "not valid JSON"),
        REDO,
    ),
    Case(
        "header_not_object",
        lambda d: (
            write_st(os.path.join(d, "model.safetensors"), [], b""),
            os.path.join(d, "model.safetensors"),
        )[1],
        "CheckpointFormatError",
        ("model.safetensors", "not a JSON object"),
        REDO,
    ),
    Case(
        "offsets_out_of_range",
        lambda d: _mutate_header(d, _set("bn.bias", "data_offsets", [0, 10**6])),
        "CheckpointFormatError",
        ("model.safetensors", "'bn.bias'", "1000000"),
        REDO,
    ),
    Case(
        "offsets_reversed",
        lambda d: _mutate_header(d, _set("bn.bias", "data_offsets", [20, 0])),
        "CheckpointFormatError",
        ("model.safetensors", "'bn.bias'", "[20, 0]"),
        REDO,
    ),
    Case(
        "offsets_size_mismatch",
        lambda d: _mutate_header(d, _set("bn.bias", "shape", [6])),
        "CheckpointFormatError",
        ("model.safetensors", "'bn.bias'", "24 bytes", "span 20"),
        REDO,
    ),
    Case(
        "offsets_overlap",
        lambda d: _mutate_header(d, _overlap),
        "CheckpointFormatError",
        ("model.safetensors", "overlaps"),
        REDO,
    ),
    Case(
        "offsets_gap",
        lambda d: _mutate_header(d, _gap_in_middle),
        "CheckpointFormatError",
        ("model.safetensors", "4 bytes before key", "belong to no tensor"),
        REDO,
    ),
    Case(
        "offsets_trailing_bytes",
        lambda d: _mutate_header(d, lambda h, data: (h, data + b"\0" * 8)),
        "CheckpointFormatError",
        ("model.safetensors", "8 bytes after the last tensor"),
        REDO,
    ),
    Case(
        "dtype_unknown",
        lambda d: _mutate_header(d, _set("bn.bias", "dtype", "F7")),
        "CheckpointFormatError",
        ("model.safetensors", "'bn.bias'", "'F7'", "known: "),
        REDO,
    ),
    Case(
        "shape_mismatch",
        _wider,
        "ModelMismatchError",
        ("'emb.weight'", "(8, 5)", "(7, 5)", "model.safetensors"),
        ("model_fn",),
    ),
    Case(
        "dtype_int_into_int64",
        lambda d: _single(d, {**good_state(), "step": torch.tensor(42, dtype=torch.int32)}),
        "ModelMismatchError",
        ("'step'", "I32", "torch.int64", "model.safetensors"),
        ("Build the model",),
    ),
    Case(
        "strict_missing",
        _without("bn.running_var"),
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
        _single,
        "ModelMismatchError",
        ("'blocks.0.fc.bias'", "'blocks.1.fc.bias'"),
        ("one checkpoint key only",),
        kwargs={"key_map": collide_biases},
    ),
    Case(
        "key_map_raises",
        _single,
        "ModelMismatchError",
        ("key_map('bn.bias')", "KeyError"),
        ("fix it",),
        kwargs={"key_map": raising_key_map},
    ),
    Case(
        "key_map_returns_int",
        _single,
        "ModelMismatchError",
        ("key_map(", "returned 7"),
        ("Fix key_map",),
        kwargs={"key_map": int_key_map},
    ),
    Case(
        "model_fn_raises_on_rank1",
        _single,
        "RankMismatchError",
        ("rank 1", "failed on purpose"),
        ("fix model_fn",),
        kwargs={"model_fn": RaiseOnRank(1)},
    ),
    Case(
        "model_fn_not_a_module",
        _single,
        "RankMismatchError",
        ("nn.Module", "str"),
        ("fix model_fn",),
        kwargs={"model_fn": not_a_module},
    ),
    Case(
        "shard_fn_raises_on_rank0",
        _single,
        "RankMismatchError",
        ("rank 0", "failed on purpose"),
        ("fix model_fn / shard_fn",),
        kwargs={"shard_fn": ShardRaiseOnRank(0)},
    ),
    Case(
        "ranks_build_different_models",
        _single,
        "RankMismatchError",
        ("ranks [1]",),
        ("same model on every rank",),
        kwargs={"model_fn": WiderOnRank(1)},
    ),
    Case(
        "init_missing_raises_on_rank1",
        _without("blocks.1.fc.weight"),
        "RankMismatchError",
        ("rank 1", "MemoryError", "failed on purpose"),
        ("load again",),
        kwargs={"model_fn": toy_failing_init, "strict": False},
    ),
    Case(
        "init_missing_writes_nothing",
        _without("blocks.1.fc.weight"),
        "ModelMismatchError",
        ("blocks.1.fc.weight", "not initialised"),
        ("reset_parameters()",),
        kwargs={"model_fn": toy_noop_init, "strict": False},
    ),
    Case(
        "read_error_mid_stream",
        _single,
        "LoadError",
        ("model.safetensors", "Input/output error"),
        ("check the disk", "Check the disk"),
        fault="eio_on_rank0",
    ),
]


@contextlib.contextmanager
def _inject(fault: str | None, rank: int):
    """Failures that cannot be validated up front, injected into the stream phase."""
    if fault is None:
        yield
        return
    if fault == "eio_on_rank0":
        import rank0load._stream as stream_mod

        original = stream_mod.read_into
        calls = [0]

        def failing_read_into(fd, buf, offset, path):
            calls[0] += 1
            if calls[0] == 3:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return original(fd, buf, offset, path)

        if rank == 0:
            stream_mod.read_into = failing_read_into
        try:
            yield
        finally:
            stream_mod.read_into = original
        return
    raise ValueError(fault)


# --------------------------------------------------------------------------------------------
# What the ranks run.


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_MUTATING_EVENTS = {
    "os.rename",
    "os.remove",
    "os.rmdir",
    "os.truncate",
    "os.chmod",
    "os.chown",
    "os.utime",
    "os.link",
    "os.symlink",
    "os.mkdir",
    "shutil.rmtree",
    "shutil.move",
    "shutil.copyfile",
}


def _watch(roots: list[str], never_open: list[str]) -> list[tuple]:
    """Install an audit hook recording writes and metadata changes under ``roots``, and any open at
    all under ``never_open`` (files an index points to outside its directory)."""
    seen: list[tuple] = []
    roots = [os.path.realpath(r) for r in roots]
    never_open = [os.path.realpath(r) for r in never_open]

    def under(p: object, dirs: list[str] = roots) -> bool:
        if isinstance(p, bytes):
            p = os.fsdecode(p)
        if not isinstance(p, (str, os.PathLike)):
            return False
        full = os.path.realpath(os.fspath(p))
        return any(full == r or full.startswith(r + os.sep) for r in dirs)

    def hook(event: str, args: tuple) -> None:
        try:
            if event == "open" and args and under(args[0], never_open):
                seen.append(("open-outside", os.fspath(args[0])))
            if event == "open" and len(args) >= 3 and isinstance(args[2], int) and args[2] & _WRITE_FLAGS:
                if under(args[0]):
                    seen.append((event, os.fspath(args[0]), args[2]))
            elif event in _MUTATING_EVENTS and any(under(a) for a in args):
                seen.append((event, *[os.fspath(a) for a in args if isinstance(a, (str, os.PathLike))]))
        except Exception:
            pass

    sys.addaudithook(hook)
    return seen


def _corpus(
    rank: int, world: int, cases: list[tuple], good: str, ckpt_root: str, probe_root: str, progress: str
) -> dict:
    import rank0load

    outside = [os.path.join(ckpt_root, n) for n in os.listdir(ckpt_root) if n.endswith("-outside")]
    seen = _watch([ckpt_root, probe_root], [*outside, probe_root])
    with open(os.path.join(probe_root, f"probe{rank}"), "w") as f:  # proves the hook sees writes
        f.write("x")
    _read(os.path.join(probe_root, f"probe{rank}"))  # ... and reads where nothing may be read
    out: dict[str, Any] = {"cases": {}}
    for cid, path, kwargs, fault in cases:
        with open(progress + f".rank{rank}", "a") as f:
            f.write(cid + "\n")
        kwargs = dict(kwargs)
        model_fn = kwargs.pop("model_fn", toy)
        started = time.monotonic()
        try:
            with _inject(fault, rank):
                rank0load.load_sharded(model_fn, path, **kwargs)
            out["cases"][cid] = ("returned", (), "", time.monotonic() - started)
        except Exception as exc:
            names = tuple(c.__name__ for c in type(exc).__mro__)
            out["cases"][cid] = (type(exc).__name__, names, str(exc), time.monotonic() - started)
    with open(progress + f".rank{rank}", "a") as f:
        f.write("good load\n")
    try:
        out["good"] = gather(rank0load.load_sharded(toy, good))
    except Exception as exc:
        out["good"] = f"{type(exc).__name__}: {exc}"
    out["writes"] = list(seen)
    return out


def _snapshot(root: str) -> dict[str, tuple]:
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        snap[dirpath] = ("dir", os.lstat(dirpath).st_mtime_ns, tuple(sorted(dirnames + filenames)))
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if os.path.islink(p):
                snap[p] = ("link", os.readlink(p), st.st_mtime_ns)
            else:
                snap[p] = ("file", hashlib.sha256(_read(p)).hexdigest(), st.st_mtime_ns, st.st_mode)
    return snap


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    ckpt_root, probe_root = base / "ckpts", base / "probe"
    ckpt_root.mkdir()
    probe_root.mkdir()
    runs = []
    for i, case in enumerate(CASES):
        d = ckpt_root / f"c{i:02d}"  # a neutral name: a message must not pass by quoting the case id
        d.mkdir()
        runs.append((case.id, case.build(str(d)), case.kwargs, case.fault))
    good_dir = ckpt_root / "good"
    good_dir.mkdir()
    good = str(good_dir / "model.safetensors")
    save_state(trained_toy(), good)
    before = _snapshot(str(ckpt_root))
    progress = str(base / "progress")
    try:
        results = _dist.run(
            _corpus,
            2,
            runs,
            good,
            str(ckpt_root),
            str(probe_root),
            progress,
            timeout=180,
            pg_timeout=PG_TIMEOUT,
        )
    except pytest.fail.Exception as exc:
        last = {}
        for r in range(2):
            p = f"{progress}.rank{r}"
            last[r] = _read(p).decode().split()[-1:] if os.path.exists(p) else []
        pytest.fail(f"{exc}; last case started per rank: {last}")
    return {"results": _dist.ok(results), "before": before, "after": _snapshot(str(ckpt_root))}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(corpus, case):
    """Every rank raises the same LoadError subclass, fast, naming what is wrong and what to do."""
    outcomes = [r["cases"][case.id] for r in corpus["results"]]
    for rank, (type_name, bases, message, seconds) in enumerate(outcomes):
        assert type_name != "returned", f"rank {rank} loaded without error"
        assert "LoadError" in bases, f"rank {rank} raised {type_name}, not a LoadError: {message}"
        assert case.error in bases, f"rank {rank} raised {type_name}, expected {case.error}: {message}"
        assert seconds < CASE_LIMIT, f"rank {rank} took {seconds:.1f} s to fail"
    messages = {o[2] for o in outcomes}
    assert len(messages) == 1, f"ranks raised different messages: {messages}"
    (message,) = messages
    for needle in case.names:
        assert needle in message, f"message does not name {needle!r}: {message}"
    assert any(t in message for t in case.todo), f"message does not say what to do ({case.todo}): {message}"


def test_checkpoint_never_written(corpus):
    writes = [w for r in corpus["results"] for w in r["writes"]]
    probes = [w for w in writes if w[0] == "open" and "probe" in w[1]]
    assert len(probes) == 2, f"the audit hook did not see the probe writes: {writes}"
    assert [w for w in writes if w not in probes and w[0] != "open-outside"] == [], (
        "the loader wrote to the checkpoint"
    )
    assert corpus["after"] == corpus["before"], "checkpoint files, links or mtimes changed"


def test_escaping_index_entries_never_followed(corpus):
    """Files an index names outside its directory (absolute, '..', an escaping symlink) are refused
    without ever being opened."""
    assert any(p.endswith("-outside") for p in corpus["before"]), "no case points outside its directory"
    opened = [w for r in corpus["results"] for w in r["writes"] if w[0] == "open-outside"]
    assert sum("probe" in w[1] for w in opened) >= 2, f"the audit hook did not see the probe reads: {opened}"
    opened = [w for w in opened if "probe" not in w[1]]
    assert opened == [], f"the loader opened files outside the checkpoint directory: {opened}"


def test_good_load_after_failures(corpus):
    """After every failing case, in the same process group, a good load is bit-exact."""
    want = reference(trained_toy())
    for rank, r in enumerate(corpus["results"]):
        assert isinstance(r["good"], dict), f"rank {rank}: the good load failed: {r['good']}"
        assert_same(r["good"], want)


# --------------------------------------------------------------------------------------------
# A rank that dies mid-load: the survivor fails within the process-group timeout.


def _fail_mid_load(rank: int, world: int, path: str, victim: int, how: str, marker: str) -> str:
    import torch.distributed as dist

    import rank0load
    import rank0load._distribute as d

    kwargs: dict = {}
    if how == "dies_in_build":
        kwargs["model_fn"] = ExitOnRank(victim, marker)
    elif how == "dies_in_manifest":
        kwargs["key_map"] = ExitOnRank(0, marker)  # key_map runs on rank 0 alone, while it reads headers
    elif rank == victim:
        # Fail in the stream phase: rank 0 while sending, rank 1 while receiving.
        name = "isend" if victim == 0 else "irecv"
        original = getattr(dist, name)
        calls = [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                open(marker, "w").close()
                if how == "stalls":  # alive but stuck: only the timeout can end the wait
                    time.sleep(STALL_SECONDS)
                os._exit(17)
            return original(*args, **kwargs)

        setattr(d.dist, name, failing)
    started = time.monotonic()
    try:
        rank0load.load_sharded(kwargs.pop("model_fn", toy), path, **kwargs)
    finally:
        with open(f"{marker}.rank{rank}", "w") as f:
            f.write(str(time.monotonic() - started))
    return "loaded"


class ExitOnRank:
    """A model_fn or key_map during which one rank dies."""

    def __init__(self, rank: int, marker: str) -> None:
        self.rank, self.marker = rank, marker

    def __call__(self, *args):
        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            open(self.marker, "w").close()
            os._exit(17)
        return args[0] if args else toy()


STALL_SECONDS = 9.0  # longer than the survivor's 5-s timeout, short for the suite


def _run_with_death(
    fn, world: int, *args, timeout: float, pg_timeout: float
) -> tuple[list, list[int | None], float]:
    """Like _dist.run, but a rank may die: returns (results or None per rank, exit codes, seconds)."""
    return _dist.spawn(fn, world, *args, timeout=timeout, pg_timeout=pg_timeout, exit_at_once=True)


@pytest.mark.parametrize(
    ("victim", "how"),
    [(0, "dies"), (1, "dies"), (0, "stalls"), (1, "dies_in_build"), (0, "dies_in_manifest")],
)
def test_rank_fails_mid_load(tmp_path, victim, how):
    """The survivor raises a LoadError naming the timeout setting, within the process-group timeout."""
    path = str(tmp_path / "model.safetensors")
    save_state(trained_toy(), path)
    marker = str(tmp_path / "failed")
    pg_timeout = 5.0
    results, codes, _ = _run_with_death(
        _fail_mid_load, 2, path, victim, how, marker, timeout=90, pg_timeout=pg_timeout
    )
    assert os.path.exists(marker) and codes[victim] == 17, f"rank {victim} did not fail as planned: {codes}"
    survivor = results[1 - victim]
    assert isinstance(survivor, _dist.Raised), f"the surviving rank returned {survivor!r}"
    assert "LoadError" in survivor.bases, (
        f"survivor raised {survivor.type_name}: {survivor.message}\n{survivor.tb}"
    )
    assert "died or stalled" in survivor.message and "init_process_group(timeout=" in survivor.message, (
        survivor.message
    )
    seconds = float(_read(f"{marker}.rank{1 - victim}"))
    if how == "stalls":  # nothing but the timeout ends the wait, and it does
        assert pg_timeout * 0.8 < seconds < pg_timeout + 5, f"survivor failed after {seconds:.1f} s"
    else:  # a dead peer is noticed at once (connection reset)
        assert seconds < pg_timeout + 5, f"survivor failed after {seconds:.1f} s"
