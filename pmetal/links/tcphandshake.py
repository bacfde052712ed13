"""The handshake that opens every collective TCP connection (see
:mod:`pmetal.links.tcplinks`): who dials, what each side proves, how the
two agree on sealing the link, and how a listener keeps strangers from
stalling a formation.

A connection from rank ``hi`` to rank ``lo`` (the higher rank dials):

1. ``hi`` sends ``HELLO``: magic, its seal flag, its rank, ``lo``, the
   group's tag and a random nonce;
2. ``lo`` checks the magic, the tag and the ranks, then answers
   (``REPLY``) with its own seal flag, its nonce and an HMAC (``"A"``)
   over the tag, both ranks, both nonces and both flags, keyed by the
   namespace's collective key; or with 16 zero bytes, ``REFUSED`` and a
   reason;
3. ``hi`` checks the proof and answers with its own (``"D"``), or with
   ``REFUSED`` and a reason; ``lo`` checks it.

Neither side sends data before both proofs hold. A seal flag says "this
side requires the link sealed"; the link is sealed when either flag is
set (:mod:`pmetal.links.seal`, keys derived from the same transcript).
Both flags are inside both proofs, so a machine in the middle that clears
a flag (to read the data) makes a proof fail, and the side that finds it
says so ("altered in transit") rather than blaming the PSK.

The listener runs every handshake in progress at once, each with its own
HANDSHAKE_TIMEOUT: a stranger that connects and says nothing (or says half
a hello) holds one slot of MAX_PENDING for at most that long, and the
ranks' own connections go through beside it. (Before, handshakes ran one
at a time: each silent connection stalled the formation for 2 s.)
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field

from pmetal.errors import AuthenticationError, CollectiveError
from pmetal.links.seal import LinkSeal, derive

log = logging.getLogger(__name__)

# magic, seal flag, from rank, to rank, group tag, nonce
HELLO = struct.Struct("<7sBII32s16s")
HELLO_MAGIC = b"PMCOLL2"
_OLD_MAGIC = b"PMCOLL"  # another version of this handshake
REPLY = struct.Struct("<B15s32s")  # seal flag, nonce, proof
SEAL = 1  # the flag's bit: this side requires the link sealed
REFUSED = b"\x00" * 32  # a proof of all zeros: "refused", followed by a reason
HANDSHAKE_TIMEOUT = 2.0  # a connection's whole handshake, on the listening side
MAX_PENDING = 64  # handshakes in progress at once; a newer one drops the oldest
_SELECT_SLICE = 0.2


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def proof(key: bytes, role: bytes, tag: bytes, low: int, high: int, nonces: bytes,
          flags: bytes) -> bytes:
    """The HMAC one side sends: ``role`` (``"A"`` the listener's, ``"D"``
    the dialler's) over everything either side said."""
    return hmac.new(key, role + tag + struct.pack("<II", low, high) + nonces + flags,
                    hashlib.sha256).digest()


def _flag(sealed: bool) -> int:
    return SEAL if sealed else 0


def _flipped(flags: bytes) -> list[bytes]:
    """``flags`` (dialler's, listener's) with one side's seal flag changed:
    what a machine in the middle that rewrote one would make of them."""
    d, lis = flags
    return [bytes([d ^ SEAL, lis]), bytes([d, lis ^ SEAL])]


def _altered(key: bytes, role: bytes, tag: bytes, low: int, high: int, nonces: bytes,
             flags: bytes, got: bytes) -> bool:
    """Whether ``got`` is the right proof of a transcript whose seal flag was
    changed on the way: the peer has the PSK, someone between us does not."""
    return any(hmac.compare_digest(got, proof(key, role, tag, low, high, nonces, f))
               for f in _flipped(flags))


_ALTERED = ("the handshake was altered in transit (a seal flag changed on the way: a "
            "machine between the ranks rewrote it, as one that wants the link in clear would)")


@dataclass
class Connection:
    """A connection whose handshake succeeded: its socket, and its seal
    (None: the link runs in clear, as both sides allowed)."""

    sock: socket.socket
    seal: LinkSeal | None

    def close(self) -> None:
        self.sock.close()


def _seal(key: bytes, tag: bytes, low: int, high: int, nonces: bytes, flags: bytes,
          dialler: bool) -> LinkSeal | None:
    if not any(f & SEAL for f in flags):
        return None
    down, up = derive(key, tag, low, high, nonces, flags)  # high -> low, low -> high
    return LinkSeal(low, down, up) if dialler else LinkSeal(high, up, down)


def dial(address: tuple[str, int], rank: int, other: int, key: bytes, tag: bytes,
         deadline: float, *, seal: bool = True) -> Connection:
    """Connect to ``other`` (a lower rank), retrying until ``deadline``.
    ``seal``: this side requires the link sealed (it is sealed when
    either side requires it)."""
    delay = 0.01
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveError(
                f"rank {rank} could not connect to rank {other} at {address[0]}:"
                f"{address[1]} before the deadline; is that rank running, and is the "
                "address right?")
        try:
            sock = socket.create_connection(address, timeout=min(left, 2.0))
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT,
                                 errno.EHOSTUNREACH, errno.ENETUNREACH, None):
                raise CollectiveError(f"rank {rank} cannot connect to rank {other} at "
                                      f"{address[0]}:{address[1]}: {exc}") from exc
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.2)
            continue
        try:
            tune(sock)
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            nonce = os.urandom(16)
            mine = _flag(seal)
            sock.sendall(HELLO.pack(HELLO_MAGIC, mine, rank, other, tag, nonce))
            reply = _read(sock, REPLY.size)
            theirs, their_nonce, their_proof = REPLY.unpack(reply)
            if their_proof == REFUSED:
                reason = _read_reason(sock)
                raise AuthenticationError(f"rank {other} refused rank {rank}: {reason}")
            nonces, flags = nonce + their_nonce, bytes([mine, theirs])
            if not hmac.compare_digest(their_proof,
                                       proof(key, b"A", tag, other, rank, nonces, flags)):
                if _altered(key, b"A", tag, other, rank, nonces, flags, their_proof):
                    _send_refusal(sock, f"rank {rank} found that {_ALTERED}")
                    raise AuthenticationError(
                        f"rank {rank}'s connection to rank {other} at {address[0]}:"
                        f"{address[1]}: {_ALTERED}; the connection is refused")
                # Tell the listener why (it logs it and names it if its
                # formation times out), then fail here at once.
                _send_refusal(sock, f"rank {rank} found that this rank could not prove "
                                    "its PSK: the two ranks have different PSKs")
                raise AuthenticationError(
                    f"rank {other} at {address[0]}:{address[1]} could not prove the "
                    "namespace's PSK for this group: another cluster, another PSK, or "
                    "another formation of the group listens there")
            sock.sendall(proof(key, b"D", tag, other, rank, nonces, flags))
            sock.settimeout(None)
            return Connection(sock, _seal(key, tag, other, rank, nonces, flags, True))
        except (OSError, EOFError) as exc:
            sock.close()
            raise CollectiveError(f"rank {rank}'s handshake with rank {other} at "
                                  f"{address[0]}:{address[1]} failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise


@dataclass
class _Handshake:
    """One connection being accepted: what it must still send, and by when."""

    sock: socket.socket
    deadline: float
    need: int = HELLO.size
    buffer: bytearray = field(default_factory=bytearray)
    rank: int | None = None     # the rank it claims, once its hello is in
    nonces: bytes = b""
    flags: bytes = b""          # the dialler's and this side's seal flags


class _Acceptor:
    """The listening side of every handshake of one formation."""

    def __init__(self, listener: socket.socket, rank: int, world: int, key: bytes, tag: bytes,
                 peers: dict[int, Connection], refusals: dict[int, str], seal: bool) -> None:
        self.listener, self.rank, self.key, self.tag = listener, rank, key, tag
        self.flag = _flag(seal)
        self.peers, self.refusals = peers, refusals
        self.expected = set(range(rank + 1, world))
        self.pending: dict[socket.socket, _Handshake] = {}
        self.selector = selectors.DefaultSelector()

    def run(self, deadline: float) -> None:
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ)
        try:
            while self.expected:
                now = time.monotonic()
                if now >= deadline:
                    return
                self._expire(now)
                wake = min([deadline, now + _SELECT_SLICE,
                            *(h.deadline for h in self.pending.values())])
                for ready, _events in self.selector.select(max(0.0, wake - now)):
                    if ready.fileobj is self.listener:
                        self._take_new()
                    elif ready.fileobj in self.pending:
                        self._advance(self.pending[ready.fileobj])
        finally:
            for sock in list(self.pending):
                self._drop(sock)
            self.selector.close()
            self.listener.setblocking(True)

    def _take_new(self) -> None:
        while True:
            try:
                sock, _addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the others go on
                log.warning("accepting a collective connection failed: %s", exc)
                return
            if len(self.pending) >= MAX_PENDING:
                oldest = min(self.pending.values(), key=lambda h: h.deadline)
                log.warning("%d collective handshakes in progress: dropped the oldest",
                            MAX_PENDING)
                self._drop(oldest.sock)
            try:
                tune(sock)
                sock.setblocking(False)
            except OSError:
                sock.close()
                continue
            self.pending[sock] = _Handshake(sock, time.monotonic() + HANDSHAKE_TIMEOUT)
            self.selector.register(sock, selectors.EVENT_READ)

    def _expire(self, now: float) -> None:
        for hs in [h for h in self.pending.values() if h.deadline <= now]:
            claimed = "" if hs.rank is None else f" claiming rank {hs.rank}"
            log.warning("a collective connection%s did not finish its handshake within "
                        "%.0f s: dropped", claimed, HANDSHAKE_TIMEOUT)
            self._drop(hs.sock)

    def _drop(self, sock: socket.socket) -> None:
        self.pending.pop(sock, None)
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _advance(self, hs: _Handshake) -> None:
        try:
            part = hs.sock.recv(hs.need - len(hs.buffer))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("a collective connection failed during its handshake: %s", exc)
            self._drop(hs.sock)
            return
        if not part:
            log.warning("a collective connection failed during its handshake: the peer "
                        "closed it")
            self._drop(hs.sock)
            return
        hs.buffer += part
        if len(hs.buffer) < hs.need:
            return
        if hs.rank is None:
            self._hello(hs)
        else:
            self._finish(hs)

    def _refuse(self, hs: _Handshake, claimed: int, reason: str) -> None:
        _send_refusal(hs.sock, reason, prefix=bytes(16))
        log.warning("refused a collective connection: %s", reason)
        self.refusals[claimed] = f"was refused: {reason}"
        self._drop(hs.sock)

    def _hello(self, hs: _Handshake) -> None:
        magic, theirs, their_rank, to_rank, their_tag, their_nonce = HELLO.unpack(
            bytes(hs.buffer))
        if magic != HELLO_MAGIC:
            self._refuse(hs, their_rank, "not a pmetal collective connection" if not
                         magic.startswith(_OLD_MAGIC) else
                         f"it speaks another version of the collective handshake ({magic!r}, "
                         f"this rank {HELLO_MAGIC!r}): run one pmetal version on every rank")
            return
        if their_tag != self.tag:
            self._refuse(hs, their_rank, "another group, or another formation (term or "
                                         "epoch) of this group: a stale plan is refused; "
                                         "re-form the group")
            return
        if to_rank != self.rank or their_rank not in self.expected:
            self._refuse(hs, their_rank, f"it claims rank {their_rank} dialling rank "
                                         f"{to_rank}; this is rank {self.rank} waiting for "
                                         f"{sorted(self.expected)}")
            return
        nonce = os.urandom(15)
        hs.nonces = their_nonce + nonce
        hs.flags = bytes([theirs, self.flag])
        hs.rank = their_rank
        hs.buffer.clear()
        hs.need = 32
        try:  # 48 bytes into a fresh connection's empty buffer: taken at once
            sent = hs.sock.send(REPLY.pack(self.flag, nonce, proof(
                self.key, b"A", self.tag, self.rank, their_rank, hs.nonces, hs.flags)))
        except OSError as exc:
            sent = 0
            log.warning("a collective connection failed during its handshake: %s", exc)
        if sent != 48:
            self._drop(hs.sock)

    def _finish(self, hs: _Handshake) -> None:
        their_rank = hs.rank
        assert their_rank is not None
        answer = bytes(hs.buffer)
        if answer == REFUSED:
            why = _read_reason(hs.sock)
            log.warning("a collective connection claiming rank %s refused this rank: %s",
                        their_rank, why)
            self.refusals[their_rank] = f"refused this rank ({why})"
            self._drop(hs.sock)
            return
        if not hmac.compare_digest(answer, proof(self.key, b"D", self.tag, self.rank,
                                                 their_rank, hs.nonces, hs.flags)):
            if _altered(self.key, b"D", self.tag, self.rank, their_rank, hs.nonces, hs.flags,
                        answer):
                log.warning("refused a collective connection claiming rank %s: %s",
                            their_rank, _ALTERED)
                self.refusals[their_rank] = _ALTERED
                self._drop(hs.sock)
                return
            log.warning("refused a collective connection claiming rank %s: it could not "
                        "prove the namespace's PSK", their_rank)
            self.refusals[their_rank] = "could not prove the namespace's PSK"
            self._drop(hs.sock)
            return
        if their_rank not in self.expected:  # another connection proved it first
            self._drop(hs.sock)
            return
        self.pending.pop(hs.sock)
        self.selector.unregister(hs.sock)
        hs.sock.setblocking(True)
        self.peers[their_rank] = Connection(hs.sock, _seal(
            self.key, self.tag, self.rank, their_rank, hs.nonces, hs.flags, False))
        self.expected.discard(their_rank)


def accept(listener: socket.socket, rank: int, world: int, key: bytes, tag: bytes,
           deadline: float, peers: dict[int, Connection],
           refusals: dict[int, str], *, seal: bool = True) -> None:
    """Accept every rank above ``rank`` into ``peers``, handshakes running
    side by side; a connection that fails its handshake is refused with
    its reason (noted in ``refusals`` by the rank it claims) and does not
    count. The formation goes on: a stranger's connection must not be able
    to end it, nor to stall it. Returns when every rank is in or at
    ``deadline``. ``seal``: this side requires every link sealed (see
    :func:`dial`)."""
    _Acceptor(listener, rank, world, key, tag, peers, refusals, seal).run(deadline)


def _read(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise EOFError("the peer closed the connection during the handshake")
        data += part
    return bytes(data)


def _send_refusal(sock: socket.socket, reason: str, prefix: bytes = b"") -> None:
    """Best effort: the peer may already be gone."""
    try:
        sock.sendall(prefix + REFUSED + reason.encode()[:200])
    except OSError:
        pass


def _read_reason(sock: socket.socket) -> str:
    """The reason after a refusal. On a non-blocking socket (the listener's
    side) only what has arrived: it comes in the same segment as the
    refusal, and nothing waits on a peer that sends none."""
    try:
        return sock.recv(256).decode(errors="replace") or "no reason given"
    except OSError:  # BlockingIOError included
        return "no reason given"
