"""Node-local reads: rank 0 lends its open checkpoint files to the ranks on its own host.

Its read-only descriptors, passed over a Unix socket (``SCM_RIGHTS``), read even where a rank's
mount namespace hides the checkpoint: rank 0 stays the only rank that opens and validates it.

(rank 0) :meth:`Server.listen` once the manifest exists (an abstract Unix socket, reachable only
from rank 0's network namespace); its :class:`Offer` rides on the manifest's broadcast.
(all ranks) :func:`hand_over`: rank 0 hands its descriptors only to a peer whose kernel-reported
pid and uid (``SO_PEERCRED``) are those a rank on its host reported and that sends the offer's
token; that rank checks that the peer is rank 0 and every descriptor against the offer.
(all ranks) :meth:`LocalReads.decide`: a rank reads locally only if it holds every descriptor,
verified; any failure makes it take the stream, and rank 0 knows to send it its pieces: never a hang.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import select
import socket
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..checkpoint._files import FileIdentity, OpenFile
from ..common import _distribute
from ._localread import LentFile

logger = logging.getLogger(__name__)

TIMEOUT = 20.0  # seconds a rank waits for rank 0's descriptors (it then takes the stream)
_PEER_TIMEOUT = 5.0  # seconds rank 0 gives a peer to say who it is
_FDS_PER_MESSAGE = 200  # SCM_RIGHTS carries at most 253 descriptors per message (SCM_MAX_FD)
_HELLO = struct.Struct("!q16s")  # rank, token
_BATCH = struct.Struct("!II")  # index of the first descriptor in this message, total
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def host_id() -> str | None:
    """This process's host as far as abstract Unix sockets go: boot id, host name and network
    namespace (two "nodes" in network namespaces of one machine differ); None off Linux."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net")
    except OSError:
        return None
    return f"{boot}/{socket.gethostname()}/{netns.st_dev}:{netns.st_ino}"


@dataclass(frozen=True)
class Offer:
    """What rank 0 sends with the manifest, for the ranks on its host to fetch and check its descriptors."""

    name: str  # abstract socket name, without the leading NUL
    token: bytes  # the peer sends it back: proof that it took part in this load's broadcast
    pid: int  # rank 0's: a rank checks that the socket's peer is rank 0 (SO_PEERCRED)
    uid: int
    host: str  # host_id() of rank 0
    identities: tuple[FileIdentity, ...]  # every checkpoint file, in Manifest.files order


def _peer(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


class Server:
    """(rank 0) The listening socket and the thread that hands the descriptors out."""

    def __init__(self, sock: socket.socket, offer: Offer, fds: list[int]) -> None:
        self.offer = offer
        self._sock, self._fds = sock, fds
        self.allowed: dict[int, tuple[int, int]] = {}  # rank -> (pid, uid), ranks on this host
        self._threads: list[threading.Thread] = []
        self.served: set[int] = set()
        self.refused: list[str] = []  # why each refused peer was refused, for the log and tests
        self._lock = threading.Lock()

    @classmethod
    def listen(cls, files: Sequence[OpenFile]) -> Server | None:
        """(rank 0) Listen for the ranks on this host; None where that cannot be done (not Linux,
        no abstract sockets): every rank then takes the stream."""
        host = host_id()
        if host is None or not hasattr(socket, "send_fds") or not hasattr(socket, "SO_PEERCRED"):
            return None
        name = f"rank0load-{os.getpid()}-{secrets.token_hex(8)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.bind("\0" + name)
            sock.listen(64)
        except OSError as exc:
            sock.close()
            logger.debug("node-local reads off: cannot listen on an abstract socket: %s", exc)
            return None
        identities = tuple(f.identity for f in files)
        offer = Offer(name, secrets.token_bytes(16), os.getpid(), os.getuid(), host, identities)
        return cls(sock, offer, [f.fd for f in files])

    def serve(self, allowed: dict[int, tuple[int, int]]) -> None:
        """Start handing the descriptors to the ranks in ``allowed`` (rank -> pid, uid)."""
        self.allowed = allowed
        self._start(self._accept)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=target, args=args, name="rank0load-local", daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while True:
            try:
                ready, _, _ = select.select([self._sock], [], [], 1.0)
                if ready:
                    conn, _ = self._sock.accept()
                    self._start(self._handle, conn)  # one thread each: a silent peer holds up no one
            except (OSError, ValueError):  # closed under us: the hand-over is over
                return

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(_PEER_TIMEOUT)
                pid, uid = _peer(conn)
                hello = conn.recv(_HELLO.size)
                why = self._refusal(pid, uid, hello)
                if why is not None:
                    with self._lock:
                        self.refused.append(why)
                    logger.warning("rank0load: refused a connection to the checkpoint's descriptors: %s", why)
                    return
                for first in range(0, len(self._fds), _FDS_PER_MESSAGE):
                    batch = self._fds[first : first + _FDS_PER_MESSAGE]
                    socket.send_fds(conn, [_BATCH.pack(first, len(self._fds))], batch)
            except OSError as exc:  # the rank gave up (it then takes the stream)
                logger.debug("handing the descriptors over failed: %s", exc)

    def _refusal(self, pid: int, uid: int, hello: bytes) -> str | None:
        """Why the peer (kernel-reported ``pid``, ``uid``) must get nothing, or None: then its rank
        counts as served (once only, even if the sending then fails)."""
        if len(hello) != _HELLO.size:
            return f"pid {pid} (uid {uid}) did not say which rank it is"
        rank, token = _HELLO.unpack(hello)
        if not hmac.compare_digest(token, self.offer.token):
            return f"pid {pid} (uid {uid}) claimed rank {rank} without this load's token"
        if self.allowed.get(rank) != (pid, uid):
            return (
                f"pid {pid} (uid {uid}) claimed rank {rank}, which reported "
                f"{self.allowed.get(rank, 'another host')} (pid, uid): not a rank of this job on this host"
            )
        with self._lock:
            if rank in self.served:
                return f"pid {pid} asked twice for rank {rank}'s descriptors"
            self.served.add(rank)
        return None

    def stop(self) -> None:
        """Stop accepting, at once (shutting the socket down wakes the accepting thread)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def close(self) -> None:
        """Stop, and wait a little for the threads (one held by a silent peer ends at its timeout)."""
        self.stop()
        for t in self._threads:
            t.join(timeout=0.5)


class HandoverError(Exception):
    """Why a rank could not take rank 0's descriptors (it then takes the stream)."""


def fetch(offer: Offer, rank: int, timeout: float) -> list[int]:
    """(a rank on rank 0's host) Rank 0's descriptors, in ``offer.identities`` order, each checked
    against the offer (regular, read-only, same identity); raises HandoverError or OSError (nothing
    left open) otherwise."""
    import fcntl  # POSIX only, like everything here; imported where it is needed

    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(timeout)
            sock.connect("\0" + offer.name)
            if _peer(sock) != (offer.pid, offer.uid):
                raise HandoverError(f"the socket's peer is {_peer(sock)} (pid, uid), not rank 0")
            sock.sendall(_HELLO.pack(rank, offer.token))
            total = len(offer.identities)
            while len(fds) < total:
                data, got, flags, _ = socket.recv_fds(sock, _BATCH.size, _FDS_PER_MESSAGE)
                fds += got
                if not data:
                    raise HandoverError("rank 0 sent nothing: it refused this rank, or failed (see its log)")
                if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                    raise HandoverError("descriptors dropped in transit (too many open files here?)")
                first, count = _BATCH.unpack(data)
                if first + len(got) != len(fds) or count != total or not got:
                    raise HandoverError(f"unexpected message from rank 0 ({first}, {count}, {len(got)} fds)")
        for fd, identity in zip(fds, offer.identities, strict=True):
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or FileIdentity.of(st) != identity:
                raise HandoverError(f"a descriptor is not the file rank 0 validated ({identity})")
            if os.O_ACCMODE & fcntl.fcntl(fd, fcntl.F_GETFL) != os.O_RDONLY:
                raise HandoverError("a descriptor is open for writing")
        return fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


@dataclass
class LocalReads:
    """(all ranks) One load's hand-over: made by :func:`hand_over`, its :attr:`readers` set by
    :meth:`decide`."""

    offer: Offer | None
    status: str  # which path this rank took, and why (LoadReport.local_status)
    server: Server | None = None  # rank 0
    files: dict[str, LentFile] | None = None  # a rank on rank 0's host that holds the descriptors
    host: torch.Tensor | None = None  # that rank's pinned buffer, shards off the CPU
    readers: frozenset[int] = frozenset()  # the ranks that read their own bytes (the same on every rank)

    def decide(self) -> None:
        """(all ranks) Which ranks read locally: each rank's bit, OR-ed over the ranks; rank 0 then
        stops serving. Nothing is collective when local reads are off (no offer)."""
        if self.offer is None:
            return
        self.readers = _distribute.ranks_where(self.files is not None, "agreeing on node-local reads")
        if self.server is not None:
            self.server.stop()  # every rank has had its try: the hand-over is over
            fell_back = sorted(self.server.allowed.keys() - self.readers)
            if fell_back:
                logger.warning(
                    "rank0load: ranks %s on rank 0's host take the stream instead of reading locally "
                    "(their LoadReport.local_status says why)",
                    fell_back,
                )

    @property
    def everyone(self) -> bool:
        """Every rank but 0 reads its own bytes: nothing is left to send."""
        return len(self.readers) == dist.get_world_size() - 1

    def close(self) -> None:
        """Close this rank's descriptors (rank 0's server is closed by ``Server.listen``'s caller)."""
        for file in (self.files or {}).values():
            file.close()


def hand_over(
    offer: Offer | None,
    server: Server | None,
    paths: Sequence[str],
    mesh_device: torch.device,
    host_bytes: int,
    enabled: bool,
) -> LocalReads:
    """(all ranks, after the manifest) Rank 0 serves its descriptors to the ranks on its host, which
    fetch and check them (``paths``: ``Manifest.files``; ``host_bytes``: the size of a local reader's
    pinned buffer, shards off the CPU; ``enabled``: for the status). Raises only when a collective fails."""
    rank = dist.get_rank()
    if offer is None:
        why = "local_reads=False" if not enabled else "rank 0 could not listen on an abstract socket"
        return LocalReads(None, status="rank 0" if rank == 0 else f"stream: {why}")
    here = host_id() == offer.host
    roster = _distribute.gather_to_rank0(
        (int(here), os.getpid(), os.getuid()), "telling rank 0 which ranks share its host"
    )
    if rank == 0:
        assert server is not None and roster is not None  # rank 0 made the offer; gather returns on rank 0
        allowed = {r: (pid, uid) for r, (same, pid, uid) in enumerate(roster) if same and r != 0}
        server.serve(allowed)
        return LocalReads(offer, status="rank 0", server=server)
    if not here:
        return LocalReads(offer, status="stream: not on rank 0's host")
    try:
        fds = fetch(offer, rank, TIMEOUT)
    except Exception as exc:  # anything at all: this rank takes the stream (it must not raise alone)
        logger.debug("rank %d takes the stream: %s", rank, exc)
        return LocalReads(offer, status=f"stream: the hand-over failed ({type(exc).__name__}: {exc})")
    try:
        host = (
            None if mesh_device.type == "cpu" else torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)
        )
    except Exception as exc:  # a pinned buffer that cannot be had: take the stream
        for fd in fds:
            os.close(fd)
        return LocalReads(offer, status=f"stream: {type(exc).__name__}: {exc}")
    lent = zip(paths, fds, offer.identities, strict=True)  # fetch returned one per identity, in order
    files = {path: LentFile(path, fd, identity) for path, fd, identity in lent}
    status = "local: read its own bytes through rank 0's descriptors"
    return LocalReads(offer, files=files, host=host, status=status)
