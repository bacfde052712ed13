"""The client side of an authenticated connection: :class:`Channel`.

A Channel dials one :class:`~pmetal.endpoint.SecureListener`, runs the
namespace handshake, and offers one-way sends, request/response with
correlation ids and deadlines, and pipelining (``submit`` many, then
``result`` each). It re-handshakes by itself when the listener restarted and
forgot the session. Blocking methods keep the event loop off the hot path (a
blocking ZeroMQ round trip costs about half an asyncio one here); each has an
``a``-prefixed coroutine twin. Arrays for a peer on this host go through
shared memory (``pmetal.shm``), in slots reused once their request is
answered.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgpack

from pmetal import shm
from pmetal.codec import Envelope, WireLimits, decode, encode, frame_bytes
from pmetal.config import PMetalConfig
from pmetal.errors import (HandshakeError, PeerError, PMetalTimeoutError, ProtocolError,
                           RequestTimeoutError, SecurityError)
from pmetal.identity import NodeIdentity
from pmetal.ids import NodeId
from pmetal.security import NetworkNamespace, Session, client_finish, client_hello, mode_for
from pmetal.transport import Dialer
from pmetal.wire import PROTOCOL_VERSION, Accepted, ErrorReply, Message, Rejected, Welcome

__all__ = ["Channel", "ChannelStatistics", "MAX_EXPORTED", "NO_SESSION", "UNDECODABLE",
           "peek_corr", "refusal", "remaining", "wire_limits"]

log = logging.getLogger(__name__)

MAX_EXPORTED = 1024
"""Shared-memory names kept per channel (or listener) for one-way messages."""

NO_SESSION = "no session"
"""How a listener's Rejected begins when it answers a message for a session
it does not have (never a Hello): a handshake skips such a Rejected, which
answers something sent before it."""


UNDECODABLE = "the peer could not decode request"
"""How the message of a listener's ErrorReply begins when a request passed
its seal but did not decode (then the correlation id follows): the channel
raises ProtocolError for that request instead of returning the reply."""


def wire_limits(cfg: PMetalConfig, local: bool = False) -> WireLimits:
    """Wire limits; ``local``: for a peer on this host (arrays through shm)."""
    t = cfg.transport
    return WireLimits(t.max_message_bytes, t.max_envelope_bytes, t.chunk_bytes,
                      t.shm_min_bytes if local else 0)


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


@dataclass(frozen=True, slots=True)
class ChannelStatistics:
    requests: int
    replies: int
    sent: int
    handshakes: int
    dropped: int
    pending: int


class Channel:
    """The client side of one authenticated connection to a listener."""

    def __init__(self, dialer: Dialer, identity: NodeIdentity, namespace: NetworkNamespace,
                 config: PMetalConfig | None = None) -> None:
        self.config = config or PMetalConfig()
        self._dialer = dialer
        self.identity = identity
        self.namespace = namespace
        self._mode = mode_for(self.config.security)
        self._limits = wire_limits(self.config)
        self._local_limits = wire_limits(self.config, local=True)
        self.session: Session | None = None
        self._corr = itertools.count(1)
        self._replies: dict[int, Envelope] = {}
        self._waiting: set[int] = set()
        self._read_lock: asyncio.Lock | None = None
        self._aopening: asyncio.Future[NodeId] | None = None
        # Shared-memory objects of requests in flight (by corr; 0: one-way),
        # and the reusable slots that requests to a same-host peer use.
        self._exported: dict[int, list[str]] = {}
        self._pool: shm.SlotPool | None = None
        self.unsolicited: collections.deque[Envelope] = collections.deque(maxlen=10_000)
        self._counts = collections.Counter[str]()

    @property
    def address(self) -> str:
        return self._dialer.address

    @property
    def peer(self) -> NodeId | None:
        return self.session.peer if self.session else None

    def statistics(self) -> ChannelStatistics:
        c = self._counts
        return ChannelStatistics(c["requests"], c["replies"], c["sent"], c["handshakes"],
                                 c["dropped"], len(self._waiting))

    # ----------------------------------------------------------- handshake

    def open(self, timeout: float | None = None) -> NodeId:
        """Run the handshake; return the peer's node id. Raises HandshakeError
        when the peer refuses us (or we it), RequestTimeoutError on silence."""
        timeout = self.config.transport.handshake_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        state = client_hello(self.identity, self.namespace, self._mode, prove_host=True)
        self._watch_handshake(True)
        try:
            self._dialer.send(encode(state.hello, sender=self.identity.node_id), timeout)
            welcome = self._handshake_reply(Welcome, deadline)
            confirm, session = client_finish(self.identity, self.namespace, state, welcome,
                                             self._mode)
            self._dialer.send(encode(confirm, sender=self.identity.node_id),
                              remaining(deadline))
            while not self._accepted(session, self._recv_raw(deadline, "Accepted")):
                pass
        finally:
            state.discard()
            self._watch_handshake(False)
        return self._opened(session)

    def _watch_handshake(self, on: bool) -> None:
        watch = getattr(self._dialer, "watch_handshake", None)  # ZeroMQ dialers only
        if watch is not None:
            watch(on)

    async def aopen(self, timeout: float | None = None) -> NodeId:
        """``open`` for asyncio, for a channel that is not open yet: on an
        open channel it returns the peer at once. Coroutines that call it
        while a handshake is under way share that handshake: two on one
        connection would overwrite each other's state at the listener, and
        both would be refused. (A handshake whose replies are already queued
        completes without yielding to the loop, so a coroutine that asked at
        the same moment may find the channel open rather than opening.)"""
        if self._aopening is not None:
            return await asyncio.shield(self._aopening)
        if self.session is not None:
            return self.session.peer
        opening = self._aopening = asyncio.get_running_loop().create_future()
        try:
            peer = await self._ahandshake(timeout)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                opening.cancel()
            else:
                opening.set_exception(exc)
                opening.exception()  # retrieved: no warning when nobody shared it
            raise
        else:
            opening.set_result(peer)
            return peer
        finally:
            self._aopening = None

    async def _ahandshake(self, timeout: float | None) -> NodeId:
        timeout = self.config.transport.handshake_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        state = client_hello(self.identity, self.namespace, self._mode, prove_host=True)
        self._watch_handshake(True)
        try:
            await self._dialer.asend(encode(state.hello, sender=self.identity.node_id), timeout)
            welcome = await self._ahandshake_reply(Welcome, deadline)
            confirm, session = client_finish(self.identity, self.namespace, state, welcome,
                                             self._mode)
            await self._dialer.asend(encode(confirm, sender=self.identity.node_id),
                                     remaining(deadline))
            while not self._accepted(session, await self._arecv_raw(deadline, "Accepted")):
                pass
        finally:
            state.discard()
            self._watch_handshake(False)
        return self._opened(session)

    def _accepted(self, session: Session, frames: list[Any]) -> bool:
        """Whether ``frames`` are the listener's sealed Accepted for the new
        ``session``; raises HandshakeError when the listener refused us.
        Anything else (a stray message) is skipped."""
        try:
            env = decode(session.open(frames), limits=self._limits)
        except (SecurityError, ProtocolError):
            plain = self._decode_unsealed(frames)
            if (plain is not None and isinstance(plain.body, Rejected)
                    and not plain.body.reason.startswith(NO_SESSION)):
                raise HandshakeError(f"{self.address} refused us: {plain.body.reason}")
            return False
        return isinstance(env.body, Accepted)

    def _opened(self, session: Session) -> NodeId:
        self.session = session
        self._counts["handshakes"] += 1
        return session.peer

    def _decode_unsealed(self, frames: list[Any]) -> Envelope | None:
        """An unsealed message (handshake replies, a listener's Rejected);
        None, counted as dropped, when it does not decode: a garbled or
        duplicated message is never taken for a refusal. Unsealed messages
        can only come from a holder of the namespace keys, since the
        transport's CURVE handshake admits nobody else."""
        try:
            return decode(frames, limits=self._limits)
        except ProtocolError as exc:
            self._counts["dropped"] += 1
            log.warning("dropped an undecodable message from %s: %s", self.address, exc)
            return None

    def _check_handshake_reply(self, frames: list[Any], want: type) -> Any:
        env = self._decode_unsealed(frames)
        if env is None:
            version = _peek_version(frames)
            if version is not None and version != PROTOCOL_VERSION:
                raise HandshakeError(
                    f"{self.address} speaks pmetal protocol version {version}, this process "
                    f"{PROTOCOL_VERSION}; install the same pmetal version on every node")
            return None
        if isinstance(env.body, Rejected):
            if env.body.reason.startswith(NO_SESSION):
                return None   # answers a message of the session that ended
            raise HandshakeError(f"{self.address} refused us: {env.body.reason}")
        return env.body if isinstance(env.body, want) else None

    def _handshake_reply(self, want: type, deadline: float) -> Any:
        while True:
            body = self._check_handshake_reply(self._recv_raw(deadline, want.__name__), want)
            if body is not None:
                return body

    async def _ahandshake_reply(self, want: type, deadline: float) -> Any:
        while True:
            body = self._check_handshake_reply(await self._arecv_raw(deadline, want.__name__),
                                               want)
            if body is not None:
                return body

    def _recv_raw(self, deadline: float, what: str) -> list[Any]:
        try:
            return self._dialer.recv(remaining(deadline))
        except PMetalTimeoutError as exc:
            raise self._silent(what) from exc

    async def _arecv_raw(self, deadline: float, what: str) -> list[Any]:
        try:
            return await self._dialer.arecv(remaining(deadline))
        except PMetalTimeoutError as exc:
            raise self._silent(what) from exc

    def _silent(self, what: str) -> HandshakeError | RequestTimeoutError:
        refused = getattr(self._dialer, "refused", None)
        if refused is not None and refused():
            # libzmq retries a refused CURVE handshake quietly; its monitor
            # is the only sign that the listener has other namespace keys.
            return HandshakeError(
                f"{self.address} refused the transport handshake: it belongs to another "
                f"namespace or has another PSK (check PMETAL_PSK and security.namespace)")
        return RequestTimeoutError(f"no {what} from {self.address} during the handshake; "
                                   f"is a pmetal node listening there?")

    # ----------------------------------------------------- sending, replies

    def _send_sealed(self, body: Message, corr: int, term: int | None,
                     timeout: float | None) -> None:
        session = self.session
        if session is None:
            self.open()
            session = self.session
            assert session is not None
        if session.local:
            if corr and self._pool is None:
                self._pool = shm.SlotPool(reader=session.peer_pid)
            exported = shm.Exports(session.peer_pid, self._pool if corr else None)
            frames = encode(body, corr=corr, term=term, sender=self.identity.node_id,
                            limits=self._local_limits, oob=exported)
            if exported:
                names = self._exported.setdefault(corr, [])
                names.extend(exported)
                if corr == 0 and len(names) > MAX_EXPORTED:
                    # One-way messages get no answer to release them by; their
                    # receivers unlink them. Keep only the newest names.
                    del names[:-MAX_EXPORTED]
        else:
            frames = encode(body, corr=corr, term=term, sender=self.identity.node_id,
                            limits=self._limits)
        if len(frames) == 1:  # the common small message: one part, no streaming
            self._dialer.send(session.seal(frames), timeout)
            return
        for part in session.iter_parts(frames):
            self._dialer.send(part, timeout)

    async def _asend_sealed(self, body: Message, corr: int, term: int | None,
                            timeout: float | None) -> None:
        if self.session is None:
            await self.aopen()
        assert self.session is not None
        session = self.session
        exported = shm.Exports(session.peer_pid)
        frames = encode(body, corr=corr, term=term, sender=self.identity.node_id,
                        limits=self._local_limits if session.local else self._limits,
                        oob=exported if session.local else None)
        if exported:
            self._exported.setdefault(corr, []).extend(exported)
        for part in session.iter_parts(frames):
            await self._dialer.asend(part, timeout)

    def send(self, body: Message, *, term: int | None = None,
             timeout: float | None = None) -> None:
        """One-way message (no reply expected)."""
        self._send_sealed(body, 0, term, timeout)
        self._counts["sent"] += 1

    async def asend(self, body: Message, *, term: int | None = None,
                    timeout: float | None = None) -> None:
        await self._asend_sealed(body, 0, term, timeout)
        self._counts["sent"] += 1

    def submit(self, body: Message, *, term: int | None = None,
               timeout: float | None = None) -> int:
        """Send a request without waiting; returns its correlation id."""
        corr = next(self._corr)
        self._send_sealed(body, corr, term, timeout)
        self._waiting.add(corr)
        self._counts["requests"] += 1
        return corr

    async def asubmit(self, body: Message, *, term: int | None = None,
                      timeout: float | None = None) -> int:
        corr = next(self._corr)
        await self._asend_sealed(body, corr, term, timeout)
        self._waiting.add(corr)
        self._counts["requests"] += 1
        return corr

    def result(self, corr: int, timeout: float | None = None) -> Envelope:
        """The reply to request ``corr``; raises RequestTimeoutError."""
        timeout = self.config.transport.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while corr not in self._replies:
            try:
                frames = self._dialer.recv(max(0.0, deadline - time.monotonic()))
            except PMetalTimeoutError as exc:
                self._release(corr, answered=False)
                raise RequestTimeoutError(f"no reply from {self.address} within "
                                          f"{timeout:.3g} s") from exc
            self._file(frames)
        self._waiting.discard(corr)
        self._release(corr)
        return _checked(self._replies.pop(corr))

    async def aresult(self, corr: int, timeout: float | None = None) -> Envelope:
        timeout = self.config.transport.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self._read_lock is None:
            self._read_lock = asyncio.Lock()
        while corr not in self._replies:
            # One reader at a time: a reader files every reply it gets, and
            # the others find theirs in _replies when they take the lock.
            try:
                async with asyncio.timeout(remaining(deadline)):
                    async with self._read_lock:
                        if corr in self._replies:
                            break
                        frames = await self._dialer.arecv(remaining(deadline))
            except (PMetalTimeoutError, TimeoutError) as exc:
                self._release(corr, answered=False)
                raise RequestTimeoutError(f"no reply from {self.address} within "
                                          f"{timeout:.3g} s") from exc
            self._file(frames)
        self._waiting.discard(corr)
        self._release(corr)
        return _checked(self._replies.pop(corr))

    def request(self, body: Message, *, term: int | None = None,
                timeout: float | None = None) -> Envelope:
        """Send ``body`` and wait for its reply."""
        corr = next(self._corr)
        self._send_sealed(body, corr, term, timeout)
        self._waiting.add(corr)
        self._counts["requests"] += 1
        return self.result(corr, timeout)

    async def arequest(self, body: Message, *, term: int | None = None,
                       timeout: float | None = None) -> Envelope:
        return await self.aresult(await self.asubmit(body, term=term, timeout=timeout), timeout)

    def pump(self, timeout: float | None = 0.0) -> None:
        """Receive one message (waiting up to ``timeout``) and file it as a
        reply or as unsolicited; raises PMetalTimeoutError when none came."""
        self._file(self._dialer.recv(timeout))

    def reserve(self, count: int) -> list[int]:
        """Correlation ids for replies that answer one message sent with
        :meth:`send` (a batch whose parts are answered one by one)."""
        corrs = [next(self._corr) for _ in range(count)]
        self._waiting.update(corrs)
        self._counts["requests"] += count
        return corrs

    def pending(self) -> int:
        """Requests sent whose replies have not been taken."""
        return len(self._waiting)

    def arrived(self) -> list[int]:
        """Correlation ids whose replies have arrived and not been taken."""
        return list(self._replies)

    def take(self, corr: int, *, check: bool = True) -> Envelope | None:
        """The reply to ``corr`` if it has arrived (it is then forgotten).
        Raises ProtocolError when the listener could not decode the request
        (as :meth:`result` does); with ``check=False`` that refusal is
        returned as the ErrorReply it is (for a caller settling many
        replies, which must not stop at one)."""
        env = self._replies.pop(corr, None)
        if env is not None:
            self._waiting.discard(corr)
            self._release(corr)
            return _checked(env) if check else env
        return env

    def forget(self, corrs: list[int]) -> None:
        """Stop waiting for replies to ``corrs`` (ids :meth:`reserve`\\ d for
        replies that will not come: a stream's unused item ids); a reply
        that comes anyway is filed as unsolicited."""
        for corr in corrs:
            self._waiting.discard(corr)
            self._replies.pop(corr, None)

    def abandon(self) -> list[int]:
        """Forget every pending request (the peer died); returns their ids."""
        lost = list(self._waiting)
        self._waiting.clear()
        for corr in list(self._exported):
            self._release(corr, answered=False)
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        return lost

    def _release(self, corr: int, answered: bool = True) -> None:
        """Free the shared memory of request ``corr``. Answered: its one-shot
        objects were mapped already and its slots may be reused. Not
        answered: unlink everything, the receiver may still read it."""
        for name in self._exported.pop(corr, ()):
            shm.unlink(name)
        if self._pool is not None:
            if answered:
                self._pool.release(corr)
            else:
                self._pool.retire(corr)

    def _file(self, frames: list[Any]) -> None:
        """Verify one received message and file it as a reply or unsolicited."""
        session = self.session
        if session is None:
            self._counts["dropped"] += 1
            return
        try:
            opened = session.open_part(frames)
            if opened is None:  # a streamed message still lacks segments
                return
            env = decode(opened, allow_pickle=True, oob=shm.READER if session.local else None,
                         limits=self._limits)
        except Exception as exc:  # noqa: BLE001 - SecurityError, ProtocolError or a bug of ours
            # A duplicated, garbled or forged message is dropped: only a
            # listener's well-formed Rejected ends the session.
            try:
                unsealed: Envelope | None = decode(frames, limits=self._limits)
            except Exception:  # noqa: BLE001 - not a Rejected either
                unsealed = None
            if unsealed is not None and isinstance(unsealed.body, Rejected):
                # The listener forgot us (it restarted): the next send re-handshakes.
                self.session = None
                self._waiting.clear()
                raise PeerError(f"{self.address} lost our session ({unsealed.body.reason}); "
                                f"pending requests are void, retry them") from exc
            self._counts["dropped"] += 1
            log.warning("dropped a message from %s: %s", self.address, exc)
            return
        if env.corr in self._waiting:
            self._replies[env.corr] = env
            self._counts["replies"] += 1
        else:
            self.unsolicited.append(env)

    def close(self) -> None:
        self._dialer.close()
        for corr in list(self._exported):
            self._release(corr, answered=False)
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def _peek_version(frames: list[Any]) -> int | None:
    """The protocol version of an undecodable message, when it has one."""
    try:
        head = msgpack.unpackb(frame_bytes(frames[0]), raw=False)
        return head[0] if isinstance(head, list) and head and type(head[0]) is int else None
    except Exception:  # garbage: no version to report
        return None


def refusal(body: Message) -> ProtocolError | None:
    """The ProtocolError a listener's refusal of an undecodable request
    stands for; None for any other reply."""
    if type(body) is ErrorReply and body.error_type == "ProtocolError" \
            and body.message.startswith(UNDECODABLE):
        return ProtocolError(body.message)
    return None


def _checked(env: Envelope) -> Envelope:
    """``env``, or ProtocolError when it is a listener's refusal of a
    request it could not decode (only a session member can seal one)."""
    if type(env.body) is ErrorReply:
        error = refusal(env.body)
        if error is not None:
            raise error
    return env


def peek_corr(frames: list[Any]) -> int:
    """The correlation id of a message that does not decode, read from its
    envelope header alone (the body is never unpacked); 0 when unreadable."""
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(frame_bytes(frames[0])) + 1)
        unpacker.feed(frame_bytes(frames[0]))
        if unpacker.read_array_header() != 6:
            return 0
        unpacker.skip()   # version
        unpacker.skip()   # kind
        corr = unpacker.unpack()
    except Exception:  # noqa: BLE001 - garbage: no id to answer to
        return 0
    return corr if type(corr) is int and 0 < corr < 1 << 64 else 0
