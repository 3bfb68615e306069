"""Two nodes on one machine, launched the way the README's multi-node recipe says.

Two network namespaces joined by a bridge stand for two nodes (tests/netns.py); each runs its own
``torchrun --nnodes 2 --nproc-per-node 2 --node-rank K`` with ``GLOO_SOCKET_IFNAME`` on its link, so
every byte between the nodes crosses it. Node 1 also runs in its own mount
namespace with an empty tmpfs over the checkpoint's directory: the checkpoint exists on node 0 only.
All four ranks must end with the exact tensors of a transformers Llama saved with ``save_pretrained``;
node 0's second rank reads its own bytes through rank 0's descriptors (node-local reads), node 1's
ranks receive theirs over the link.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests import hf, netns
from tests.models import assert_same, reference

# Slow: two torchrun launches of 2 ranks each, with transformers, half a minute at best.
pytestmark = pytest.mark.slow

REPO = netns.REPO

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


@pytest.fixture
def two_nodes():
    """Two simulated hosts on a bridge (tests/netns.py): [(namespace, interface)], node 0's address."""
    yield from netns.hosts(2, subnet=77)


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
    procs, logs = [], [tmp_path / f"node{k}.log" for k in range(len(nodes))]
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
        procs.append(netns.launch(ns, dev, launch, logs[k]))
    netns.wait_for_ranks(procs, logs, out, 4, 180, "the two-node load")

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
