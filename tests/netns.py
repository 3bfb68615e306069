"""Simulated hosts for the multi-host tests (tests/load/test_nodes.py, test_hosts.py): network
namespaces on one machine joined by a bridge, each host's ``torchrun`` launched inside its namespace
with ``GLOO_SOCKET_IFNAME`` on its link, and the wait for every rank. Needs root, iproute2 and
unshare (else the test is skipped)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests._dist import EXIT_ABORT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def hosts(n: int, subnet: int) -> Iterator[tuple[list[tuple[str, str]], str]]:
    """``n`` network namespaces ``r0l<pid>h<k>`` joined by a bridge in ``r0l<pid>s``, addresses
    10.<subnet>.<x>.<k+1>: yields [(namespace, interface)] and host 0's address; removed after."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("network namespaces need root, iproute2 and unshare")
    tag = f"r0l{os.getpid() % 100000}"
    switch = f"{tag}s"
    names = [switch] + [f"{tag}h{k}" for k in range(n)]
    prefix = f"10.{subnet}.{os.getpid() % 250}"
    try:
        _sh("ip", "netns", "add", switch)
        _sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", switch, "link", "set", "br0", "up")
        for k in range(n):
            ns, dev, port = f"{tag}h{k}", f"{tag}v{k}", f"{tag}p{k}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "link", "set", port, "netns", switch)
            _sh("ip", "-n", switch, "link", "set", port, "master", "br0")
            _sh("ip", "-n", switch, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{prefix}.{k + 1}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        stderr = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"cannot create network namespaces here: {exc} {stderr.decode(errors='replace')}")
    try:
        yield [(f"{tag}h{k}", f"{tag}v{k}") for k in range(n)], f"{prefix}.1"
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def launch(ns: str, dev: str, command: Sequence[str], log: Path) -> subprocess.Popen:
    """``command`` in namespace ``ns``, gloo on ``dev``, its output to ``log`` (a file, not a pipe
    nobody reads while the test waits on another host; kept for the messages even when killed)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    with open(log, "wb") as out:
        return subprocess.Popen(["ip", "netns", "exec", ns, *command], env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


def wait_for_ranks(procs: Sequence[subprocess.Popen], logs: Sequence[Path], out: Path, world: int,
                   timeout: float, what: str) -> None:  # fmt: skip
    """Wait for every host's launch; fail the test unless every rank wrote ``out/rank<r>.done`` and
    every host exited 0, or aborted in interpreter shutdown after its work (torch 2.13 on the CPU,
    shared/DESIGN.md: forgiven then, and only that). ``what`` names the load in the messages."""

    def done() -> list[int]:
        return sorted(r for r in range(world) if (out / f"rank{r}.done").exists())

    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{what} did not finish in {timeout:g} s (ranks {done()} had finished their work)")
    finished = done()
    for k, (p, path) in enumerate(zip(procs, logs, strict=True)):
        log = path.read_text(errors="replace")
        assert finished == list(range(world)), (
            f"ranks {finished} finished their work; host {k} exited {p.returncode}:\n{log[-4000:]}"
        )
        aborted = EXIT_ABORT.search(log)
        assert p.returncode == 0 or aborted, f"host {k} exited {p.returncode}:\n{log[-4000:]}"
