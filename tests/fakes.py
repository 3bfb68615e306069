"""Stand-ins for what the tests cannot have for real (importable in spawned ranks): a terminal, a
Hugging Face Hub cache, a node that does not see the checkpoint."""

from __future__ import annotations

import ctypes
import hashlib
import io
import os
import sys


class FakeTTY(io.StringIO):
    """A captured stream that says it is a terminal (rank 0 draws its progress bar only on one)."""

    def isatty(self) -> bool:
        return True


# Commits of the snapshots in a hand-built Hub cache (tests/checkpoint/test_hub.py, tests/api/test_pretrained.py).
MAIN = "a" * 40
V1 = "b" * 40
SHARDED = "c" * 40


def add_snapshot(repo: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...]) -> None:
    """Add ``files`` to a Hub cache repo (``.../hub/models--org--name``) as snapshot ``commit``, in the
    layout huggingface_hub uses: each file a blob named by its sha256 under ``blobs/``, symlinked from
    ``snapshots/<commit>/``; each of ``refs`` (a branch or tag) a file under ``refs/`` naming ``commit``."""
    for name, data in files.items():
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(repo, "snapshots", commit, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    for ref in refs:
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)


# unshare(2) and mount(2) flags, for hide.
CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18


def hide(path: str) -> list[str]:
    """Make ``path`` empty in this process's own mount namespace; audit any access to it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "making / private failed")
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), f"mounting tmpfs over {path} failed")
    touched: list[str] = []

    def audit(event: str, args: tuple) -> None:
        if (
            event in ("open", "os.listdir", "os.scandir", "os.stat")
            and args
            and isinstance(args[0], (str, bytes))
        ):
            name = os.fsdecode(args[0])
            if name.startswith(path):
                touched.append(f"{event} {name}")

    sys.addaudithook(audit)
    return touched
