"""Same-machine links for collectives: payload through shared-memory rings,
control through a UNIX socket per pair of ranks.

:class:`ShmLinks` is a :class:`~pmetal.collectives.executor.RankLinks` for a
world whose ranks share one machine (one boot, one ``/dev/shm``), as MPI's
shared-memory transport: a message is copied once into the sender's ring
(that is where ``send`` copies) and once out of it, into ``out``, or read in
place by the caller through a read-only view.

Rings. Each rank creates one shared-memory object (mode 0600, named as
:mod:`pmetal.shm` names its objects) holding one ring of ``ring_bytes`` per
peer, and maps the slice of every peer's object meant for it read-only. A
piece of a message takes a contiguous, 64-byte-aligned region of the ring
(never wrapping: the tail of the ring is skipped instead), so the receiver
can view it as an array. A message larger than a quarter of the ring goes as
several pieces: the receiver drains the first while the sender writes the
next, and a message larger than the ring still flows.

Control. Every pair of ranks shares one connected ``AF_UNIX`` stream socket
that carries 48-byte records (:data:`_REC`: kind, op_id, chunk, dtype code,
message bytes, ring position, piece bytes): ``PMD1`` "a piece is in the
ring at this position", ``PMA1`` "I am done with your ring up to this
position" (sent every eighth of a ring, and before the receiver blocks or an
operation ends), ``PMR1`` "attached to your ring" (once, while connecting).
Shared memory carries payload bytes only, never a counter, because Python
has no atomics or fences: the sender's stores into the ring come before its
``send()`` on the socket, the receiver's loads after its ``recv()``, and the
socket's kernel lock orders the two on every architecture (x86-64 and arm64
alike) without relying on x86's store order or on an 8-byte store being
atomic. Acks order the other way round: the receiver is done reading a
region before it says so, the sender overwrites it only after reading that.
It costs a system call per piece (about a microsecond), nothing next to a
copy of a piece; small messages pay one each way.

Wake-ups and death. A waiting receiver reads its socket without blocking
for up to :data:`_SPIN` seconds, then sleeps in ``poll()`` until a record,
an ack it needs or the deadline. The kernel closes a killed process's
sockets, so its peers read end-of-file at once and ``recv`` raises
:class:`~pmetal.errors.PeerError` once the messages it sent before are
returned; a stopped process's socket stays open, so only the deadline ends
the wait (:class:`TimeoutError`). The peer's pid is checked too, every
:data:`_PID_CHECK` seconds, in case a child it forked keeps the socket open.

Buffering. ``send`` never waits: what does not fit in the ring waits in a
per-peer backlog holding a view of the caller's data (``detach`` and
``release`` copy the unsent rest), pushed whenever an ack makes room: in any
later call, while ``recv`` waits, and after ``release`` by a flusher thread
(started on demand, gone when the backlog is empty) so that the end of an
operation is delivered while the caller computes.

Connecting. The rendezvous folder ``/dev/shm/pmetal-<hash of the token>``
(elsewhere than Linux: the temporary folder) is created 0700 and must be
ours; each rank binds ``<rank>.sock`` in it, dials the lower ranks and
accepts the higher ones; hellos carry the rank, pid and ring object name and
a MAC keyed by the token. Once every peer has attached to its rings, a rank
unlinks its object and socket file, and the last one the folder: a SIGKILL
after :meth:`ShmLinks.connect` leaves nothing behind. A SIGKILL during it
leaves a socket file in the private folder and the ring object, which
:func:`pmetal.shm.sweep` unlinks once its creator is dead.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import mmap
import os
import select
import socket
import stat
import struct
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Self

import numpy as np

from pmetal import shm
from pmetal.errors import (
    ClosedError,
    HandshakeError,
    PeerError,
    PMetalTimeoutError,
    PMetalValueError,
    ProtocolError,
    SecurityError,
    TransportError,
)

__all__ = ["ShmLinks"]

log = logging.getLogger(__name__)

# The codes of the TCP links' header (links contract); uint16 carries bfloat16.
_DTYPE_CODES = {np.dtype(t): c for t, c in (
    (np.float16, 1), (np.float32, 2), (np.float64, 3), (np.int32, 4), (np.int64, 5),
    (np.uint16, 6), (np.int8, 7), (np.uint8, 8))}
_DTYPES = {c: t for t, c in _DTYPE_CODES.items()}

_REC = struct.Struct("<4s4xQIIQQQ")   # kind, op_id, chunk, dtype, nbytes, position, length
_DATA, _ACK, _READY = b"PMD1", b"PMA1", b"PMR1"
_HELLO = struct.Struct("<4sIIQQ32s16s")  # magic, rank, world, pid, pid namespace, name, MAC
_HELLO_MAGIC = b"PMH1"
_ALIGN = 64            # piece alignment: any dtype's views, and a cache line
_SPIN = 50e-6          # non-blocking reads before a receiver sleeps
_PID_CHECK = 0.5       # how often a sleeper checks the peer's pid


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(eq=False)
class _Pending:
    """A message (part) not yet in the ring: ``data`` holds its bytes from
    ``base`` on; ``sent`` of its ``nbytes`` are in the ring already."""

    op_id: int
    chunk: int
    code: int
    nbytes: int
    data: np.ndarray
    base: int = 0
    sent: int = 0
    owned: bool = False


class _Peer:
    """One peer: its socket, our ring to it (``ring_out``) and its ring to us
    (``ring_in``), and both directions' positions."""

    def __init__(self, rank: int, pid: int, sock: socket.socket) -> None:
        self.rank, self.pid, self.sock = rank, pid, sock
        self.ring_out: np.ndarray = np.empty(0, np.uint8)
        self.ring_in: np.ndarray = np.empty(0, np.uint8)
        self.in_map: mmap.mmap | None = None
        # sending: our next free position, and where the peer is done reading
        self.write = self.acked = 0
        self.backlog: deque[_Pending] = deque()
        self.wbuf = bytearray()
        # receiving: records read, how far we are done, how far we said so
        self.rbuf = bytearray()
        self.inbox: deque[tuple[bytes, int, int, int, int, int, int]] = deque()
        self.consumed = self.ack_sent = 0
        self.lent = 0            # end of the piece a returned view shows (0: none)
        self.stash: dict[int, deque[tuple[int, np.ndarray]]] = {}
        self.lost = ""           # why the link broke ("" while it works)
        self.pid_checked = 0.0


class ShmLinks:
    """One rank's links to the other ranks of its machine (see the module
    docstring). Made by :meth:`connect`; not thread-safe for callers (one
    executor at a time), though its own flusher thread shares its state."""

    def __init__(self, rank: int, world: int, peers: dict[int, _Peer], own: mmap.mmap | None,
                 ring_bytes: int) -> None:
        self.rank, self.world = rank, world
        self._peers = peers
        self._own = own
        self._ring = ring_bytes
        self._piece = ring_bytes // 4 // _ALIGN * _ALIGN
        self._ack_every = ring_bytes // 8
        self._lock = threading.Lock()
        self._flushing = False
        self._flusher: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------ connect

    @classmethod
    def connect(cls, token: str, rank: int, world: int, *, deadline: float,
                ring_bytes: int = 8 << 20) -> ShmLinks:
        """Join the world of ``world`` ranks sharing ``token`` (a secret the
        group layer gave every rank) as ``rank``; returns once every rank
        has joined. ``deadline`` (``time.monotonic()``) bounds the wait for
        the others: past it, :class:`~pmetal.errors.PMetalTimeoutError`."""
        if not 0 <= rank < world:
            raise PMetalValueError(f"rank {rank} is not in a world of {world}")
        if not token:
            raise PMetalValueError("the shared-memory links need the group's token")
        page = mmap.ALLOCATIONGRANULARITY
        ring_bytes = max(64 << 10, -(-ring_bytes // page) * page)
        if world == 1:
            return cls(rank, world, {}, None, ring_bytes)
        if shm._posixshmem is None:
            raise TransportError("shared-memory links need POSIX shared memory, which this "
                                 "platform lacks: use the TCP links")
        key, folder = _rendezvous(token)
        me = os.path.join(folder, f"{rank}.sock")
        name, own = _create_rings(ring_bytes * (world - 1))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peers: dict[int, _Peer] = {}
        socks: list[socket.socket] = []
        try:
            listener.bind(me)
            listener.listen(world)
            # Dial the lower ranks, accept the higher ones; then every hello.
            socks = [_dial(os.path.join(folder, f"{p}.sock"), deadline) for p in range(rank)]
            for _ in range(world - 1 - rank):
                listener.settimeout(max(1e-3, deadline - time.monotonic()))
                try:
                    socks.append(listener.accept()[0])
                except TimeoutError as exc:
                    raise PMetalTimeoutError(f"rank {rank}: not every higher rank dialed in "
                                             "before the deadline") from exc
            hello = _hello(key, rank, world, name)
            for sock in socks:
                sock.sendall(hello)
            for i, sock in enumerate(socks):
                peer, pid, peer_name = _check_hello(key, world, _read(sock, _HELLO.size, deadline))
                if peer == rank or peer in peers or (i < rank and peer != i):
                    raise HandshakeError(f"rank {rank} met a second rank {peer} (or rank {i} "
                                         f"answered as {peer}): two groups share a token")
                peers[peer] = _attach(_Peer(peer, pid, sock), peer_name, rank, ring_bytes)
            ready = _REC.pack(_READY, 0, 0, 0, 0, 0, 0)
            for p in peers.values():
                p.sock.sendall(ready)
            for p in peers.values():
                if _REC.unpack(_read(p.sock, _REC.size, deadline))[0] != _READY:
                    raise ProtocolError(f"rank {p.rank} sent something else than READY")
        except BaseException:
            for sock in socks:
                sock.close()
            own.close()
            raise
        finally:
            # Every peer mapped our rings (or never will): nothing to find by name.
            shm.unlink(name)
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(me)
            with contextlib.suppress(OSError):
                os.rmdir(folder)   # the last rank out removes it
        links = cls(rank, world, peers, own, ring_bytes)
        for p in peers.values():
            p.sock.setblocking(False)
            index = p.rank if p.rank < rank else p.rank - 1
            p.ring_out = np.frombuffer(own, np.uint8, ring_bytes, index * ring_bytes)
        return links

    # ------------------------------------------------------------ sending

    def send(self, to_rank: int, op_id: int, chunk: int, data: np.ndarray) -> None:
        """Queue ``data`` for ``to_rank``: copied into the ring now as far
        as it fits, the rest when the peer makes room (never waits)."""
        peer = self._peer(to_rank)
        code = _DTYPE_CODES.get(data.dtype)
        if code is None:
            raise PMetalValueError(f"the shared-memory links cannot carry {data.dtype} arrays")
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        with self._lock:
            self._check_open()
            if peer.lost:
                raise PeerError(f"rank {to_rank} is unreachable: {peer.lost}")
            peer.backlog.append(_Pending(op_id, chunk, code, raw.nbytes, raw))
            self._push(peer)
            if peer.backlog:
                self._service(peer)   # read the acks that may have made room

    def detach(self, op_id: int, chunk: int) -> None:
        """The caller is about to overwrite ``chunk``: copy what of it is
        not in a ring yet."""
        with self._lock:
            for peer in self._peers.values():
                self._service(peer)
                for item in peer.backlog:
                    if item.op_id == op_id and item.chunk == chunk:
                        _own(item)

    def release(self, op_id: int) -> None:
        """``op_id`` is over: no backlog keeps a view of the caller's data
        after this (dropped for dead peers, copied for live ones and sent by
        the flusher thread), and the regions read are acked."""
        with self._lock:
            for peer in self._peers.values():
                self._return_lent(peer)
                for old in [o for o in peer.stash if o <= op_id]:
                    del peer.stash[old]
                self._service(peer)
                if peer.consumed > peer.ack_sent:
                    self._ack(peer)
                for item in peer.backlog:
                    if item.op_id == op_id:
                        _own(item)
            if not self._flushing and any(p.backlog or p.wbuf for p in self._peers.values()):
                self._flushing = True
                self._flusher = threading.Thread(target=self._flush_loop, daemon=True,
                                                 name=f"pmetal-shmlinks-{self.rank}")
                self._flusher.start()

    def _push(self, peer: _Peer) -> None:
        """Copy backlog into the ring while it has room; tell the peer piece by piece."""
        while peer.backlog and not peer.lost:
            item = peer.backlog[0]
            n = min(item.nbytes - item.sent, self._piece)
            start = self._alloc(peer, n)
            if start is None:
                return
            if n:
                at, src = start % self._ring, item.sent - item.base
                peer.ring_out[at:at + n] = item.data[src:src + n]
            peer.wbuf += _REC.pack(_DATA, item.op_id, item.chunk, item.code, item.nbytes,
                                   start, n)
            self._flush(peer)
            item.sent += n
            if item.sent == item.nbytes:
                peer.backlog.popleft()

    def _alloc(self, peer: _Peer, n: int) -> int | None:
        """The ring position for a piece of ``n`` bytes, or None while the
        peer has not made room for it. A piece never wraps around."""
        size, at = _aligned(n), peer.write % self._ring
        skip = self._ring - at if at + size > self._ring else 0
        if peer.write + skip + size - peer.acked > self._ring:
            return None
        start = peer.write + skip
        peer.write = start + size
        return start

    def _flush(self, peer: _Peer) -> None:
        while peer.wbuf and not peer.lost:
            try:
                sent = peer.sock.send(peer.wbuf)
            except BlockingIOError:
                return   # the peer reads its socket later; poll() waits for room
            except OSError as exc:
                self._lose(peer, f"its socket failed: {exc}")
                return
            del peer.wbuf[:sent]

    def _ack(self, peer: _Peer) -> None:
        peer.wbuf += _REC.pack(_ACK, 0, 0, 0, 0, peer.consumed, 0)
        peer.ack_sent = peer.consumed
        self._flush(peer)

    # ---------------------------------------------------------- receiving

    def recv(self, from_rank: int, op_id: int, deadline: float,
             out: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """The next message of ``op_id`` from ``from_rank`` as ``(chunk,
        data)``: ``out`` filled when it fits (contiguous, same dtype and
        length), else a read-only view of the ring valid until the next
        call (or a fresh array for a message that came in pieces)."""
        peer = self._peer(from_rank)
        with self._lock:
            self._check_open()
            for p in self._peers.values():
                self._return_lent(p)
            for old in [o for o in peer.stash if o < op_id]:
                del peer.stash[old]
            kept = peer.stash.get(op_id)
            if kept:
                chunk, data = kept.popleft()
                if _fits(out, data.dtype, data.size):
                    out[...] = data.reshape(out.shape)
                    return chunk, out
                return chunk, data
            while True:
                record = self._next(peer, deadline)
                if record[1] < op_id:      # a failed operation's leftover
                    self._take(peer, record, deadline, None, keep=False)
                elif record[1] > op_id:    # a later operation's: copy out, keep
                    data = self._take(peer, record, deadline, None, keep=True)
                    peer.stash.setdefault(record[1], deque()).append((record[2], data))
                else:
                    return record[2], self._take(peer, record, deadline, out, keep=True,
                                                 lend=True)

    def _take(self, peer: _Peer, first: tuple[bytes, int, int, int, int, int, int],
              deadline: float, out: np.ndarray | None, *, keep: bool,
              lend: bool = False) -> np.ndarray:
        """Read the message whose first piece is ``first``, into ``out``
        when it fits; ``keep=False`` only frees its pieces."""
        _, op_id, chunk, code, nbytes, start, length = first
        dtype = _DTYPES.get(code)
        if dtype is None or nbytes % dtype.itemsize:
            raise ProtocolError(f"rank {peer.rank} sent {nbytes} bytes of dtype code {code}")
        count = nbytes // dtype.itemsize
        if lend and length == nbytes and not _fits(out, dtype, count):
            at = self._region(peer, start, length)
            peer.lent = start + _aligned(length)
            return peer.ring_in[at:at + length].view(dtype)
        dest = out if _fits(out, dtype, count) else np.empty(count if keep else 0, dtype)
        raw = dest.reshape(-1).view(np.uint8)
        done = 0
        while True:
            at = self._region(peer, start, length)
            if keep:
                raw[done:done + length] = peer.ring_in[at:at + length]
            done += length
            self._consume(peer, start + _aligned(length))
            if done >= nbytes:
                return dest
            _, o, c, _, n, start, length = self._next(peer, deadline)
            if (o, c, n) != (op_id, chunk, nbytes) or done + length > nbytes or not length:
                raise ProtocolError(f"rank {peer.rank} broke off message {op_id}/{chunk} "
                                    f"after {done} of {nbytes} bytes")

    def _region(self, peer: _Peer, start: int, length: int) -> int:
        at = start % self._ring
        if at + length > self._ring or start < peer.consumed:
            raise ProtocolError(f"rank {peer.rank} sent a piece outside its ring "
                                f"({length} bytes at {start})")
        return at

    def _consume(self, peer: _Peer, end: int) -> None:
        peer.consumed = end
        if peer.consumed - peer.ack_sent >= self._ack_every:
            self._ack(peer)

    def _return_lent(self, peer: _Peer) -> None:
        if peer.lent:
            self._consume(peer, peer.lent)
            peer.lent = 0

    def _next(self, peer: _Peer, deadline: float) -> tuple[bytes, int, int, int, int, int, int]:
        """The next data record from ``peer``: spin, then sleep in poll()."""
        spin_until = 0.0
        while True:
            if peer.inbox:
                return peer.inbox.popleft()
            self._service(peer)
            if peer.inbox:
                continue
            if peer.lost:
                raise PeerError(f"rank {peer.rank} is gone: {peer.lost}")
            now = time.monotonic()
            if now >= deadline:
                raise PMetalTimeoutError(f"rank {self.rank} got no message from rank "
                                         f"{peer.rank} before the deadline")
            if not spin_until:
                spin_until = now + _SPIN
            elif now >= spin_until:
                if peer.pid and now - peer.pid_checked > _PID_CHECK:
                    peer.pid_checked = now
                    if not shm.pid_alive(peer.pid):
                        self._lose(peer, f"its process {peer.pid} died")
                        continue
                self._sleep([peer], min(deadline, now + _PID_CHECK))

    # --------------------------------------------------- socket servicing

    def _service(self, peer: _Peer) -> None:
        """Read what ``peer`` sent (records, acks); push backlog into room."""
        while not peer.lost:
            try:
                got = peer.sock.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError as exc:
                self._lose(peer, f"its socket failed: {exc}")
                break
            if not got:
                self._lose(peer, "it closed its link (the process exited or was killed)")
                break
            peer.rbuf += got
            if len(got) < 1 << 16:
                break
        whole = len(peer.rbuf) - len(peer.rbuf) % _REC.size
        for record in _REC.iter_unpack(peer.rbuf[:whole]):
            if record[0] == _DATA:
                peer.inbox.append(record)
            elif record[0] == _ACK:
                peer.acked = max(peer.acked, record[5])
            else:
                self._lose(peer, f"it sent an unknown record {record[0]!r}")
        del peer.rbuf[:whole]
        if peer.backlog:
            self._push(peer)
        self._flush(peer)

    def _sleep(self, waiting: list[_Peer], until: float) -> None:
        """Block (lock released) until a socket of ``waiting``, or one with
        backlog or unsent records, has news, or ``until``."""
        poller = select.poll()
        fds: dict[int, _Peer] = {}
        for p in self._peers.values():
            if p.consumed > p.ack_sent:
                self._ack(p)   # a sender may be waiting for room we already made
            flags = (select.POLLIN if p in waiting or p.backlog else 0) | (
                select.POLLOUT if p.wbuf else 0)
            if flags and not p.lost:
                poller.register(p.sock, flags)
                fds[p.sock.fileno()] = p
        timeout = max(0.0, until - time.monotonic())
        self._lock.release()
        try:
            events = poller.poll(max(1, int(timeout * 1000 + 0.999)))
        finally:
            self._lock.acquire()
        for fd, _ in events:
            self._service(fds[fd])

    def _flush_loop(self) -> None:
        """The flusher thread: deliver backlog left at the end of an
        operation; exits when there is none (or the links close)."""
        with self._lock:
            while True:
                busy = [p for p in self._peers.values() if (p.backlog or p.wbuf) and not p.lost]
                if self._closed or not busy:
                    self._flushing = False
                    return
                self._sleep(busy, time.monotonic() + _PID_CHECK)

    def _lose(self, peer: _Peer, why: str) -> None:
        if not peer.lost:
            log.info("shared-memory link from rank %s to rank %s lost: %s", self.rank,
                     peer.rank, why)
            peer.lost = why
        peer.backlog.clear()
        peer.wbuf.clear()

    # ------------------------------------------------------------- others

    def dead(self) -> set[int]:
        with self._lock:
            return {r for r, p in self._peers.items() if p.lost}

    def close(self, linger: float = 10.0) -> None:
        """Deliver what is still queued for live peers (for at most
        ``linger`` seconds: the end of the last operation), then close the
        sockets (peers see end-of-file) and unmap the rings; a view a caller
        still holds keeps its mapping alive."""
        with self._lock:
            if self._closed:
                return
            end = time.monotonic() + linger
            while time.monotonic() < end:
                busy = [p for p in self._peers.values() if (p.backlog or p.wbuf) and not p.lost]
                if not busy:
                    break
                self._sleep(busy, end)
            self._closed = True
            flusher = self._flusher
        if flusher is not None:
            flusher.join(2 * _PID_CHECK)
        with self._lock:
            for p in self._peers.values():
                p.sock.close()
                p.ring_in = p.ring_out = np.empty(0, np.uint8)
                _close_map(p.in_map)
                p.in_map = None
                p.lost = p.lost or "closed"
            _close_map(self._own)
            self._own = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _peer(self, rank: int) -> _Peer:
        peer = self._peers.get(rank)
        if peer is None:
            raise PMetalValueError(f"rank {self.rank} has no link to rank {rank} in a world "
                                   f"of {self.world}")
        return peer

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"the shared-memory links of rank {self.rank} are closed")


# ------------------------------------------------------------------ helpers

def _own(item: _Pending) -> None:
    """Copy the unsent rest of ``item`` so it no longer views the caller's buffer."""
    if not item.owned:
        item.data = item.data[item.sent - item.base:].copy()
        item.base, item.owned = item.sent, True


def _fits(out: np.ndarray | None, dtype: np.dtype, count: int) -> bool:
    return (out is not None and out.dtype == dtype and out.size == count
            and out.flags.c_contiguous and out.flags.writeable)


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        sock.settimeout(max(1e-3, deadline - time.monotonic()))
        try:
            got = sock.recv(n - len(data))
        except TimeoutError as exc:
            raise PMetalTimeoutError("the shared-memory links timed out waiting for a "
                                     "peer's handshake") from exc
        if not got:
            raise PeerError("a peer closed its shared-memory link while connecting")
        data += got
    return data


def _folder(token: str) -> tuple[bytes, str]:
    """The group's key and rendezvous folder: in /dev/shm where there is one
    (the ranks share it by definition), named by a hash of the token."""
    key = hashlib.blake2b(token.encode(), person=b"pm-shmlinks").digest()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return key, os.path.join(base, "pmetal-" + hashlib.blake2b(
        key, digest_size=12, person=b"pm-shml-dir").hexdigest())


def _rendezvous(token: str) -> tuple[bytes, str]:
    """:func:`_folder`, made 0700 here or by another rank; refused unless it
    is a folder we own that nobody else may enter (the name is secret, but a
    folder another user made first must not be used)."""
    key, folder = _folder(token)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SecurityError(f"{folder} is not a private folder of this user: another user "
                            "may be interfering; use a fresh group token")
    return key, folder


def _dial(path: str, deadline: float) -> socket.socket:
    """Connect to a lower rank's socket, waiting (with growing pauses) for
    that rank to bind it."""
    pause = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            if time.monotonic() + pause > deadline:
                raise PMetalTimeoutError(f"no rank listened at {path} before the deadline") \
                    from exc
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


def _mac(key: bytes, body: bytes) -> bytes:
    return hashlib.blake2b(body, key=key, digest_size=16, person=b"pm-shml-hello").digest()


def _hello(key: bytes, rank: int, world: int, name: str) -> bytes:
    body = _HELLO.pack(_HELLO_MAGIC, rank, world, os.getpid(), shm._pid_namespace(),
                       name.encode(), b"")
    return body[:-16] + _mac(key, body[:-16])


def _check_hello(key: bytes, world: int, blob: bytes) -> tuple[int, int, str]:
    magic, rank, their_world, pid, pid_ns, name, mac = _HELLO.unpack(blob)
    if magic != _HELLO_MAGIC or not hmac.compare_digest(mac, _mac(key, blob[:-16])):
        raise HandshakeError("a process in the rendezvous folder does not hold the group's "
                             "token: stale or foreign; use a fresh group token")
    if their_world != world or not 0 <= rank < world:
        raise HandshakeError(f"a peer joined as rank {rank} of {their_world}, this rank "
                             f"expects a world of {world}")
    same_ns = pid_ns == shm._pid_namespace() and pid_ns
    return rank, pid if same_ns else 0, name.rstrip(b"\0").decode()


def _create_rings(size: int) -> tuple[str, mmap.mmap]:
    """A new 0600 object of ``size`` bytes, mapped read-write, its pages
    touched now rather than on the first pass of each ring."""
    assert shm._posixshmem is not None
    name = shm._new_name(0)
    fd = shm._posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        return name, mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        shm.unlink(name)
        raise
    finally:
        os.close(fd)


def _attach(peer: _Peer, name: str, rank: int, ring_bytes: int) -> _Peer:
    """Map, read-only, the ring ``peer`` keeps for ``rank`` in its object."""
    assert shm._posixshmem is not None
    if not shm._valid_name(name):
        raise HandshakeError(f"rank {peer.rank} named a bad shared-memory object {name!r}")
    fd = shm._posixshmem.shm_open(name, os.O_RDONLY, 0o600)
    try:
        info = os.fstat(fd)
        index = rank if rank < peer.rank else rank - 1
        if info.st_uid != os.getuid() or info.st_size < (index + 1) * ring_bytes:
            raise HandshakeError(f"the rings of rank {peer.rank} ({name}) are not this user's "
                                 "or too small: every rank must use the same ring_bytes")
        peer.in_map = mmap.mmap(fd, ring_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ,
                                offset=index * ring_bytes)
    finally:
        os.close(fd)
    peer.ring_in = np.frombuffer(peer.in_map, np.uint8)
    return peer


def _close_map(mapping: mmap.mmap | None) -> None:
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:
            pass   # a caller still holds a view: the mapping goes with it
