"""Node-local reads: the ranks on rank 0's host read their own bytes through rank 0's descriptors.

The checkpoint is hidden from ranks other than 0 (their own mount namespace, an empty tmpfs over it,
as in test_core), so every byte they get comes through the descriptors rank 0 handed over, or from
rank 0 itself. Each load is compared bit for bit with the single-process reference, and each rank
says how its bytes came: ``LoadReport.local_status`` and the point-to-point calls it made (rank 0's
``isend``, the others' ``irecv``: none for a local reader).

- 2 and 3 ranks: rows (an index of 2 files), a cast (bf16 file into an fp32 model: through staging),
  tensor-parallel blocks cut by the reader itself (``Shard(1)``, ``Shard(2)``, ``_StridedShard``,
  chunks of a few rows, a tensor broadcast whole), a transformers Llama (many small files),
  per-expert FP8 DeepSeek-V3 experts dequantised into fp32 (assembled from several tensors, scale
  grids first); every rank a local reader, so each reads the broadcast tensors too; and
  ``local_reads=False``: today's stream.
- the hand-over failing in every way we could think of falls back to the stream, bit-exact: rank 0
  cannot listen, ``send_fds`` fails, a rank that reports another pid (refused), a rank whose check of
  the descriptors fails (the others still read locally: a mixed load, rows and blocks, broadcasts on
  the wire), rank 0 that never answers (the rank waits out its timeout, then streams);
- a process that is not a rank, with the right token, gets nothing (during a load, and directly);
- a local read error and a file changed under a local reader: the same LoadError on every rank; a
  local reader, or rank 0, that dies while the others read: the others fail at once, not at the timeout;
- ranks disagreeing on ``local_reads``: the same RankMismatchError on every rank.
The two-node test (tests/load/test_nodes.py) shows node 0's second rank reading locally and node 1's streaming.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests import _dist, hf
from tests.fakes import hide
from tests.models import (
    assert_same,
    gather,
    reference,
    save_sharded,
    save_state,
    shard_tp,
    toy,
    toy_state,
    tp_net,
    trained_net,
    trained_toy,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="hiding the checkpoint needs a mount namespace (root)"
)

LOCAL = "local: read its own bytes through rank 0's descriptors"


class _Counted:
    """Counts this process's point-to-point sends and receives (torch.distributed.isend / irecv)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.calls = {"isend": 0, "irecv": 0}
        for name in self.calls:
            original = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.calls[_name] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def take(self) -> dict[str, int]:
        out, self.calls = dict(self.calls), dict.fromkeys(self.calls, 0)
        return out


def _report(model) -> dict:
    r = model.rank0load_report
    return {"read": r.local_read, "readers": r.local_readers, "status": r.local_status}


def _jobs(root: str) -> dict:
    """name -> (ckpt, load_sharded kwargs); the checkpoints written by the test process."""
    return {
        "toy-index": (os.path.join(root, "sharded", "model.safetensors.index.json"), {"model_fn": toy}),
        "toy-cast": (os.path.join(root, "bf16.safetensors"), {"model_fn": toy}),
        "toy-stream": (os.path.join(root, "sharded"), {"model_fn": toy, "local_reads": False}),
        "tp-blocks": (
            os.path.join(root, "tp.safetensors"),
            {"model_fn": tp_net, "shard_fn": shard_tp, "max_staging_bytes": 4096},
        ),
        "llama": (os.path.join(root, "llama"), {"model_fn": hf.Factory("llama")}),
        "fp8-experts": (os.path.join(root, "fp8"), {"model_fn": "deepseek_v3", "dtype": torch.float32}),
    }


def _load_jobs(rank: int, world: int, root: str) -> dict:
    import rank0load

    touched: list[str] = []
    if rank != 0:
        touched = hide(root)
    counted = _Counted()
    out: dict = {}
    for name, (ckpt, kwargs) in _jobs(root).items():
        kwargs = dict(kwargs)
        model_fn = kwargs.pop("model_fn")
        if isinstance(model_fn, str):  # an MoE family: transformers' AutoModel from tests/moe_models
            from transformers import AutoModelForCausalLM

            from tests import moe_models as mm

            mm._quiet()
            cfg = mm.config(model_fn)
            model_fn = lambda cfg=cfg: AutoModelForCausalLM.from_config(cfg)
        model = rank0load.load_sharded(model_fn, ckpt, **kwargs)
        out[name] = {**_report(model), **counted.take(), "tensors": gather(model)}
    return {"jobs": out, "touched": touched}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The checkpoints (under one root, hidden from ranks other than 0) and what each load must give."""
    from tests import moe_models as mm

    root = tmp_path_factory.mktemp("local")
    (root / "sharded").mkdir()
    save_sharded(toy_state(), str(root / "sharded"))
    save_state(trained_toy(), str(root / "bf16.safetensors"), dtype=torch.bfloat16)
    net = trained_net()
    save_state(net, str(root / "tp.safetensors"))
    llama = hf.pretrained("llama")
    llama.save_pretrained(root / "llama", max_shard_size="20KB")
    refs = tmp_path_factory.mktemp("local-ref")
    mm.save_fp8("deepseek_v3", root / "fp8", (16, 16))
    mm.save_dequantized(root / "fp8", refs / "fp8")
    toy_ref = reference(trained_toy())
    from transformers import AutoModelForCausalLM

    fp8_ref = AutoModelForCausalLM.from_pretrained(refs / "fp8", dtype=torch.float32)
    cast = {  # the bf16 file's values in the fp32 model; the non-persistent buffer is the model's own
        k: v.to(torch.bfloat16).float() if v.is_floating_point() and k != "scale" else v
        for k, v in toy_ref.items()
    }
    want = {
        "toy-index": toy_ref,
        "toy-cast": cast,
        "toy-stream": toy_ref,
        "tp-blocks": reference(net),
        "llama": reference(llama),
        "fp8-experts": reference(fp8_ref),
    }
    return {"root": str(root), "want": want}


@pytest.mark.slow  # two spawns of 6 loads each, transformers imported: about a minute
@pytest.mark.parametrize("world", [2, 3])
def test_local_reads_bit_exact_with_the_checkpoint_hidden(corpus, world):
    results = _dist.ok(_dist.run(_load_jobs, world, corpus["root"], timeout=600, pg_timeout=120))
    others = tuple(range(1, world))
    for rank, res in enumerate(results):
        assert res["touched"] == [], f"rank {rank} touched the checkpoint: {res['touched'][:5]}"
        for name, job in res["jobs"].items():
            assert_same(job["tensors"], corpus["want"][name])
            if name == "toy-stream":  # local_reads=False: today's stream, point to point
                assert (job["read"], job["readers"]) == (False, ()), (rank, job)
                assert job["status"] == ("rank 0" if rank == 0 else "stream: local_reads=False")
                assert job["isend" if rank == 0 else "irecv"] > 0, (rank, name, job)
                continue
            assert job["readers"] == others, (rank, name, job)
            assert job["read"] == (rank != 0) and job["status"] == ("rank 0" if rank == 0 else LOCAL)
            # nothing went point to point: every rank read its own bytes (broadcasts aside)
            assert job["isend"] == 0 and job["irecv"] == 0, (rank, name, job)


# --- the hand-over failing, a foreign peer, failures while reading --------------------------------------

FOREIGN = r"""
import socket, struct, sys
name, token, rank = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
    s.settimeout(10)
    s.connect("\0" + name)
    s.sendall(struct.pack("!q16s", rank, token))
    data, fds, _, _ = socket.recv_fds(s, 64, 16)
print(len(data), len(fds))
"""


def _foreign(name: str, token: bytes, claimed_rank: int) -> str:
    """A process that is not a rank, with the load's socket name and token, claiming a rank: how
    many bytes and descriptors it got."""
    return _peer(name, token, claimed_rank).communicate(timeout=60)[0].strip()


class _Patch:
    """Attributes replaced on this rank for one load, then put back."""

    def __init__(self, *changes: tuple[object, str, object]) -> None:
        self.changes = changes
        self.saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> None:
        for obj, attr, value in self.changes:
            self.saved.append((obj, attr, getattr(obj, attr)))
            setattr(obj, attr, value)

    def __exit__(self, *exc: object) -> None:
        for obj, attr, value in reversed(self.saved):
            setattr(obj, attr, value)


def _patches(rank: int, case: str, seen: dict) -> _Patch:
    """What ``case`` changes on ``rank`` (``seen``: what the case observed, returned to the test)."""
    import rank0load.checkpoint._files as fileio
    import rank0load.common._distribute as distribute
    import rank0load.load._handover as local
    import rank0load.load._readahead as reads

    server_serve = local.Server.serve
    if case == "no-listen" and rank == 0:
        return _Patch((local.Server, "listen", classmethod(lambda cls, files, *args, **kwargs: None)))
    if case == "send-fds-fails" and rank == 0:

        def send_fds(*args, **kwargs):
            raise OSError(90, "injected: message too long")

        return _Patch((socket, "send_fds", send_fds))
    if case == "wrong-pid" and rank == 1:
        gather = distribute.all_gather_ints
        return _Patch((distribute, "all_gather_ints", lambda v, what: gather((v[0], v[1] + 1, v[2]), what)))
    if case.startswith("bad-descriptor") and rank == 2:
        of = fileio.FileIdentity.of
        return _Patch((fileio.FileIdentity, "of", classmethod(lambda cls, st: of(st).__class__(0, 0, 0, 0))))
    if case == "silent-rank-0":
        if rank == 0:
            return _Patch((local.Server, "serve", lambda self, allowed: None))
        return _Patch((local, "TIMEOUT", 1.0))
    if case == "foreign-peer" and rank == 0:

        def serve(self, allowed):
            server_serve(self, allowed)
            seen["foreign"] = _foreign(self.offer.name, self.offer.token, 1)
            seen["server"] = self

        return _Patch((local.Server, "serve", serve))
    if case == "changed" and rank == 0:  # only the local reader may see it: its own check
        return _Patch((fileio.OpenFile, "check", lambda self: None))
    if case in ("read-error", "changed") and rank == (1 if case == "read-error" else 2):
        read, calls = reads.read_vectored, [0]

        def failing(fd, buf, offset, path):
            calls[0] += 1
            if calls[0] == 2 and case == "read-error":
                raise OSError(5, os.strerror(5))
            if calls[0] == 2:  # another writer touches the file, through the descriptor
                st = os.fstat(fd)
                os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
            return read(fd, buf, offset, path)

        return _Patch((reads, "read_vectored", failing))
    return _Patch()


FALLBACKS = {  # case -> (the ranks that still read locally, the statuses of ranks 1 and 2, as prefixes)
    "no-listen": ((), ("stream: rank 0 could not listen",) * 2),
    "send-fds-fails": ((), ("stream: the hand-over failed (HandoverError: rank 0 sent nothing",) * 2),
    "wrong-pid": ((2,), ("stream: the hand-over failed (HandoverError: rank 0 sent nothing", LOCAL)),
    "bad-descriptor": ((1,), (LOCAL, "stream: the hand-over failed (HandoverError: a descriptor is not")),
    # the same with tensor-parallel blocks: rank 0 cuts rank 2's blocks, rank 1 cuts its own
    "bad-descriptor-blocks": (
        (1,),
        (LOCAL, "stream: the hand-over failed (HandoverError: a descriptor is not"),
    ),
    "silent-rank-0": ((), ("stream: the hand-over failed (TimeoutError",) * 2),
    "foreign-peer": ((1, 2), (LOCAL, LOCAL)),
}
FAILURES = ("read-error", "changed", "disagree", "not-bool", "bad-readers", "host-without-lending")


def _failures(rank: int, world: int, root: str) -> dict:
    import rank0load

    if rank != 0:
        hide(root)
    good = os.path.join(root, "sharded")
    out: dict = {}
    for case in [*FALLBACKS, *FAILURES]:
        seen: dict = {}
        ckpt = os.path.join(root, "changed.safetensors") if case == "changed" else good
        kwargs: dict = {"max_staging_bytes": 4096}  # a round per few pieces: failures settle early
        model_fn = toy
        if case == "bad-descriptor-blocks":
            ckpt, model_fn, kwargs["shard_fn"] = os.path.join(root, "tp.safetensors"), tp_net, shard_tp
        if case == "disagree" and rank == 1:
            kwargs["local_reads"] = False
        if case == "not-bool":
            kwargs["local_reads"] = "yes"
        if case == "bad-readers":
            kwargs["readers"] = "all"
        if case == "host-without-lending":
            kwargs.update(readers="host", local_reads=False)
        started = time.monotonic()
        try:
            with _patches(rank, case, seen):
                model = rank0load.load_sharded(model_fn, ckpt, **kwargs)
            out[case] = {**_report(model), "tensors": gather(model)}
        except Exception as exc:
            out[case] = {"error": (type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc))}
        out[case]["seconds"] = time.monotonic() - started
        if "server" in seen:
            out[case]["refused"] = list(seen.pop("server").refused)
        out[case].update(seen)
    model = rank0load.load_sharded(toy, good)  # the group is still usable, local reads too
    out["good"] = {**_report(model), "tensors": gather(model)}
    return out


@pytest.mark.slow  # one 3-rank spawn, 11 loads
def test_hand_over_failures_fall_back_and_read_failures_settle(tmp_path, toy_reference):
    root = tmp_path / "ckpt"
    (root / "sharded").mkdir(parents=True)
    save_sharded(toy_state(), str(root / "sharded"))
    save_state(trained_toy(), str(root / "changed.safetensors"))
    save_state(trained_net(), str(root / "tp.safetensors"))
    results = _dist.ok(_dist.run(_failures, 3, str(root), timeout=400, pg_timeout=60))
    for case, (readers, statuses) in FALLBACKS.items():
        for rank, res in enumerate(results):
            job = res[case]
            assert "error" not in job, (case, rank, job)
            assert_same(job["tensors"], reference(trained_net()) if "blocks" in case else toy_reference)
            assert job["readers"] == readers, (case, rank, job["readers"])
            status = "rank 0" if rank == 0 else statuses[rank - 1]
            assert job["status"].startswith(status), (case, rank, job["status"])
            assert job["read"] == (rank in readers)
            limit = 15 if case == "silent-rank-0" else 10  # the silent case waits out a 1-s timeout
            assert job["seconds"] < limit, (case, rank, job["seconds"])
    foreign = results[0]["foreign-peer"]
    assert foreign["foreign"] == "0 0", foreign  # no byte, no descriptor
    assert len(foreign["refused"]) == 1 and "claimed rank 1" in foreign["refused"][0], foreign["refused"]
    errors = {case: {tuple(res[case]["error"][::2]) for res in results} for case in FAILURES}
    for case, found in errors.items():
        assert len(found) == 1, (case, found)  # the same error on every rank
    ((name, message),) = errors["read-error"]
    assert name == "LoadError" and "rank 1 could not read" in message and "Input/output error" in message
    ((name, message),) = errors["changed"]
    assert name == "CheckpointChangedError" and "changed (rewritten: mtime" in message, message
    assert "while rank 1 read it" in message or "while rank 2 read it" in message, message
    ((name, message),) = errors["disagree"]
    assert name == "RankMismatchError" and "local_reads=False here but True on rank 0" in message, message
    ((name, message),) = errors["not-bool"]
    assert "local_reads='yes' is not a bool" in message, message
    ((name, message),) = errors["bad-readers"]
    assert name == "LoadError" and "readers='all' is not 'rank0'" in message, message
    ((name, message),) = errors["host-without-lending"]
    assert name == "LoadError" and "pass readers='rank0' with local_reads=False" in message, message
    for res in results:
        assert_same(res["good"]["tensors"], toy_reference)
        assert res["good"]["readers"] == (1, 2)


# --- the access check itself, without a load ---------------------------------------------------------------


def _peer(name: str, token: bytes, claimed_rank: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", FOREIGN, name, token.hex(), str(claimed_rank)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_only_the_ranks_pids_get_the_descriptors(tmp_path):
    """Rank 0's server hands its descriptors to the pid and uid a rank reported, with the token;
    a process that is not that rank gets nothing, token or not, and no rank gets them twice."""
    from rank0load.checkpoint import _files
    from rank0load.load import _handover

    path = tmp_path / "f.safetensors"
    save_state(trained_toy(), str(path))
    opened = _files.OpenFile.open(path)
    server = _handover.Server.listen([opened])
    assert server is not None
    name, token = server.offer.name, server.offer.token
    outs = []
    try:
        rank1 = _peer(name, token, 1)  # waits in the backlog until the server serves
        server.serve({1: (rank1.pid, os.getuid()), 2: (os.getpid(), os.getuid())})
        outs.append(rank1.communicate(timeout=60)[0].strip())
        for claimed, with_token in ((1, token), (2, token), (2, b"x" * 16)):  # one after the other
            outs.append(_peer(name, with_token, claimed).communicate(timeout=60)[0].strip())
        fds = _handover.fetch(server.offer, 2, 10.0)  # this process is "rank 2": it gets them, checked
        try:
            assert os.pread(fds[0], 64, 0) == os.pread(opened.fd, 64, 0)
        finally:
            os.close(fds[0])
        with pytest.raises(_handover.HandoverError, match="sent nothing"):
            _handover.fetch(server.offer, 2, 10.0)
    finally:
        server.close()
        opened.close()
    assert outs == ["8 1", "0 0", "0 0", "0 0"], outs  # (bytes, descriptors) each peer got
    refused = server.refused
    assert len(refused) == 4, refused
    assert "claimed rank 1, which reported" in refused[0] and "claimed rank 2, which reported" in refused[1]
    assert "claimed rank 2 without this load's token" in refused[2], refused
    assert "asked twice for rank 2" in refused[3], refused


# --- a rank that dies while the local readers read ---------------------------------------------------------


def _dies_reading(rank: int, world: int, root: str, victim: int, marker: str) -> float:
    import rank0load
    import rank0load.load._readahead as reads

    if rank != 0:
        hide(root)
    if rank == victim:  # every rank reads locally here, rank 0 too, through _localread
        module = reads
        read, calls = module.read_vectored, [0]

        def dying(*args):
            calls[0] += 1
            if calls[0] == 3:
                open(marker, "w").close()
                os._exit(17)
            return read(*args)

        module.read_vectored = dying
    started = time.monotonic()
    try:
        rank0load.load_sharded(toy, os.path.join(root, "sharded"), max_staging_bytes=4096)
    finally:
        with open(f"{marker}.rank{rank}", "w") as f:
            f.write(str(time.monotonic() - started))
    return 0.0


@pytest.mark.slow  # two 3-rank spawns
@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_dying_while_local_readers_read_fails_the_others(tmp_path, victim):
    root = tmp_path / "ckpt"
    (root / "sharded").mkdir(parents=True)
    save_sharded(toy_state(), str(root / "sharded"))
    marker = str(tmp_path / "died")
    pg_timeout = 5.0
    results, codes, _ = _dist.spawn(
        _dies_reading, 3, str(root), victim, marker, timeout=90, pg_timeout=pg_timeout, exit_at_once=True
    )
    assert os.path.exists(marker) and codes[victim] == 17, codes
    for rank, res in enumerate(results):
        if rank == victim:
            continue
        assert isinstance(res, _dist.Raised) and "LoadError" in res.bases, (rank, res)
        assert "died or stalled" in res.message, res.message
        with open(f"{marker}.rank{rank}") as f:
            assert float(f.read()) < pg_timeout + 5, f"rank {rank} failed late"
