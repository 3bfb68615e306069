"""Node-local reads: rank 0 lends its open checkpoint files to the ranks on its own host; with
``readers="host"``, the first rank of every other host that holds identical files is that host's
rank 0: it opens them itself and lends them to the ranks of its host.

Read-only descriptors, passed over a Unix socket (``SCM_RIGHTS``), read even where a rank's mount
namespace hides the checkpoint: rank 0 stays the only rank that resolves and validates it. A host
reader's files count as rank 0's only if each has the size and :func:`content_digest` rank 0's
offer carries (checked before any data moves; a host whose copy differs, or lacks a file, takes the
stream), and are checked for changes while they are read as rank 0's are.

(rank 0) :meth:`Server.listen` once the manifest exists (an abstract Unix socket, reachable only
from rank 0's network namespace); its :class:`Offer` rides on the manifest's broadcast.
(all ranks) :func:`hand_over`: the ranks say which host each is on (one all-gather); with
``readers="host"`` the first rank of each other host opens and checks its copy, and the ranks agree
which did (one all-reduce). Rank 0 and each host reader hand their descriptors only to a peer whose
kernel-reported pid and uid (``SO_PEERCRED``) are those a rank on their host reported and that sends
the offer's token; that rank checks that the peer is its lender and every descriptor against the offer.
(all ranks) :meth:`LocalReads.decide`: a rank reads locally only if it holds every descriptor,
verified; any failure makes it take the stream, and rank 0 knows to send it its pieces: never a hang.
"""

from __future__ import annotations

import contextlib
import hashlib
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
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..checkpoint._files import FileIdentity, OpenFile, content_digest, open_files
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
    # content_digest of each file, in the same order, for the hosts that check their own copy
    # (readers="host"); empty otherwise
    digests: tuple[bytes, ...] = ()


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
    def listen(
        cls, files: Sequence[OpenFile], digests: bool = False, like: Offer | None = None
    ) -> Server | None:
        """(rank 0, or a host reader: ``like`` is rank 0's offer) Listen for the ranks on this host;
        None where that cannot be done (not Linux, no abstract sockets): they then take the stream.
        ``digests``: the offer carries each file's :func:`content_digest` (read from ``files``)."""
        host = host_id()
        if host is None or not hasattr(socket, "send_fds") or not hasattr(socket, "SO_PEERCRED"):
            return None
        if like is None:
            name, token = f"rank0load-{os.getpid()}-{secrets.token_hex(8)}", secrets.token_bytes(16)
        else:  # named after rank 0's socket and this rank; the ranks of this host send rank 0's token
            name, token = _lender_name(like, dist.get_rank()), like.token
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.bind("\0" + name)
            sock.listen(64)
        except OSError as exc:
            sock.close()
            logger.debug("node-local reads off: cannot listen on an abstract socket: %s", exc)
            return None
        try:
            identities = tuple(f.identity for f in files)
            sums = tuple(content_digest(f.fd, f.identity.size, f.path) for f in files) if digests else ()
        except BaseException:
            sock.close()
            raise
        offer = Offer(name, token, os.getpid(), os.getuid(), host, identities, sums)
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


def fetch(offer: Offer, rank: int, timeout: float, exact: bool = True) -> list[int]:
    """(a rank on rank 0's host, or on a host reader's) The lender's descriptors, in
    ``offer.identities`` order, each checked against the offer (regular, read-only, same identity;
    not ``exact``: a host reader's own copy, same size); raises HandoverError or OSError (nothing
    left open) otherwise."""
    import fcntl  # POSIX only, like everything here; imported where it is needed

    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(timeout)
            sock.connect("\0" + offer.name)
            if _peer(sock) != (offer.pid, offer.uid):
                raise HandoverError(f"the socket's peer is {_peer(sock)} (pid, uid), not the lender")
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
            same = FileIdentity.of(st) == identity if exact else st.st_size == identity.size
            if not stat.S_ISREG(st.st_mode) or not same:
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
    server: Server | None = None  # rank 0's, or this host reader's (then closed by close())
    files: dict[str, OpenFile] | None = None  # lent files, or a host reader's own: this rank reads
    host: torch.Tensor | None = None  # that rank's pinned buffer, shards off the CPU
    readers: frozenset[int] = frozenset()  # the ranks that read their own bytes (the same on every rank)
    # the first ranks of the hosts, other than rank 0's, that read their own copy (the same everywhere)
    hosts: frozenset[int] = frozenset()
    off_host: frozenset[int] = frozenset()  # the ranks not on rank 0's host (the same everywhere)
    network_bytes: int = 0  # (rank 0) bytes it sent to ranks off its host, each broadcast once
    owns_server: bool = False  # a host reader's: close() closes it

    def decide(self) -> None:
        """(all ranks) Which ranks read locally: each rank's bit, OR-ed over the ranks; rank 0 and
        the host readers then stop serving. Nothing is collective when local reads are off (no offer)."""
        if self.offer is None:
            return
        self.readers = _distribute.ranks_where(self.files is not None, "agreeing on node-local reads")
        if self.server is not None:
            self.server.stop()  # every rank has had its try: the hand-over is over
            fell_back = sorted(self.server.allowed.keys() - self.readers)
            if fell_back:
                logger.warning(
                    "rank0load: ranks %s on rank %d's host take the stream instead of reading locally "
                    "(their LoadReport.local_status says why)",
                    fell_back,
                    dist.get_rank(),
                )

    @property
    def everyone(self) -> bool:
        """Every rank but 0 reads its own bytes: nothing is left to send."""
        return len(self.readers) == dist.get_world_size() - 1

    def close(self) -> None:
        """Close this rank's descriptors, and a host reader's server (rank 0's is closed by
        ``Server.listen``'s caller)."""
        if self.owns_server and self.server is not None:
            self.server.close()  # before its files: its threads may still hold their descriptors
        for file in (self.files or {}).values():
            file.close()


def _host_key(rank: int) -> int:
    """This rank's :func:`host_id` as an int63 (negative and unique off Linux: a host of its own)."""
    host = host_id()
    if host is None:
        return -1 - rank
    return int.from_bytes(hashlib.blake2b(host.encode(), digest_size=8).digest(), "little") >> 1


def _lender_name(offer: Offer, rank: int) -> str:
    """The abstract socket name of host reader ``rank``, from rank 0's offer."""
    return f"{offer.name}-r{rank}"


def _pinned(mesh_device: torch.device, host_bytes: int) -> torch.Tensor | None:
    """A local reader's pinned buffer for shards off the CPU; None on a CPU mesh."""
    if mesh_device.type == "cpu":
        return None
    return torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)


def _own_copy(offer: Offer, paths: Sequence[str], mesh_device: torch.device, host_bytes: int) -> LocalReads:
    """(the first rank of a host other than rank 0's, readers="host") This host's files at rank 0's
    ``paths``, opened and compared with rank 0's offer (size, :func:`content_digest`), listening for
    the ranks of this host; raises (nothing left open) if they differ or anything fails."""
    own = open_files(paths)
    server: Server | None = None
    try:
        files = [own[p] for p in paths]
        for f, identity, digest in zip(files, offer.identities, offer.digests, strict=True):
            if f.identity.size != identity.size:
                raise HandoverError(f"{f.path} has {f.identity.size} bytes here, {identity.size} on rank 0")
            if content_digest(f.fd, f.identity.size, f.path) != digest:
                raise HandoverError(
                    f"{f.path} here is not rank 0's file (its header or sampled bytes differ)"
                )
        server = Server.listen(files, like=offer)
        if server is None:
            raise HandoverError("cannot listen on an abstract socket for the ranks of this host")
        host = _pinned(mesh_device, host_bytes)
    except BaseException:
        if server is not None:
            server.close()
        for f in own.values():
            f.close()
        raise
    status = "local: read its own bytes from its host's copy (rank 0's files, by size and digest)"
    return LocalReads(offer, status=status, server=server, files=own, host=host, owns_server=True)


def hand_over(
    offer: Offer | None,
    server: Server | None,
    paths: Sequence[str],
    mesh_device: torch.device,
    host_bytes: int,
    enabled: bool,
    readers: str = "rank0",
) -> LocalReads:
    """(all ranks, after the manifest) Rank 0 serves its descriptors to the ranks on its host, which
    fetch and check them (``paths``: ``Manifest.files``; ``host_bytes``: the size of a local reader's
    pinned buffer, shards off the CPU; ``enabled``: for the status). ``readers="host"`` (the same on
    every rank): the first rank of each other host checks its own copy (:func:`_own_copy`) and, where
    it is rank 0's, serves it to the ranks of its host as rank 0 does. Raises only when a collective fails."""
    rank = dist.get_rank()
    if offer is None:
        why = "local_reads=False" if not enabled else "rank 0 could not listen on an abstract socket"
        return LocalReads(None, status="rank 0" if rank == 0 else f"stream: {why}")
    key = _host_key(rank)
    roster = _distribute.all_gather_ints(
        (key, os.getpid(), os.getuid()), "telling the ranks which ranks share a host"
    )
    home = roster[0][0]
    first = min(r for r, (k, _, _) in enumerate(roster) if k == key)  # this host's first rank
    off_host = frozenset(r for r, (k, _, _) in enumerate(roster) if k != home)
    mine: LocalReads | None = None
    why = "not on rank 0's host"
    if readers == "host" and key != home and rank == first:
        try:
            mine = _own_copy(offer, paths, mesh_device, host_bytes)
        except Exception as exc:  # anything at all: this host takes the stream (agreed below)
            why = f"this host's copy is not rank 0's ({type(exc).__name__}: {exc})"
            logger.warning("rank0load: rank %d's host takes the stream: %s", rank, why)
    hosts: frozenset[int] = frozenset()
    if readers == "host":
        hosts = _distribute.ranks_where(mine is not None, "agreeing which hosts read their own copy")

    def allowed(lender: int) -> dict[int, tuple[int, int]]:  # the ranks of its host, but itself
        return {
            r: (pid, uid) for r, (k, pid, uid) in enumerate(roster) if k == roster[lender][0] and r != lender
        }

    def made(reads: LocalReads) -> LocalReads:
        reads.hosts, reads.off_host = hosts, off_host
        return reads

    if rank == 0:
        assert server is not None  # rank 0 made the offer
        server.serve(allowed(0))
        return made(LocalReads(offer, status="rank 0", server=server))
    if mine is not None:
        assert mine.server is not None
        mine.server.serve(allowed(rank))
        return made(mine)
    if key == home:
        lender, exact = offer, True
    elif first in hosts:
        _, pid, uid = roster[first]
        lender, exact = replace(offer, name=_lender_name(offer, first), pid=pid, uid=uid), False
    else:
        if rank != first and readers == "host":
            why = f"its host's first rank {first} found no copy of rank 0's files (its local_status says why)"
        return made(LocalReads(offer, status=f"stream: {why}"))
    try:
        fds = fetch(lender, rank, TIMEOUT, exact)
    except Exception as exc:  # anything at all: this rank takes the stream (it must not raise alone)
        logger.debug("rank %d takes the stream: %s", rank, exc)
        return made(LocalReads(offer, status=f"stream: the hand-over failed ({type(exc).__name__}: {exc})"))
    try:
        host = _pinned(mesh_device, host_bytes)
    except Exception as exc:  # a pinned buffer that cannot be had: take the stream
        for fd in fds:
            os.close(fd)
        return made(LocalReads(offer, status=f"stream: {type(exc).__name__}: {exc}"))
    lent = zip(paths, fds, offer.identities, strict=True)  # fetch returned one per identity, in order
    files: dict[str, OpenFile] = {
        path: LentFile(path, fd, identity if exact else FileIdentity.of(os.fstat(fd)))
        for path, fd, identity in lent
    }
    status = (
        "local: read its own bytes through rank 0's descriptors"
        if exact
        else f"local: read its own bytes through rank {first}'s descriptors (its host's copy)"
    )
    return made(LocalReads(offer, files=files, host=host, status=status))
