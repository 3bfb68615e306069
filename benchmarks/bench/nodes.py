"""``python -m benchmarks.bench.nodes``: ``--hosts`` nodes on one machine, each with a rate-limited
link to a switch, the checkpoint on node 0 only (or, ``--shared``, in a folder every node sees).

Each node is a network namespace (as ``tests/load/test_nodes.py``) joined to a bridge in a switch
namespace by a veth pair; a token-bucket filter (``tc qdisc ... tbf``) on both ends of every veth
limits each node's link to ``--rate`` (default 1 Gbit/s) each way. Ranks ``k*n .. k*n+n-1`` run in
node k's namespace; without ``--shared`` the nodes after node 0 run each rank in its own mount
namespace with an empty tmpfs over the checkpoint's directory: they have no files, so every-rank
readers (DCP) cannot run there. Rank 0 reads its veth's byte counters around the load itself
(between the barriers that bracket the timing, not the verification after it): what crossed node
0's link, each way.

    sudo python -m benchmarks.bench.nodes --ranks-per-node 1 --size-gb 0.8
    sudo python -m benchmarks.bench.nodes --ranks-per-node 2 --methods rank0load,broadcast-rank0
    sudo python -m benchmarks.bench.nodes --hosts 4 --shared --methods rank0load,rank0load-host,dcp-hf
    sudo python -m benchmarks.bench.nodes --hosts 4 --shared --model minimax --methods rank0load,rank0load-host

Needs root, iproute2 and ``unshare``. This is a script: it prints to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .driver import config_for, ensure_checkpoint, run_once, summarise, warm_page_cache

__all__ = ["Nodes", "hosts", "main", "two_nodes"]

MiB = 1 << 20
METHODS = ("rank0load", "rank0load-stream", "rank0load-host", "broadcast-rank0")
SHARED_METHODS = ("dcp-hf",)  # every rank reads: only where every node sees the files
MINIMAX_NODE_METHODS = ("rank0load", "rank0load-host")


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout


@dataclass(frozen=True)
class Nodes:
    """The nodes' namespaces ``(name, veth end)``, in node order, and the rank layout."""

    ends: tuple[tuple[str, str], ...]
    per_node: int
    hidden: str  # the checkpoint's directory, an empty tmpfs for nodes 1..; "": all see it (shared)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def launch(self, rank: int) -> tuple[list[str], dict[str, str]]:
        """The command prefix and environment of ``rank``: its node's namespace, gloo on its veth end;
        the nodes after node 0 also get the empty tmpfs over the checkpoint."""
        ns, dev = self.ends[self.node_of(rank)]
        prefix = ["ip", "netns", "exec", ns]
        if self.node_of(rank) > 0 and self.hidden:
            prefix += ["unshare", "-m", "--propagation", "private", "sh", "-c",
                       f'mount -t tmpfs tmpfs "{self.hidden}" && exec "$@"', "node1"]  # fmt: skip
        return prefix, {"GLOO_SOCKET_IFNAME": dev}


@contextlib.contextmanager
def hosts(count: int, per_node: int, hidden: str, rate: str, burst: str) -> Iterator[Nodes]:
    """``count`` namespaces ``r0lb<pid>h<k>``, each joined by a veth pair to a bridge in the switch
    namespace ``r0lb<pid>sw`` (its own, so the host's firewall never sees the traffic), at
    10.78.<n>.<k+1>; both ends of every veth limited to ``rate``. All removed after."""
    tag = f"r0lb{os.getpid() % 100000}"
    switch = f"{tag}sw"
    subnet = f"10.78.{os.getpid() % 250}"
    names = [f"{tag}h{k}" for k in range(count)]
    shape = [] if rate == "none" else ["tbf", "rate", rate, "burst", burst, "latency", "100ms"]
    try:
        _sh("ip", "netns", "add", switch)
        _sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", switch, "link", "set", "br0", "up")
        for k, ns in enumerate(names):
            dev, port = f"{tag}v{k}", f"{tag}p{k}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns)
            _sh("ip", "-n", switch, "link", "set", port, "master", "br0")
            _sh("ip", "-n", switch, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{subnet}.{k + 1}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if shape:  # the node's egress on its end, its ingress as the switch port's egress
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *shape)
                _sh("ip", "netns", "exec", switch, "tc", "qdisc", "add", "dev", port, "root", *shape)
        yield Nodes(tuple((ns, f"{tag}v{k}") for k, ns in enumerate(names)), per_node, hidden)
    finally:
        for ns in (*names, switch):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def two_nodes(per_node: int, hidden: str, rate: str, burst: str) -> contextlib.AbstractContextManager[Nodes]:
    """:func:`hosts` with two nodes."""
    return hosts(2, per_node, hidden, rate, burst)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench.nodes", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=0.8, help="checkpoint size in GB (default 0.8)")
    p.add_argument("--hosts", type=int, default=2, help="nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=1, help="ranks on each node (default 1)")
    p.add_argument("--model", choices=("llama", "minimax"), default="llama",
                   help="llama (--size-gb) or minimax (MiniMax-M2's FP8 tensor count; default llama)")  # fmt: skip
    p.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}"
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds; methods alternate within each (default 2)")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of the link, or 'none' (default 1gbit)")
    p.add_argument("--burst", default="256kb", help="tc tbf burst (default 256kb)")
    p.add_argument("--out", default="bench-out", help="output dir: checkpoints (cached) and JSON")
    p.add_argument(
        "--shared", action="store_true", help="node 1 sees the checkpoint too (a shared filesystem)"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds before one run's ranks count as hung")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    allowed = (
        MINIMAX_NODE_METHODS if args.model == "minimax" else METHODS + (SHARED_METHODS if args.shared else ())
    )
    unknown = [m for m in args.methods if m not in allowed]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {list(allowed)} (dcp-hf needs --shared)")
    if args.hosts < 1 or args.ranks_per_node < 1:
        p.error("--hosts and --ranks-per-node must be at least 1")
    return args


def table(rows: list[dict], total: int, per_node: int, count: int = 2, shared: bool = False) -> str:
    head = (
        "| method | load (s) | node 0 out (MB) | × checkpoint | node 0 in (MB) | transient per rank (MiB) |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---|"]
    for row in rows:
        s = row["summary"]
        if not s.get("ok"):
            lines.append(f"| {s['method']} | failed: {str(s.get('failure'))[:60]} | | | | |")
            continue
        out, back = row["link"][row["best"]]
        transient = " / ".join(f"{r['transient'] / MiB:.0f}" for r in s["per_rank"])
        lines.append(
            f"| {s['method']} | {s['seconds']:.2f} | {out / 1e6:.1f} | {out / total:.4f} | {back / 1e6:.1f} | "
            f"{transient} |"
        )
    where = "in a folder every node sees" if shared else "on node 0 only"
    lines.append(
        f"\n{count} x {per_node} ranks ({' + '.join([str(per_node)] * count)}), checkpoint {total / 1e9:.2f} GB {where}."
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench.nodes needs root (network and mount namespaces)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    cfg = config_for(args.model, args.size_gb)
    ckpt, meta = ensure_checkpoint(cfg, args.out)
    warm_page_cache(ckpt, meta)
    ranks = args.hosts * args.ranks_per_node
    rows: list[dict] = []
    hidden = "" if args.shared else os.path.abspath(ckpt)
    with hosts(args.hosts, args.ranks_per_node, hidden, args.rate, args.burst) as nodes:
        raw: dict[str, list] = {m: [] for m in args.methods}
        link: dict[str, list] = {m: [] for m in args.methods}
        for rnd in range(args.rounds):
            for method in args.methods if rnd % 2 == 0 else list(reversed(args.methods)):
                results = run_once(method, cfg, ckpt, ranks, args.timeout, True, None, nodes.launch)
                raw[method].append(results)
                # rank 0 read its node's veth counters around the load itself (not the verification)
                link[method].append((results[0].get("link_tx_bytes", 0), results[0].get("link_rx_bytes", 0)))
                ok = all("error" not in r and r.get("verified") is not False for r in results)
                secs = max((r.get("seconds", 0.0) for r in results), default=0.0)
                print(f"[round {rnd + 1}] {method:<16} {'ok' if ok else 'FAILED'} {secs:.2f} s, "
                      f"link {link[method][-1][0] / 1e6:.0f} / {link[method][-1][1] / 1e6:.1f} MB", flush=True)  # fmt: skip
                for r in results:
                    if "error" in r:
                        print(f"  rank {r['rank']}: {r['error'][:2000]}", file=sys.stderr)
        for m in args.methods:
            s = summarise(m, raw[m], meta["total_bytes"])
            good = [i for i, rs in enumerate(raw[m]) if all("error" not in r for r in rs)]
            best = min(good, key=lambda i: max(r["seconds"] for r in raw[m][i])) if good else 0
            rows.append({"summary": s, "link": link[m], "best": best})
    text = table(rows, meta["total_bytes"], args.ranks_per_node, args.hosts, args.shared)
    print(text)
    label = "minimax" if args.model == "minimax" else f"{args.size_gb:g}gb"
    name = f"nodes-{label}-{ranks}ranks" + ("" if args.hosts == 2 else f"-{args.hosts}hosts")
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"argv": list(argv or sys.argv[1:]), "rate": args.rate, "hosts": args.hosts,
                   "total_bytes": meta["total_bytes"], "rows": rows}, f, indent=1)  # fmt: skip
    return 0 if all(r["summary"].get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
