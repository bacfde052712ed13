"""The collective data path over TCP: a full mesh of plain sockets between
the ranks of one group, one connection per pair, apart from the control
channel (ZeroMQ) and the cluster's Beats.

Why plain sockets: a blocking Python TCP round trip costs 34-39 us on the
machines pmetal targets, a ZeroMQ one through asyncio 290-480 us, and
ZeroMQ sends 64 MiB frames at a third of the rate of 1 MiB ones. A socket
receives straight into the destination array (``recv_into``), sends
straight from the caller's buffer (``sendmsg`` of a header and a view) and
costs one system call per message each way.

What it owns:

- **Forming the mesh** (:func:`connect_mesh`): every rank listens; rank
  ``i`` dials every rank below it and accepts every rank above it.
  Dialling retries until the deadline, so ranks may start in any order.
- **Authentication**: a challenge-response on each connection keyed by
  the namespace's PSK and bound to the group's tag (group name, master
  term and membership epoch) and to both ranks. A peer without the PSK,
  of another group or of another epoch of the same group is refused
  before any data flows, and both sides say which
  (:mod:`pmetal.links.tcphandshake`; a listener runs its handshakes
  side by side, so strangers cannot stall a formation).
- **Sealing**: a connection either side asked to seal (``seal=True``, the
  default; the pipeline always does, collectives by their
  ``link_encryption`` setting) carries every message encrypted and
  authenticated with AES-256-GCM under keys of that connection's
  handshake, each frame numbered (:mod:`pmetal.links.seal`). A frame that
  does not open breaks the link with
  :class:`~pmetal.errors.AuthenticationError` naming the peer, and the
  peer's connection is closed under it so it learns at once. An unsealed
  connection (both sides allowed it) carries the bytes as they are, like
  NCCL, gloo or MPI; docs/security.md says when that is sound.
- **Messages**: a 28-byte header (``_HEAD``: magic, dtype code, epoch,
  op_id, chunk, byte count) and the raw bytes; sealed, the header is a
  44-byte sealed piece and the bytes follow as sealed segments. A header
  of another epoch is a stale plan: refused with
  :class:`~pmetal.errors.ProtocolError`.
- **Sending without waiting** (the executor's "buffered send"): a send
  first writes what the kernel takes at once, without blocking; the rest
  waits in the peer's queue, still a view of the caller's buffer, and a
  writer thread per peer pushes it as the socket drains. ``detach`` and
  ``release`` copy what is still unsent out of the caller's buffer (a
  sealed message is queued as its sealed frames, in buffers of the link's
  own that are reused once written: nothing to copy). Every write happens
  under the peer's lock and never blocks, so the lock holder always knows
  exactly how many bytes have left.
- **Death**: a peer killed with SIGKILL closes its connection, and a
  receive from it raises :class:`~pmetal.errors.PeerError` at once. A peer
  that stalls (SIGSTOP, a host that vanished without closing) is caught
  by ``is_dead`` (the cluster's health verdict, checked every 50 ms while
  waiting) or by the operation's deadline.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pmetal.errors import (
    CollectiveError,
    PeerError,
    PMetalValueError,
    ProtocolError,
)
from pmetal.links import tcphandshake
from pmetal.links.seal import OVERHEAD, SEGMENT, LinkSeal, segments
from pmetal.values import host_of

__all__ = ["DTYPE_CODES", "TcpLinks", "connect_mesh", "group_tag", "listen",
           "reachable_host"]

log = logging.getLogger(__name__)

# magic, dtype code, epoch, op_id, chunk, payload bytes
_HEAD = struct.Struct("<2sHIQIQ")
_MAGIC = b"PC"
DTYPE_CODES: dict[str, int] = {
    "float16": 1, "float32": 2, "float64": 3, "int32": 4, "int64": 5, "uint16": 6,
    "int8": 7, "uint8": 8, "uint32": 9, "uint64": 10, "int16": 11, "bool": 12}
_DTYPES = {code: np.dtype(name) for name, code in DTYPE_CODES.items()}

# Point-to-point messages are numbered from here, apart from collective
# operations (only two ranks see them).
P2P_BASE = 1 << 62
_POLL_SLICE = 0.05  # how often a waiting receive looks at is_dead
_WRITE_CAP = 4 << 20  # bytes per non-blocking write: bounds the time the lock is held
_INLINE_COPY = 64 << 10  # small payloads are joined to their header in one write
_SPARES = 8  # sealing buffers kept per peer for reuse


def group_tag(name: str, term: int, epoch: int) -> bytes:
    """32 bytes naming one formation of a group; both sides of every
    connection must agree on it."""
    return hashlib.blake2b(f"{name}|{term}|{epoch}".encode(), digest_size=32,
                           person=b"pmetal-coll-tag").digest()


def collective_key(psk: bytes) -> bytes:
    """The key of the mesh handshake, derived from the namespace's PSK (a
    separate key, so the handshake's MACs reveal nothing about the PSK's
    other uses)."""
    return hashlib.blake2b(b"collective-mesh-1", key=psk[:64], digest_size=32).digest()


def reachable_host(client: Any) -> str:
    """The address a process's peers reach it on: the host of its own
    listener, else of its node's (a pmetal client's ``self_address`` and
    ``node_address``); loopback when both are wildcards."""
    for address in (client.self_address, client.node_address):
        host = host_of(address)
        if host and host not in ("*", "0.0.0.0", "::"):
            return host
    return "127.0.0.1"


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening socket for this rank's incoming connections (``port``
    0: any free port; ``getsockname()`` tells which)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CollectiveError(f"cannot listen on {host}:{port} for collective data "
                              f"({exc}); is another process using the port?") from exc
    sock.listen(64)
    return sock


# ------------------------------------------------------------------ peers

@dataclass
class _Pending:
    """A message, or what is left of it, waiting to be written."""
    op_id: int
    chunk: int
    parts: list[memoryview]
    borrowed: bool  # parts still view the caller's buffer
    spare: bytearray | None = None  # a sealing buffer to reuse once written


class _Peer:
    """One connection: its socket, its queue of unsent bytes and the writer
    thread that drains it."""

    def __init__(self, rank: int, sock: socket.socket, seal: LinkSeal | None = None) -> None:
        self.rank = rank
        self.sock = sock
        self.seal = seal
        sock.setblocking(False)
        self.lock = threading.Lock()
        # Sealing numbers frames: a message is sealed and queued under this
        # lock, so frames leave in the order of their numbers.
        self.send_lock = threading.Lock()
        self.spares: list[bytearray] = []  # sealing buffers, SEGMENT + OVERHEAD each
        self.rx_head = bytearray(_HEAD.size + OVERHEAD)  # a sealed header being read
        self.rx_segment = bytearray(SEGMENT + OVERHEAD) if seal is not None else bytearray()
        self.ready = threading.Condition(self.lock)
        self.queue: collections.deque[_Pending] = collections.deque()
        self.broken: str | None = None
        self.closed = False
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)
        self.writer = threading.Thread(target=self._drain, daemon=True,
                                       name=f"pmetal-collective-writer-{rank}")
        self.writer.start()

    # Writing. Everything below holds self.lock while it writes.

    def post(self, message: _Pending) -> None:
        with self.lock:
            if self.broken:
                raise PeerError(self.broken)
            if not self.queue:
                self._write(message)
                if not message.parts:
                    self._done(message)
                    return
            self.queue.append(message)
            self.ready.notify_all()

    def _done(self, message: _Pending) -> None:
        if message.spare is not None and len(self.spares) < _SPARES:
            self.spares.append(message.spare)

    def post_sealed(self, op_id: int, chunk: int, head: bytes, payload: memoryview) -> None:
        """Seal a message (its header, then its payload segment by
        segment, see :mod:`pmetal.links.seal`) and queue each piece as it
        is sealed, so the writer sends while the rest is sealed."""
        tx = self.seal.tx  # type: ignore[union-attr]
        with self.send_lock:
            if payload.nbytes <= _INLINE_COPY:
                out = bytearray(len(head) + OVERHEAD
                                + (payload.nbytes + OVERHEAD if payload.nbytes else 0))
                view = memoryview(out)
                tx.seal_into(head, view[:len(head) + OVERHEAD])
                if payload.nbytes:
                    tx.seal_into(payload, view[len(head) + OVERHEAD:])
                self.post(_Pending(op_id, chunk, [view], False))
                return
            sealed_head = bytearray(len(head) + OVERHEAD)
            tx.seal_into(head, sealed_head)
            first = [memoryview(sealed_head)]
            for start, end in segments(payload.nbytes):
                with self.lock:
                    spare = self.spares.pop() if self.spares else bytearray(
                        SEGMENT + OVERHEAD)
                view = memoryview(spare)[:end - start + OVERHEAD]
                tx.seal_into(payload[start:end], view)
                self.post(_Pending(op_id, chunk, [*first, view], False, spare))
                first = []

    def _write(self, message: _Pending) -> None:
        """Write what the socket takes now without blocking; trims
        ``message.parts`` to what is left."""
        parts = message.parts
        while parts:
            try:
                if len(parts) == 1 or parts[0].nbytes >= _WRITE_CAP:
                    n = self.sock.send(parts[0][:_WRITE_CAP])
                else:
                    n = self.sock.sendmsg(parts[:8])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._break(f"the connection to rank {self.rank} broke ({exc}); it exited "
                            "or its host went away")
                raise PeerError(self.broken) from exc
            while n and parts:
                head = parts[0]
                if n >= head.nbytes:
                    n -= head.nbytes
                    parts.pop(0)
                else:
                    parts[0] = head[n:]
                    n = 0

    def _drain(self) -> None:
        """The writer thread: push queued bytes as the socket drains."""
        while True:
            with self.lock:
                while not self.queue and not self.closed and not self.broken:
                    self.ready.wait()
                if self.closed or self.broken:
                    return
                try:
                    while self.queue:
                        self._write(self.queue[0])
                        if self.queue[0].parts:
                            break
                        self._done(self.queue.popleft())
                except PeerError:
                    return
                waiting = bool(self.queue)
                if not waiting:
                    self.ready.notify_all()  # flush() waits for this
            if waiting:
                try:
                    select.select([], [self.sock], [], _POLL_SLICE)
                except (OSError, ValueError):
                    return  # closed under us

    def detach(self, op_id: int, chunk: int | None) -> None:
        """Copy the unsent bytes of ``op_id``'s sends of ``chunk`` (every
        chunk when None) out of the caller's buffer."""
        with self.lock:
            for message in self.queue:
                if (message.borrowed and message.op_id == op_id
                        and (chunk is None or message.chunk == chunk)):
                    message.parts = [memoryview(bytes(p)) for p in message.parts]
                    message.borrowed = False

    def _break(self, why: str) -> None:
        if not self.broken:
            self.broken = why
        self.ready.notify_all()

    def flush(self, deadline: float) -> bool:
        """Wait until every queued byte is written (True), the connection
        breaks or ``deadline`` passes (False)."""
        with self.lock:
            while self.queue and not self.broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.ready.wait(min(left, _POLL_SLICE))
            return not self.queue

    def close(self, deadline: float) -> None:
        """Close once what was sent has left (peers still need the last
        operation's bytes) or at ``deadline``."""
        self.flush(deadline)
        with self.lock:
            self.closed = True
            self.ready.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already reset by the peer
        self.writer.join(timeout=1.0)
        self.sock.close()

    # Reading (only the executor's thread reads).

    def read_exactly(self, view: memoryview, deadline: float,
                     is_dead: Callable[[], bool], *, started: bool = False) -> None:
        """Fill ``view``. ``started``: the message's header is already read.
        Giving up in the middle of a message leaves the stream unreadable
        (the rest would be taken for a header), so the connection is then
        marked broken."""
        got, total = 0, view.nbytes
        while got < total:
            try:
                n = self.sock.recv_into(view[got:], total - got)
            except (BlockingIOError, InterruptedError):
                try:
                    self._wait_readable(deadline, is_dead)
                except (TimeoutError, PeerError) as exc:
                    if got or started:
                        with self.lock:
                            self._break(f"a message from rank {self.rank} stopped halfway "
                                        f"({exc}); this connection cannot be used again")
                    raise
                continue
            except OSError as exc:
                with self.lock:
                    self._break(f"the connection to rank {self.rank} broke ({exc}); it "
                                "exited or its host went away")
                raise PeerError(self.broken) from exc
            if n == 0:
                with self.lock:
                    self._break(f"rank {self.rank} closed its connection (it exited or was "
                                "killed)")
                raise PeerError(self.broken)
            got += n

    def read_sealed(self, view: memoryview, deadline: float, is_dead: Callable[[], bool],
                    *, what: str, started: bool = False) -> None:
        """Fill ``view`` with the opened contents of the sealed pieces that
        carry it: one piece when it is a header, else one per segment."""
        seal = self.seal
        assert seal is not None
        pieces = [(0, view.nbytes)] if not started else segments(view.nbytes)
        for start, end in pieces:
            sealed = (memoryview(self.rx_head) if not started
                      else memoryview(self.rx_segment)[:end - start + OVERHEAD])
            self.read_exactly(sealed, deadline, is_dead, started=started)
            if not seal.rx.open_into(sealed, view[start:end]):
                error = seal.refused(what)
                self.fail(str(error))
                raise error
            started = True

    def fail(self, why: str) -> None:
        """Break the connection for good and close it under the peer, so
        that it learns at once (its next receive from here ends)."""
        with self.lock:
            self._break(why)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _wait_readable(self, deadline: float, is_dead: Callable[[], bool]) -> None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no message from rank {self.rank} before the deadline")
            if self.poller.poll(min(left, _POLL_SLICE) * 1000):
                return
            if is_dead():
                raise PeerError(f"rank {self.rank} is dead (the cluster's health monitor "
                                "declared its node dead)")


# ------------------------------------------------------------------ links

class TcpLinks:
    """One rank's :class:`~pmetal.links.memory.RankLinks` over a
    full mesh of TCP connections (see the module docstring)."""

    def __init__(self, rank: int, world: int, epoch: int, peers: dict[int, _Peer], *,
                 is_dead: Callable[[int], bool] | None = None) -> None:
        self.rank = rank
        self.world = world
        self.epoch = epoch
        self._peers = peers
        self._is_dead = is_dead or (lambda _rank: False)
        self._stash: dict[tuple[int, int], collections.deque[tuple[int, np.ndarray]]] = {}
        self._head = bytearray(_HEAD.size)
        self._retired = 0  # collective operations up to this op_id are over here
        self.bytes_sent = 0
        self.bytes_received = 0

    def _peer(self, rank: int) -> _Peer:
        peer = self._peers.get(rank)
        if peer is None:
            raise PMetalValueError(f"rank {self.rank} has no link to rank {rank} in a world "
                                   f"of {self.world}")
        return peer

    def send(self, to_rank: int, op_id: int, chunk: int, data: np.ndarray) -> None:
        code = DTYPE_CODES.get(data.dtype.name)
        if code is None:
            raise PMetalValueError(f"collectives carry {', '.join(DTYPE_CODES)}, not "
                                   f"{data.dtype}")
        payload = memoryview(np.ascontiguousarray(data)).cast("B")
        head = _HEAD.pack(_MAGIC, code, self.epoch, op_id, chunk, payload.nbytes)
        peer = self._peer(to_rank)
        if peer.seal is not None:
            peer.post_sealed(op_id, chunk, head, payload)
            self.bytes_sent += payload.nbytes
            return
        if payload.nbytes <= _INLINE_COPY:
            parts, borrowed = [memoryview(head + payload.tobytes())], False
        else:
            parts, borrowed = [memoryview(head), payload], True
        peer.post(_Pending(op_id, chunk, parts, borrowed))
        self.bytes_sent += payload.nbytes

    def detach(self, op_id: int, chunk: int) -> None:
        for peer in self._peers.values():
            peer.detach(op_id, chunk)

    def release(self, op_id: int) -> None:
        for peer in self._peers.values():
            peer.detach(op_id, None)
        if op_id < P2P_BASE and op_id > self._retired:
            self._retired = op_id
            for key in [k for k in self._stash if k[1] <= op_id]:
                del self._stash[key]

    def recv(self, from_rank: int, op_id: int, deadline: float,
             out: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        stash = self._stash.get((from_rank, op_id))
        if stash:
            return stash.popleft()
        peer = self._peer(from_rank)
        is_dead = lambda: self._is_dead(from_rank)
        while True:
            if peer.broken:
                raise PeerError(peer.broken)
            if peer.seal is None:
                peer.read_exactly(memoryview(self._head), deadline, is_dead)
            else:
                peer.read_sealed(memoryview(self._head), deadline, is_dead,
                                 what="a message header")
            magic, code, epoch, got_op, chunk, nbytes = _HEAD.unpack(self._head)
            dtype = _DTYPES.get(code)
            if magic != _MAGIC or dtype is None or nbytes % dtype.itemsize:
                why = (f"rank {from_rank} sent a malformed collective header (magic "
                       f"{magic!r}, dtype code {code}, {nbytes} bytes); the connection is "
                       "closed")
                peer.fail(why)
                raise ProtocolError(why)
            if epoch != self.epoch:
                raise ProtocolError(
                    f"rank {from_rank} sent data of epoch {epoch} of the group, this rank "
                    f"is in epoch {self.epoch}: a stale plan is refused; re-form the group")
            if got_op == op_id and out is not None and out.dtype == dtype \
                    and out.nbytes == nbytes and out.flags.c_contiguous:
                data = out
            else:
                data = np.empty(nbytes // dtype.itemsize, dtype=dtype)
            if nbytes and peer.seal is None:
                peer.read_exactly(memoryview(data).cast("B"), deadline, is_dead,
                                  started=True)
            elif nbytes:
                peer.read_sealed(memoryview(data).cast("B"), deadline, is_dead,
                                 what=f"the data of message {got_op}/{chunk}", started=True)
            self.bytes_received += nbytes
            if got_op == op_id:
                return chunk, data
            if got_op >= P2P_BASE or got_op > self._retired:
                # An operation this rank has not reached yet (or a
                # point-to-point message): keep it for then.
                self._stash.setdefault((from_rank, got_op), collections.deque()).append(
                    (chunk, data))
            # Else an operation already over here (it failed): dropped.

    @property
    def sealed(self) -> dict[int, bool]:
        """Per peer rank: whether its link is sealed (encrypted and
        authenticated, :mod:`pmetal.links.seal`)."""
        return {r: p.seal is not None for r, p in self._peers.items()}

    def dead(self) -> set[int]:
        return {r for r, p in self._peers.items() if p.broken or self._is_dead(r)}

    def close(self, timeout: float = 10.0) -> None:
        """Close every connection once what was sent has been written (at
        most ``timeout`` seconds: a peer that stopped reading cannot hold
        the process)."""
        deadline = time.monotonic() + timeout
        for peer in self._peers.values():
            peer.close(deadline)


# ------------------------------------------------------------- the mesh

def connect_mesh(rank: int, addresses: Sequence[tuple[str, int]], listener: socket.socket, *,
                 key: bytes, tag: bytes, epoch: int, deadline: float,
                 is_dead: Callable[[int], bool] | None = None, seal: bool = True) -> TcpLinks:
    """Connect ``rank`` to every other rank of ``addresses`` (rank order):
    dial the ranks below, accept the ranks above on ``listener``.
    Authenticates every connection with ``key`` bound to ``tag``.
    ``seal``: this rank requires its links sealed (a link is sealed when
    either of its ranks requires it; both must allow clear text for it to
    run in clear). Raises
    :class:`~pmetal.errors.CollectiveError` when the mesh is not complete
    by ``deadline`` (naming the ranks missing), or
    :class:`~pmetal.errors.AuthenticationError` for a peer that proves
    another key or group, or a handshake altered on the way."""
    world = len(addresses)
    if not 0 <= rank < world:
        raise PMetalValueError(f"rank {rank} is not in a world of {world}")
    peers: dict[int, tcphandshake.Connection] = {}
    refusals: dict[int, str] = {}  # claimed rank -> why its connection was refused
    failure: list[BaseException] = []
    accepted = threading.Event()

    def accept_all() -> None:
        try:
            tcphandshake.accept(listener, rank, world, key, tag, deadline, peers, refusals,
                                seal=seal)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            failure.append(exc)
        finally:
            accepted.set()

    acceptor = threading.Thread(target=accept_all, daemon=True,
                                name=f"pmetal-collective-accept-{rank}")
    acceptor.start()
    try:
        for other in range(rank):
            peers[other] = tcphandshake.dial(addresses[other], rank, other, key, tag,
                                             deadline, seal=seal)
        accepted.wait(max(0.0, deadline - time.monotonic()) + 1.0)
        if failure:
            raise failure[0]
        missing = [r for r in range(world) if r != rank and r not in peers]
        if missing:
            # A rank that connected and was refused (another PSK, group or
            # epoch) is the likelier story than one that never started.
            refused = "".join(f"; a connection claiming rank {r} came but {why}"
                              for r, why in sorted(refusals.items()) if r in missing)
            raise CollectiveError(
                f"rank {rank} formed no connection with rank(s) {missing} before the "
                "deadline: those ranks did not start, or cannot reach this one "
                f"({addresses[rank][0]}:{addresses[rank][1]}), or were refused; check that "
                f"every rank runs with the same PSK and settings and that the addresses are "
                f"right{refused}")
    except BaseException:
        for connection in list(peers.values()):
            connection.close()
        raise
    return TcpLinks(rank, world, epoch,
                    {r: _Peer(r, c.sock, c.seal) for r, c in peers.items()}, is_dead=is_dead)
