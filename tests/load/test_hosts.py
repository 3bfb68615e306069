"""One reader per host (``readers="host"``): simulated hosts on one machine, in one launch each.

Each host is a network namespace (its own abstract sockets, so its own ``_handover.host_id``) joined
to the others by a bridge in one more namespace; each runs ``torchrun --nnodes N --node-rank K`` with
``GLOO_SOCKET_IFNAME`` on its link. The checkpoints sit in folders every host sees (a shared
filesystem) unless a host's own mount namespace puts a tmpfs over one: empty (the host does not see
the files) or holding its own copy (identical, or bad: a file rewritten with other bytes of the same
size, a truncated file, a missing file).

The last host is the odd one: it hides ``some``, holds bad copies of ``rewritten``, ``short`` and
``missing``, and its own identical copy of ``changed``; with 3 hosts the middle one sees everything
and holds its own copy of ``changed``. One job loads, in order (the same transformers Llama each time):

- ``all``, ``readers="host"``: every host reads for itself; nothing crosses rank 0's link;
- ``some``, ``"host"`` then ``"rank0"``: a mixed cluster, the odd host streamed; today's path;
- ``rewritten``, ``short``, ``missing``: the odd host's copy is found to differ before any data moves
  (the same ``host_readers`` on every rank), its ranks take the stream; bit for bit;
- ``changed``, ``vanished``: host 1's first rank finds its own copy rewritten (it touches it) or
  removed during the load: ``CheckpointChangedError`` on every rank, the same message, no hang.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from tests import hf, netns
from tests.models import assert_same, reference

# Slow: one torchrun per host, 2 ranks each, with transformers, seven loads.
pytestmark = pytest.mark.slow

REPO = netns.REPO
CASES = (("all", "host"), ("some", "host"), ("some", "rank0"), ("rewritten", "host"), ("short", "host"))
CASES += (("missing", "host"), ("changed", "host"), ("vanished", "host"))

WORKER = r"""
import json, os, sys
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
import rank0load
from rank0load.load import _localread
from tests import hf
from tests.models import gather

root, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
for folder, readers in {cases!r}:
    case = f"{{folder}}-{{readers}}"
    ckpt = os.path.join(root, folder, "llama")
    if folder in ("changed", "vanished") and rank == 2:  # host 1's reader: its copy changes as it reads
        check = getattr(_localread.LocalReader.round_end, "check", _localread.LocalReader.round_end)
        def touching(self, check=check, folder=folder):
            for path in sorted(self.touched)[:1]:
                if folder == "vanished":
                    if os.path.exists(path):  # round_end runs again at the end
                        os.remove(path)
                    continue
                st = os.stat(path)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
            check(self)
        touching.check = check
        _localread.LocalReader.round_end = touching
    elif rank == 2 and hasattr(_localread.LocalReader.round_end, "check"):
        _localread.LocalReader.round_end = _localread.LocalReader.round_end.check
    try:
        model = rank0load.load_sharded(hf.Factory("llama"), ckpt, readers=readers)
    except Exception as exc:  # a LoadError, asserted; anything else fails the test, not the launch
        got = {{"error": [type(exc).__name__, str(exc)]}}
    else:
        r = model.rank0load_report
        got = {{"host_readers": r.host_readers, "local_readers": r.local_readers,
               "local_status": r.local_status, "network_bytes": r.network_bytes}}
        tensors = gather(model)  # collective: every rank takes part
        if rank == 0:
            torch.save(tensors, os.path.join(out, f"{{case}}.pt"))
    with open(os.path.join(out, f"{{case}}-rank{{rank}}.json"), "w") as f:
        json.dump(got, f)
dist.destroy_process_group()
open(os.path.join(out, f"rank{{rank}}.done"), "w").close()
from tests._dist import exit_without_teardown
exit_without_teardown(0)
"""


@pytest.fixture(params=[2, 3], ids=["2-hosts", "3-hosts"])
def hosts(request):
    yield from netns.hosts(request.param, subnet=78)


def _checkpoints(tmp_path, ref) -> tuple[str, str]:
    """The shared folders (``root``) and the copies the hosts mount over them (``copies``)."""
    root, copies = tmp_path / "shared", tmp_path / "copies"
    ref.save_pretrained(root / "all" / "llama", max_shard_size="20KB")
    for folder in ("some", "rewritten", "short", "missing", "changed", "vanished"):
        shutil.copytree(root / "all", root / folder)
        shutil.copytree(root / "all", copies / folder)
    files = sorted((copies / "rewritten" / "llama").glob("*.safetensors"))
    with open(files[1], "r+b") as f:  # other values: the same header, every data byte different
        header = 8 + int.from_bytes(f.read(8), "little")
        f.seek(header)
        data = f.read()
        f.seek(header)
        f.write(bytes((b + 1) % 256 for b in data))
    short = sorted((copies / "short" / "llama").glob("*.safetensors"))[2]
    os.truncate(short, short.stat().st_size // 2)
    os.remove(sorted((copies / "missing" / "llama").glob("*.safetensors"))[-1])
    return str(root), str(copies)


def _mounts(root: str, copies: str, folders: dict[str, bool]) -> str:
    """Shell commands mounting a tmpfs over each of ``folders`` under ``root``, filled from
    ``copies`` where the value is True."""
    steps = []
    for folder, filled in folders.items():
        steps.append(f'mount -t tmpfs tmpfs "{root}/{folder}"')
        if filled:
            steps.append(f'cp -a "{copies}/{folder}/." "{root}/{folder}/"')
    return " && ".join(steps)


def test_hosts_read_their_own_identical_copies(tmp_path, hosts):
    nodes, master = hosts
    n = len(nodes)
    ref = hf.pretrained("llama")
    root, copies = _checkpoints(tmp_path, ref)
    out = tmp_path / "out"
    out.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER.format(repo=REPO, cases=CASES))
    mounts = {k: {} for k in range(n)}
    mounts[n - 1] = {"some": False, "rewritten": True, "short": True, "missing": True}
    mounts[n - 1].update(changed=True, vanished=True)
    mounts[1].update(changed=True, vanished=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n), "--nproc-per-node", "2"]
    procs, logs = [], [tmp_path / f"host{k}.log" for k in range(n)]
    for k, (ns, dev) in enumerate(nodes):
        launch = [*torchrun, "--node-rank", str(k), "--master-addr", master, "--master-port", "29571"]
        launch += [str(worker), root, str(out)]
        if mounts[k]:
            launch = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                      f'{_mounts(root, copies, mounts[k])} && exec "$@"', f"host{k}", *launch]  # fmt: skip
        procs.append(netns.launch(ns, dev, launch, logs[k]))
    world = 2 * n
    netns.wait_for_ranks(procs, logs, out, world, 400, f"the {n}-host load")

    def results(case: str) -> list[dict]:
        return [json.loads((out / f"{case}-rank{r}.json").read_text()) for r in range(world)]

    want = reference(ref)
    odd = 2 * (n - 1)  # the odd host's first rank
    good_hosts = list(range(2, odd, 2))  # hosts between rank 0's and the odd one: see every file
    for folder, readers in CASES[:-2]:
        case = f"{folder}-{readers}"
        got = results(case)
        assert all("error" not in g for g in got), (case, got)
        assert_same(torch.load(out / f"{case}.pt"), want)
        hosts_reading = {"all": [*good_hosts, odd]}.get(folder, good_hosts) if readers == "host" else []
        assert all(g["host_readers"] == hosts_reading for g in got), (case, got)
        local = [1] + [r for h in hosts_reading for r in (h, h + 1)]
        assert all(g["local_readers"] == local for g in got), (case, got)
        statuses = [g["local_status"] for g in got]
        assert statuses[0] == "rank 0" and statuses[1].startswith(
            "local: read its own bytes through rank 0's"
        )
        for h in hosts_reading:
            assert statuses[h].startswith("local: read its own bytes from its host's copy"), (case, statuses)
            assert (
                statuses[h + 1]
                == f"local: read its own bytes through rank {h}'s descriptors (its host's copy)"
            )
        if folder == "all":
            assert got[0]["network_bytes"] == 0, got[0]  # every rank read its own: nothing sent
            continue
        assert got[0]["network_bytes"] > 0
        if readers == "host":  # the odd host streamed: it says why, on both its ranks
            why = {
                "some": "CheckpointNotFoundError",
                "rewritten": "its header or sampled bytes differ",
                "short": "bytes here,",
                "missing": "CheckpointNotFoundError",
            }[folder]
            assert (
                statuses[odd].startswith("stream: this host's copy is not rank 0's") and why in statuses[odd]
            )
            assert statuses[odd + 1].startswith(f"stream: its host's first rank {odd} found no copy")
    # less crosses rank 0's link when the other hosts read their own: with 3 hosts, host 1's share
    assert (
        results("some-host")[0]["network_bytes"] < results("some-rank0")[0]["network_bytes"]
        if n > 2
        else results("some-host")[0]["network_bytes"] == results("some-rank0")[0]["network_bytes"]
    )
    changed = results("changed-host")
    assert all(g.get("error", [None])[0] == "CheckpointChangedError" for g in changed), changed
    assert len({g["error"][1] for g in changed}) == 1, changed
    assert "changed" in changed[0]["error"][1] and "rewritten: mtime changed" in changed[0]["error"][1]
    vanished = results("vanished-host")  # its path removed: its open descriptor still reads, the check fails
    assert all(g.get("error", [None])[0] == "CheckpointChangedError" for g in vanished), vanished
    assert len({g["error"][1] for g in vanished}) == 1 and "removed:" in vanished[0]["error"][1], vanished
