"""Two nodes on one machine, launched the way the README's multi-node recipe says.

Two network namespaces joined by a veth pair stand for two nodes; each runs its own
``torchrun --nnodes 2 --nproc-per-node 2 --node-rank K`` with ``GLOO_SOCKET_IFNAME`` on its end of
the veth, so every byte between the nodes crosses that link. Node 1 also runs in its own mount
namespace with an empty tmpfs over the checkpoint's directory: the checkpoint exists on node 0 only.
All four ranks must end with the exact tensors of a transformers Llama saved with ``save_pretrained``;
node 0's second rank reads its own bytes through rank 0's descriptors (node-local reads), node 1's
ranks receive theirs over the link.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests import hf
from tests.models import assert_same, reference

# Slow: two torchrun launches of 2 ranks each, with transformers, half a minute at best.
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = r"""
import json, os, sys
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
import rank0load
from tests import hf
from tests.models import gather

ckpt, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
sees = os.path.exists(ckpt)
model = rank0load.load_sharded(hf.Factory("llama"), ckpt)
tensors = gather(model)  # collective: every rank takes part
with torch.no_grad():
    logits = model(**hf.sample_inputs("llama")).logits
if rank == 0:
    torch.save({{"tensors": tensors, "logits": logits}}, os.path.join(out, "loaded.pt"))
with open(os.path.join(out, f"rank{{rank}}.json"), "w") as f:
    report = model.rank0load_report
    json.dump({{"sees_checkpoint": sees, "world": dist.get_world_size(),
               "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "local_read": report.local_read,
               "local_readers": report.local_readers, "local_status": report.local_status}}, f)
dist.destroy_process_group()
open(os.path.join(out, f"rank{{rank}}.done"), "w").close()  # all its work done, every group destroyed
# as tests/_dist.py's ranks end: without the interpreter's module teardown, where torch 2.13 on the
# CPU aborts or, about one run in five, hangs after all four ranks are done
from tests._dist import exit_without_teardown
exit_without_teardown(0)
"""


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_nodes():
    """Namespaces ``r0l<pid>a`` / ``r0l<pid>b`` joined by a veth pair, 10.77.<n>.1 and .2; removed after."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("network namespaces need root, iproute2 and unshare")
    tag = f"r0l{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    subnet = f"10.77.{os.getpid() % 250}"
    try:
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
        _sh("ip", "link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y")
        _sh("ip", "link", "set", f"{tag}x", "netns", a)
        _sh("ip", "link", "set", f"{tag}y", "netns", b)
        for ns, dev, addr in ((a, f"{tag}x", f"{subnet}.1"), (b, f"{tag}y", f"{subnet}.2")):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        stderr = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"cannot create network namespaces here: {exc} {stderr.decode(errors='replace')}")
    try:
        yield [(a, f"{tag}x"), (b, f"{tag}y")], f"{subnet}.1"
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_nodes_with_the_checkpoint_on_node_0_only(tmp_path, two_nodes):
    nodes, master = two_nodes
    node0 = tmp_path / "node0"
    ckpt = node0 / "llama"
    ref = hf.pretrained("llama")
    ref.save_pretrained(ckpt, max_shard_size="20KB")
    out = tmp_path / "out"
    out.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER.format(repo=REPO))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    procs = []
    for k, (ns, dev) in enumerate(nodes):
        launch = [
            *torchrun,
            "--node-rank",
            str(k),
            "--master-addr",
            master,
            "--master-port",
            "29561",
            str(worker),
            str(ckpt),
            str(out),
        ]
        if k == 1:  # the checkpoint's directory is an empty tmpfs on node 1
            launch = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                      f'mount -t tmpfs tmpfs "{node0}" && exec "$@"', "node1", *launch]  # fmt: skip
        env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
        # each node's output to a file, not a pipe nobody reads while the test waits on the other
        # node, and kept for the messages below even when a node has to be killed
        with open(tmp_path / f"node{k}.log", "wb") as log:
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *launch], env=env, stdout=log,
                                          stderr=subprocess.STDOUT))  # fmt: skip
    for p in procs:
        try:
            p.wait(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            done = sorted(r for r in range(4) if (out / f"rank{r}.done").exists())
            pytest.fail(f"the two-node load did not finish in 180 s (ranks {done} had finished their work)")
    logs = [(tmp_path / f"node{k}.log").read_text(errors="replace") for k in range(len(procs))]
    done = sorted(r for r in range(4) if (out / f"rank{r}.done").exists())
    for k, (p, log) in enumerate(zip(procs, logs)):
        assert done == [0, 1, 2, 3], (
            f"ranks {done} finished their work; node {k} exited {p.returncode}:\n{log[-4000:]}"
        )
        # torch 2.13 on the CPU can abort in interpreter shutdown after every rank's work is done and
        # its process groups destroyed (shared/DESIGN.md): forgiven then, and only that.
        aborted = re.search(r"SIGABRT|exitcode\s*:\s*-6|terminate called", log)
        assert p.returncode == 0 or aborted, f"node {k} exited {p.returncode}:\n{log[-4000:]}"

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["sees_checkpoint"] for r in ranks] == [True, True, False, False]
    assert all(r["world"] == 4 for r in ranks)
    assert [r["ifname"] for r in ranks] == [nodes[0][1]] * 2 + [nodes[1][1]] * 2
    # Node-local reads: rank 1 (node 0) read its own bytes through rank 0's descriptors; node 1's
    # ranks cannot reach rank 0's socket (another network namespace) and took the stream.
    assert [r["local_read"] for r in ranks] == [False, True, False, False]
    assert all(r["local_readers"] == [1] for r in ranks), ranks
    assert [r["local_status"].split(":")[0] for r in ranks] == ["rank 0", "local", "stream", "stream"]
    assert ranks[2]["local_status"] == ranks[3]["local_status"] == "stream: not on rank 0's host"
    loaded = torch.load(out / "loaded.pt")
    assert_same(loaded["tensors"], reference(ref))
    with torch.no_grad():
        want = ref(**hf.sample_inputs("llama")).logits
    torch.testing.assert_close(loaded["logits"], want, rtol=1e-5, atol=1e-5)
