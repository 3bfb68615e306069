"""``python -m benchmarks.bench.nodes``: two nodes on one machine, a rate-limited link between them,
the checkpoint on node 0 only.

Two network namespaces joined by a veth pair stand for two nodes (as ``tests/load/test_nodes.py``); a
token-bucket filter (``tc qdisc ... tbf``) on both ends of the veth limits the link to ``--rate``
(default 1 Gbit/s). Ranks ``0 .. n-1`` run in node 0's namespace, ranks ``n .. 2n-1`` in node 1's,
each in its own mount namespace with an empty tmpfs over the checkpoint's directory: node 1 has no
files, so every-rank readers (DCP) cannot run there. Rank 0 reads its veth's byte counters around
the load itself (between the barriers that bracket the timing, not the verification after it): what
crossed the link, each way.

    sudo python -m benchmarks.bench.nodes --ranks-per-node 1 --size-gb 0.8
    sudo python -m benchmarks.bench.nodes --ranks-per-node 2 --methods rank0load,broadcast-rank0

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

__all__ = ["Nodes", "main", "two_nodes"]

MiB = 1 << 20
METHODS = ("rank0load", "rank0load-stream", "rank0load-host", "broadcast-rank0")


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout


@dataclass(frozen=True)
class Nodes:
    """Two namespaces ``(name, veth end)`` and the rank layout."""

    ends: tuple[tuple[str, str], tuple[str, str]]
    per_node: int
    hidden: str  # the checkpoint's directory, an empty tmpfs for node 1; "": node 1 sees it (shared)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def launch(self, rank: int) -> tuple[list[str], dict[str, str]]:
        """The command prefix and environment of ``rank``: its node's namespace, gloo on its veth end;
        node 1 also gets the empty tmpfs over the checkpoint."""
        ns, dev = self.ends[self.node_of(rank)]
        prefix = ["ip", "netns", "exec", ns]
        if self.node_of(rank) == 1 and self.hidden:
            prefix += ["unshare", "-m", "--propagation", "private", "sh", "-c",
                       f'mount -t tmpfs tmpfs "{self.hidden}" && exec "$@"', "node1"]  # fmt: skip
        return prefix, {"GLOO_SOCKET_IFNAME": dev}


@contextlib.contextmanager
def two_nodes(per_node: int, hidden: str, rate: str, burst: str) -> Iterator[Nodes]:
    """Namespaces ``r0lb<pid>a/b`` joined by a veth pair, 10.78.<n>.1 and .2, both ends limited to
    ``rate``; removed after."""
    tag = f"r0lb{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    subnet = f"10.78.{os.getpid() % 250}"
    try:
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
        _sh("ip", "link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y")
        for ns, dev, addr in ((a, f"{tag}x", f"{subnet}.1"), (b, f"{tag}y", f"{subnet}.2")):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if rate != "none":
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", rate, "burst", burst, "latency", "100ms")  # fmt: skip
        yield Nodes(((a, f"{tag}x"), (b, f"{tag}y")), per_node, hidden)
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench.nodes", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=0.8, help="checkpoint size in GB (default 0.8)")
    p.add_argument("--ranks-per-node", type=int, default=1, help="ranks on each of the 2 nodes (default 1)")
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
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {list(METHODS)} (node 1 has no files)")
    return args


def table(rows: list[dict], total: int, per_node: int) -> str:
    ranks = 2 * per_node
    head = (
        "| method | load (s) | node 0 → 1 (MB) | × checkpoint | node 1 → 0 (MB) | transient per rank (MiB) |"
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
            f"| {s['method']} | {s['seconds']:.2f} | {out / 1e6:.0f} | {out / total:.2f} | {back / 1e6:.1f} | "
            f"{transient} |"
        )
    lines.append(
        f"\n{ranks} ranks ({per_node} + {per_node}), checkpoint {total / 1e9:.2f} GB on node 0 only."
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench.nodes needs root (network and mount namespaces)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    cfg = config_for("llama", args.size_gb)
    ckpt, meta = ensure_checkpoint(cfg, args.out)
    warm_page_cache(ckpt, meta)
    ranks = 2 * args.ranks_per_node
    rows: list[dict] = []
    hidden = "" if args.shared else os.path.abspath(ckpt)
    with two_nodes(args.ranks_per_node, hidden, args.rate, args.burst) as nodes:
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
    text = table(rows, meta["total_bytes"], args.ranks_per_node)
    print(text)
    with open(os.path.join(args.out, f"nodes-{args.size_gb:g}gb-{ranks}ranks.json"), "w") as f:
        json.dump({"argv": list(argv or sys.argv[1:]), "rate": args.rate, "rows": rows}, f, indent=1)
    return 0 if all(r["summary"].get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
