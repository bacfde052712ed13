"""Same-machine links for collectives: payload through shared-memory rings,
control through a UNIX socket per pair of ranks.

:class:`ShmLinks` is a :class:`~pmetal.links.memory.RankLinks` for the
ranks of a world that share one machine (one boot, one ``/dev/shm``), as MPI's
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
operation ends).
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
operation is delivered while the caller computes; ``close`` delivers what is
left (for ``linger`` seconds at most) before it closes.

Connecting (:mod:`pmetal.links.shmrendezvous`): the ranks meet in a
0700 folder named by a hash of the group's secret token and prove the token
in their hellos; once every peer has mapped a rank's rings, the rank unlinks
every name it made, so a SIGKILL after :meth:`ShmLinks.connect` leaves
nothing behind in ``/dev/shm`` (during it: a socket file in the private
folder, and the ring object, which :func:`pmetal.shm.sweep` unlinks).

Platforms: POSIX shared memory and ``AF_UNIX`` sockets (Linux, macOS; on
Windows :meth:`ShmLinks.connect` raises
:class:`~pmetal.errors.TransportError`). Tested on Linux x86-64.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np

from pmetal import shm
from pmetal.links.shmrendezvous import join, slot
from pmetal.links.tcplinks import P2P_BASE
from pmetal.errors import (
    ClosedError,
    PeerError,
    PMetalTimeoutError,
    PMetalValueError,
    ProtocolError,
)

__all__ = ["ShmLinks", "ShmLinksStatistics"]

log = logging.getLogger(__name__)

# The codes of the TCP links' header (links contract); uint16 carries bfloat16.
_DTYPE_CODES = {np.dtype(t): c for t, c in (
    (np.float16, 1), (np.float32, 2), (np.float64, 3), (np.int32, 4), (np.int64, 5),
    (np.uint16, 6), (np.int8, 7), (np.uint8, 8))}
_DTYPES = {c: t for t, c in _DTYPE_CODES.items()}

_REC = struct.Struct("<4s4xQIIQQQ")   # kind, op_id, chunk, dtype, nbytes, position, length
_Record = tuple[bytes, int, int, int, int, int, int]
_DATA, _ACK = b"PMD1", b"PMA1"
_ALIGN = 64            # piece alignment: any dtype's views, and a cache line
_SPIN = 50e-6          # non-blocking reads before a receiver sleeps
_PID_CHECK = 0.5       # how often a sleeper checks the peer's pid


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True, slots=True)
class ShmLinksStatistics:
    """What one rank's links moved so far (:meth:`ShmLinks.statistics`)."""

    sent_bytes: int
    """Payload copied into rings."""
    received_bytes: int
    """Payload read from rings (copied out, or returned as a view)."""
    backlog_bytes: int
    """Payload sent but not in a ring yet (the peer has not made room)."""
    sleeps: int
    """Receives that found nothing while spinning and slept in poll()."""


@dataclass(eq=False)
class _Pending:
    """A message not wholly in the ring yet: ``data`` holds its bytes from
    ``base`` on (a view of the caller's buffer until ``owned``)."""

    op_id: int
    chunk: int
    code: int
    nbytes: int
    data: np.ndarray
    base: int = 0
    sent: int = 0
    owned: bool = False

    def own(self) -> None:
        if not self.owned:
            self.data = self.data[self.sent - self.base:].copy()
            self.base, self.owned = self.sent, True


class _Peer:
    """One peer: its socket, our ring to it and its ring to us, and the
    positions (monotonic byte counts) of both directions."""

    def __init__(self, rank: int, pid: int, sock: socket.socket) -> None:
        self.rank, self.pid, self.sock = rank, pid, sock
        self.ring_out = self.ring_in = np.empty(0, np.uint8)
        self.in_map: mmap.mmap | None = None
        self.write = self.acked = 0          # our next position; where the peer is done
        self.backlog: deque[_Pending] = deque()
        self.wbuf, self.rbuf = bytearray(), bytearray()
        self.inbox: deque[_Record] = deque()
        self.consumed = self.ack_sent = 0    # where we are done; what we told the peer
        self.lent = 0                        # end of the piece a returned view shows
        self.stash: dict[int, deque[tuple[int, np.ndarray]]] = {}   # later op_ids'
        self.lost = ""                       # why the link broke ("" while it works)
        self.drained = False                 # nothing more to read (after ``lost``)
        self.pid_checked = 0.0


class ShmLinks:
    """One rank's links to the other ranks of its machine (see the module
    docstring). Made by :meth:`connect`; one caller at a time, though its
    own flusher thread shares its state (under its lock)."""

    def __init__(self, rank: int, world: int, peers: dict[int, _Peer], own: mmap.mmap | None,
                 ring_bytes: int) -> None:
        self.rank, self.world = rank, world
        self._peers, self._own, self._ring = peers, own, ring_bytes
        self._piece = ring_bytes // 4 // _ALIGN * _ALIGN
        self._ack_every = ring_bytes // 8
        self._lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self._flushing = self._closed = False
        self._sent = self._received = self._sleeps = 0
        self._retired = 0  # collective operations up to this op_id are over here
        # Spinning pays only while every rank has a core of its own: with
        # more ranks than cores it takes the core the sender needs.
        self._spin = _SPIN if len(peers) + 1 <= (os.cpu_count() or 1) else 0.0

    @classmethod
    def connect(cls, token: str, rank: int, world: int, *, deadline: float,
                ring_bytes: int = 8 << 20, ranks: Sequence[int] | None = None) -> ShmLinks:
        """Join the world of ``world`` ranks sharing ``token`` (a secret the
        group layer gave every rank) as ``rank``; returns once every rank
        has joined. ``ranks``: the ranks on this machine, when not all of
        them (the others are left to other links; every one of ``ranks``
        must pass the same). ``deadline`` (``time.monotonic()``) bounds the
        wait for the others: past it, :class:`~pmetal.errors.PMetalTimeoutError`."""
        local = tuple(sorted(set(range(world) if ranks is None else ranks)))
        if not 0 <= rank < world or rank not in local or not set(local) <= set(range(world)):
            raise PMetalValueError(f"rank {rank} and the ranks on this machine {list(local)} "
                                   f"must be ranks of a world of {world}")
        if not token:
            raise PMetalValueError("the shared-memory links need the group's token")
        page = mmap.ALLOCATIONGRANULARITY
        ring_bytes = max(64 << 10, -(-ring_bytes // page) * page)
        if len(local) == 1:
            return cls(rank, world, {}, None, ring_bytes)
        own, members = join(token, rank, local, ring_bytes, deadline)
        peers = {}
        for m in members:
            peer = peers[m.rank] = _Peer(m.rank, m.pid, m.sock)
            m.sock.setblocking(False)
            peer.in_map, peer.ring_in = m.ring, np.frombuffer(m.ring, np.uint8)
            index = slot(m.rank, rank, local)
            peer.ring_out = np.frombuffer(own, np.uint8, ring_bytes, index * ring_bytes)
        return cls(rank, world, peers, own, ring_bytes)

    @property
    def bytes_sent(self) -> int:
        return self._sent

    @property
    def bytes_received(self) -> int:
        return self._received

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
                        item.own()

    def release(self, op_id: int) -> None:
        """``op_id`` is over: no backlog keeps a view of the caller's data
        after this (dropped for dead peers, copied for live ones and sent by
        the flusher thread), and the regions read are acked."""
        with self._lock:
            if op_id < P2P_BASE:
                self._retired = max(self._retired, op_id)
            for peer in self._peers.values():
                self._return_lent(peer)
                for old in [o for o in peer.stash if o <= self._retired]:
                    del peer.stash[old]
                self._service(peer)
                if peer.consumed > peer.ack_sent:
                    self._ack(peer)
                for item in peer.backlog:
                    if item.op_id == op_id:
                        item.own()
            if not self._flushing and self._busy():
                self._flushing = True
                self._flusher = threading.Thread(target=self._flush_loop, daemon=True,
                                                 name=f"pmetal-shmlinks-{self.rank}")
                self._flusher.start()

    def _push(self, peer: _Peer) -> None:
        """Copy backlog into the ring while it has room, telling the peer
        piece by piece (so it reads the first while we copy the next)."""
        while peer.backlog and not peer.lost:
            item = peer.backlog[0]
            n = min(item.nbytes - item.sent, self._piece)
            # The piece's place: contiguous, so the tail of the ring may be skipped.
            size, at = _aligned(n), peer.write % self._ring
            start = peer.write + (self._ring - at if at + size > self._ring else 0)
            if start + size - peer.acked > self._ring:
                return   # no room until the peer acks
            peer.write = start + size
            if n:
                at, src = start % self._ring, item.sent - item.base
                peer.ring_out[at:at + n] = item.data[src:src + n]
                self._sent += n
            peer.wbuf += _REC.pack(_DATA, item.op_id, item.chunk, item.code, item.nbytes,
                                   start, n)
            self._flush(peer)
            if peer.lost:
                return   # the backlog went with the link
            item.sent += n
            if item.sent == item.nbytes:
                peer.backlog.popleft()

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
        ``recv`` or ``release`` (or a fresh array for a message that came
        in pieces)."""
        peer = self._peer(from_rank)
        with self._lock:
            self._check_open()
            for p in self._peers.values():
                self._return_lent(p)
            kept = peer.stash.get(op_id)
            if kept:
                chunk, data = kept.popleft()
                if _fits(out, data.dtype, data.size):
                    out[...] = data.reshape(out.shape)
                    return chunk, out
                return chunk, data
            while True:
                record = self._next(peer, deadline)
                if record[1] == op_id:
                    return record[2], self._take(peer, record, deadline, out, keep=True,
                                                 lend=True)
                if record[1] < P2P_BASE and record[1] <= self._retired:
                    # An operation already over here (it failed): dropped.
                    self._take(peer, record, deadline, None, keep=False)
                else:
                    # A later operation's, or a point-to-point message that
                    # overtook this one: copy out and keep for then.
                    data = self._take(peer, record, deadline, None, keep=True)
                    peer.stash.setdefault(record[1], deque()).append((record[2], data))

    def _take(self, peer: _Peer, first: _Record, deadline: float, out: np.ndarray | None,
              *, keep: bool, lend: bool = False) -> np.ndarray:
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
            self._received += length
            return peer.ring_in[at:at + length].view(dtype)
        dest = out if _fits(out, dtype, count) else np.empty(count if keep else 0, dtype)
        raw = dest.reshape(-1).view(np.uint8)
        done = 0
        while True:
            at = self._region(peer, start, length)
            if keep:
                raw[done:done + length] = peer.ring_in[at:at + length]
                self._received += length
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

    def _next(self, peer: _Peer, deadline: float) -> _Record:
        """The next data record from ``peer``: spin, then sleep in poll()."""
        spin_until = 0.0
        while True:
            if peer.inbox:
                return peer.inbox.popleft()
            self._service(peer)
            if peer.inbox:
                continue
            if peer.drained:
                raise PeerError(f"rank {peer.rank} is gone: {peer.lost}")
            now = time.monotonic()
            if now >= deadline:
                raise PMetalTimeoutError(f"rank {self.rank} got no message from rank "
                                         f"{peer.rank} before the deadline")
            if not spin_until:
                spin_until = now + self._spin
            elif now >= spin_until:
                if peer.pid and now - peer.pid_checked > _PID_CHECK:
                    peer.pid_checked = now
                    if not shm.pid_alive(peer.pid):
                        self._lose(peer, f"its process {peer.pid} died", drained=True)
                        continue
                self._sleeps += 1
                self._sleep([peer], min(deadline, now + _PID_CHECK))

    # --------------------------------------------------- socket servicing

    def _service(self, peer: _Peer) -> None:
        """Read what ``peer`` sent (records, acks); push backlog into room.
        Reading goes on after a write failed: the records a peer sent
        before it closed are still to be read (then ECONNRESET or EOF)."""
        while not peer.drained:
            try:
                got = peer.sock.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError as exc:
                self._lose(peer, f"its socket failed: {exc}", drained=True)
                break
            if not got:
                self._lose(peer, "it closed its link (the process exited or was killed)",
                           drained=True)
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
            if flags and not p.drained:
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

    def _busy(self) -> list[_Peer]:
        return [p for p in self._peers.values() if (p.backlog or p.wbuf) and not p.lost]

    def _flush_loop(self) -> None:
        """The flusher thread: deliver backlog left at the end of an
        operation; exits when there is none (or the links close)."""
        with self._lock:
            while (busy := self._busy()) and not self._closed:
                self._sleep(busy, time.monotonic() + _PID_CHECK)
            self._flushing = False

    def _lose(self, peer: _Peer, why: str, *, drained: bool = False) -> None:
        if not peer.lost:
            log.info("shared-memory link from rank %s to rank %s lost: %s", self.rank,
                     peer.rank, why)
            peer.lost = why
        peer.drained = peer.drained or drained
        peer.backlog.clear()
        peer.wbuf.clear()

    # ------------------------------------------------------------- others

    def statistics(self) -> ShmLinksStatistics:
        with self._lock:
            backlog = sum(i.nbytes - i.sent for p in self._peers.values() for i in p.backlog)
            return ShmLinksStatistics(self._sent, self._received, backlog, self._sleeps)

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
            while (busy := self._busy()) and time.monotonic() < end:
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
                p.lost, p.drained = p.lost or "closed", True
            _close_map(self._own)
            self._own = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _peer(self, rank: int) -> _Peer:
        peer = self._peers.get(rank)
        if peer is None:
            raise PMetalValueError(f"rank {self.rank} has no shared-memory link to rank "
                                   f"{rank} (a world of {self.world}, {len(self._peers) + 1} "
                                   "of them on this machine)")
        return peer

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"the shared-memory links of rank {self.rank} are closed")


# ------------------------------------------------------------------ helpers

def _fits(out: np.ndarray | None, dtype: np.dtype, count: int) -> bool:
    return (out is not None and out.dtype == dtype and out.size == count
            and out.flags.c_contiguous and out.flags.writeable)


def _close_map(mapping: mmap.mmap | None) -> None:
    if mapping is not None:
        with contextlib.suppress(BufferError):   # a caller's view keeps it alive
            mapping.close()
