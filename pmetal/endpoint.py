"""Authenticated messaging over a transport: the layer actors talk through.

* :class:`SecureListener` (server role, one per process) admits peers only
  through the namespace handshake and delivers nothing else: a message from
  a peer without a session, with a bad seal, a replayed sequence number or a
  malformed envelope is dropped, logged and counted, and the listener keeps
  serving everyone else.
* :class:`Channel` (client role) dials one listener, runs the handshake, and
  offers one-way sends, request/response with correlation ids and deadlines,
  and pipelining (``submit`` many, then ``result`` each). It re-handshakes by
  itself when the listener restarted and forgot the session.
* :class:`Server` runs a handler for a listener in a thread of its own.

Blocking methods keep the event loop off the hot path (a blocking ZeroMQ
round trip costs about half an asyncio one here); each has an ``a``-prefixed
coroutine twin.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
import traceback
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from pmetal import shm
from pmetal.config import PMetalConfig
from pmetal.errors import (AuthenticationError, ClosedError, HandshakeError, PeerError,
                           PMetalTimeoutError, ProtocolError, RequestTimeoutError,
                           SecurityError, TransportError)
from pmetal.identity import NodeIdentity
from pmetal.ids import NodeId
from pmetal.security import (NetworkNamespace, ServerHandshake, Session, client_finish,
                             client_hello, mode_for, server_finish, server_welcome)
from pmetal.transport import Dialer, Listener
from pmetal.codec import Envelope, WireLimits, decode, encode, frame_bytes
from pmetal.wire import (PROTOCOL_VERSION, Accepted, Confirm, ErrorReply, Hello, Message, Rejected,
                         Welcome)

__all__ = [
    "Channel",
    "ChannelStatistics",
    "Incoming",
    "ListenerStatistics",
    "SecureListener",
    "Server",
]

log = logging.getLogger(__name__)
_tuple_new = tuple.__new__   # builds an Incoming without its Python-level __new__

_MAX_EXPORTED = 1024
_MAX_UNAUTHENTICATED = 4096


def _limits(cfg: PMetalConfig, local: bool = False) -> WireLimits:
    """Wire limits; ``local``: for a peer on this host (arrays through shm)."""
    t = cfg.transport
    return WireLimits(t.max_message_bytes, t.max_envelope_bytes, t.chunk_bytes,
                      t.shm_min_bytes if local else 0)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Incoming(typing.NamedTuple):
    """An authenticated message received by a :class:`SecureListener`."""

    route: bytes
    peer: NodeId
    envelope: Envelope

    @property
    def body(self) -> Message:
        return self.envelope.body


@dataclass(frozen=True)
class ListenerStatistics:
    received: int
    sent: int
    sessions: int
    handshakes: int
    refused_handshakes: int
    dropped_unauthenticated: int
    dropped_malformed: int
    dropped_auth_failures: int


class SecureListener:
    """A transport listener that only delivers authenticated messages."""

    def __init__(self, listener: Listener, identity: NodeIdentity, namespace: NetworkNamespace,
                 config: PMetalConfig | None = None) -> None:
        self.config = config or PMetalConfig()
        self._listener = listener
        self.identity = identity
        self.namespace = namespace
        self._mode = mode_for(self.config.security)
        self._limits = _limits(self.config)
        self._local_limits = _limits(self.config, local=True)
        self._sessions: collections.OrderedDict[bytes, Session] = collections.OrderedDict()
        self._pending: dict[bytes, tuple[float, ServerHandshake]] = {}
        self._counts = collections.Counter[str]()
        # Shared-memory objects made for replies; unlinked at close (or when
        # the list grows past its cap), in case their receiver never maps them.
        self._exported: collections.deque[str] = collections.deque()

    @property
    def address(self) -> str:
        return self._listener.address

    def statistics(self) -> ListenerStatistics:
        c = self._counts
        return ListenerStatistics(c["received"], c["sent"], len(self._sessions), c["handshakes"],
                                  c["refused_handshakes"], c["unauthenticated"], c["malformed"],
                                  c["auth_failures"])

    def session(self, route: bytes) -> Session | None:
        return self._sessions.get(route)

    # ----------------------------------------------------------- receiving

    def recv(self, timeout: float | None = None) -> Incoming:
        """The next authenticated message; handshakes are served on the way."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            route, frames = self._listener.recv(
                None if deadline is None else max(0.0, deadline - time.monotonic()))
            incoming, reply = self._accept(route, frames)
            if reply is not None:
                self._send_raw(route, reply)
            if incoming is not None:
                return incoming

    async def arecv(self, timeout: float | None = None) -> Incoming:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            route, frames = await self._listener.arecv(_remaining(deadline))
            incoming, reply = self._accept(route, frames)
            if reply is not None:
                await self._asend_raw(route, reply)
            if incoming is not None:
                return incoming

    def _accept(self, route: bytes, frames: list[Any]) -> tuple[Incoming | None, list[Any] | None]:
        """Classify one raw message: (delivered message, frames to answer with)."""
        session = self._sessions.get(route)
        if session is not None:
            try:
                opened = session.open_part(frames)
                if opened is None:  # a streamed message still lacks segments
                    return None, None
                env = decode(opened, allow_pickle=True, allow_shm=session.local,
                             limits=self._limits)
            except AuthenticationError as exc:
                restart = self._unsealed_handshake(route, frames)
                if restart is not None:
                    # The peer re-opens its channel. The old session stays
                    # until the new handshake completes, so a forged Hello
                    # cannot end it.
                    return None, self._handshake(route, restart)
                self._counts["auth_failures"] += 1
                log.warning("dropped a message from %s: %s", session.peer, exc)
                return None, None
            except ProtocolError as exc:
                self._counts["malformed"] += 1
                log.warning("dropped a malformed message from %s: %s", session.peer, exc)
                return None, None
            self._sessions.move_to_end(route)
            self._counts["received"] += 1
            return _tuple_new(Incoming, (route, session.peer, env)), None
        if len(frames) != 1 or len(frame_bytes(frames[0])) > _MAX_UNAUTHENTICATED:
            # Handshake messages are one small frame; nothing bigger is even
            # decoded before a peer has proved the PSK.
            self._counts["malformed"] += 1
            log.info("dropped an oversized message from an unauthenticated peer")
            return None, self._rejection("no session: start with the handshake")
        try:
            env = decode(frames, allow_pickle=False, limits=self._limits)
        except ProtocolError as exc:
            self._counts["malformed"] += 1
            log.info("dropped a malformed message from an unauthenticated peer: %.200s", exc)
            return None, self._rejection("no session: start with the handshake")
        return None, self._handshake(route, env.body)

    def _unsealed_handshake(self, route: bytes, frames: list[Any]) -> Message | None:
        if len(frames) != 1 or len(frame_bytes(frames[0])) > _MAX_UNAUTHENTICATED:
            return None  # handshake messages are one small frame
        try:
            body = decode(frames, limits=self._limits).body
        except ProtocolError:
            return None
        if isinstance(body, Hello) or (isinstance(body, Confirm) and route in self._pending):
            return body
        return None

    def _handshake(self, route: bytes, body: Message) -> list[Any] | None:
        self._expire_pending()
        try:
            if isinstance(body, Hello):
                welcome, state = server_welcome(self.identity, self.namespace, body, self._mode)
                if len(self._pending) >= self.config.transport.max_sessions:
                    raise HandshakeError("too many handshakes in progress")
                self._pending[route] = (time.monotonic(), state)
                return encode(welcome, sender=self.identity.node_id)
            if isinstance(body, Confirm):
                pending = self._pending.pop(route, None)
                if pending is None:
                    raise HandshakeError("Confirm without a Hello")
                session = server_finish(self.namespace, pending[1], body, self._mode)
                self._sessions[route] = session
                if len(self._sessions) > self.config.transport.max_sessions:
                    self._sessions.popitem(last=False)
                self._counts["handshakes"] += 1
                log.debug("admitted %s", session.peer)
                return session.seal(encode(Accepted(self.identity.node_id),
                                           sender=self.identity.node_id, limits=self._limits))
        except HandshakeError as exc:
            self._counts["refused_handshakes"] += 1
            # INFO, not WARNING: anyone on the network can send a Hello.
            log.info("refused a handshake: %.200s", exc)
            return self._rejection(str(exc))
        self._counts["unauthenticated"] += 1
        log.info("dropped a %s from a peer that has not completed the handshake",
                 type(body).__name__)
        return self._rejection("no session: start with the handshake")

    def _rejection(self, reason: str) -> list[Any]:
        # Reasons may quote what the peer sent: keep the answer small.
        return encode(Rejected(reason[:300]), sender=self.identity.node_id)

    def _expire_pending(self) -> None:
        if not self._pending:
            return
        cutoff = time.monotonic() - self.config.transport.handshake_timeout
        for route in [r for r, (t, _) in self._pending.items() if t < cutoff]:
            del self._pending[route]

    # ------------------------------------------------------------- sending

    def _seal_for(self, route: bytes, body: Message, corr: int,
                  term: int | None) -> Iterable[list[Any]]:
        session = self._sessions.get(route)
        if session is None:
            raise PeerError("no authenticated session with that peer (it never completed "
                            "the handshake, or it was forgotten)")
        if not session.local:
            frames = encode(body, corr=corr, term=term, sender=self.identity.node_id,
                            limits=self._limits)
            return [session.seal(frames)] if len(frames) == 1 else session.iter_parts(frames)
        exported = self._exported
        frames = encode(body, corr=corr, term=term, sender=self.identity.node_id,
                        limits=self._local_limits, exported=exported)
        parts = [session.seal(frames)] if len(frames) == 1 else session.iter_parts(frames)
        while len(exported) > _MAX_EXPORTED:
            shm.unlink(exported.popleft())
        return parts

    def send(self, route: bytes, body: Message, *, corr: int = 0, term: int | None = None,
             timeout: float | None = None) -> None:
        parts = self._seal_for(route, body, corr, term)
        # Counted first, so that a peer holding the reply sees the count.
        self._counts["sent"] += 1
        for part in parts:
            self._listener.send(route, part, timeout)

    async def asend(self, route: bytes, body: Message, *, corr: int = 0,
                    term: int | None = None, timeout: float | None = None) -> None:
        parts = self._seal_for(route, body, corr, term)
        self._counts["sent"] += 1
        for part in parts:
            await self._listener.asend(route, part, timeout)

    def reply(self, incoming: Incoming, body: Message, timeout: float | None = None) -> None:
        route = incoming[0]
        parts = self._seal_for(route, body, incoming[2][1], None)  # envelope.corr
        self._counts["sent"] += 1
        for part in parts:
            self._listener.send(route, part, timeout)

    async def areply(self, incoming: Incoming, body: Message,
                     timeout: float | None = None) -> None:
        await self.asend(incoming.route, body, corr=incoming.envelope.corr, timeout=timeout)

    # Answers to peers that are not (yet) authenticated never wait for queue
    # room: a peer that does not read them cannot stall the listener.
    def _send_raw(self, route: bytes, frames: list[Any]) -> None:
        try:
            self._listener.send(route, frames, 0)
        except (TransportError, PMetalTimeoutError) as exc:
            log.info("could not answer a handshake: %s", exc)

    async def _asend_raw(self, route: bytes, frames: list[Any]) -> None:
        try:
            await self._listener.asend(route, frames, 0)
        except (TransportError, PMetalTimeoutError) as exc:
            log.info("could not answer a handshake: %s", exc)

    def interrupt(self) -> None:
        self._listener.interrupt()

    def close(self) -> None:
        self._listener.close()
        while self._exported:
            shm.unlink(self._exported.popleft())


@dataclass(frozen=True)
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
        self._limits = _limits(self.config)
        self._local_limits = _limits(self.config, local=True)
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
        state = client_hello(self.identity, self.namespace, self._mode)
        self._dialer.send(encode(state.hello, sender=self.identity.node_id), timeout)
        welcome = self._handshake_reply(Welcome, deadline)
        confirm, session = client_finish(self.identity, self.namespace, state, welcome,
                                         self._mode)
        self._dialer.send(encode(confirm, sender=self.identity.node_id), _remaining(deadline))
        while True:
            frames = self._recv_raw(deadline, "Accepted")
            try:
                env = decode(session.open(frames), limits=self._limits)
            except (SecurityError, ProtocolError):
                env = self._decode_unsealed(frames)
                if isinstance(env.body, Rejected):
                    raise HandshakeError(f"{self.address} refused us: {env.body.reason}")
                continue
            if isinstance(env.body, Accepted):
                break
        self.session = session
        self._counts["handshakes"] += 1
        return session.peer

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
        state = client_hello(self.identity, self.namespace, self._mode)
        await self._dialer.asend(encode(state.hello, sender=self.identity.node_id), timeout)
        welcome = await self._ahandshake_reply(Welcome, deadline)
        confirm, session = client_finish(self.identity, self.namespace, state, welcome,
                                         self._mode)
        await self._dialer.asend(encode(confirm, sender=self.identity.node_id),
                                 _remaining(deadline))
        while True:
            frames = await self._arecv_raw(deadline, "Accepted")
            try:
                env = decode(session.open(frames), limits=self._limits)
            except (SecurityError, ProtocolError):
                env = self._decode_unsealed(frames)
                if isinstance(env.body, Rejected):
                    raise HandshakeError(f"{self.address} refused us: {env.body.reason}")
                continue
            if isinstance(env.body, Accepted):
                break
        self.session = session
        self._counts["handshakes"] += 1
        return session.peer

    def _decode_unsealed(self, frames: list[Any]) -> Envelope:
        try:
            return decode(frames, limits=self._limits)
        except ProtocolError as exc:
            version = _peek_version(frames)
            if version is not None and version != PROTOCOL_VERSION:
                raise HandshakeError(
                    f"{self.address} speaks pmetal protocol version {version}, this process "
                    f"{PROTOCOL_VERSION}; install the same pmetal version on every node") from exc
            return Envelope(Rejected(f"garbled handshake reply ({exc})"))

    def _check_handshake_reply(self, frames: list[Any], want: type) -> Any:
        env = self._decode_unsealed(frames)
        if isinstance(env.body, Rejected):
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
            return self._dialer.recv(_remaining(deadline))
        except PMetalTimeoutError as exc:
            raise RequestTimeoutError(f"no {what} from {self.address} during the handshake; "
                                      f"is a pmetal node listening there?") from exc

    async def _arecv_raw(self, deadline: float, what: str) -> list[Any]:
        try:
            return await self._dialer.arecv(_remaining(deadline))
        except PMetalTimeoutError as exc:
            raise RequestTimeoutError(f"no {what} from {self.address} during the handshake; "
                                      f"is a pmetal node listening there?") from exc

    # ----------------------------------------------------- sending, replies

    def _send_sealed(self, body: Message, corr: int, term: int | None,
                     timeout: float | None) -> None:
        session = self.session
        if session is None:
            self.open()
            session = self.session
            assert session is not None
        if session.local:
            exported: list[str] = []
            if corr and self._pool is None:
                self._pool = shm.SlotPool()
            frames = encode(body, corr=corr, term=term, sender=self.identity.node_id,
                            limits=self._local_limits, exported=exported,
                            pool=self._pool if corr else None)
            if exported:
                names = self._exported.setdefault(corr, [])
                names.extend(exported)
                if corr == 0 and len(names) > _MAX_EXPORTED:
                    # One-way messages get no answer to release them by; their
                    # receivers unlink them. Keep only the newest names.
                    del names[:-_MAX_EXPORTED]
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
        exported: list[str] = []
        frames = encode(body, corr=corr, term=term, sender=self.identity.node_id,
                        limits=self._local_limits if session.local else self._limits,
                        exported=exported)
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
        return self._replies.pop(corr)

    async def aresult(self, corr: int, timeout: float | None = None) -> Envelope:
        timeout = self.config.transport.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self._read_lock is None:
            self._read_lock = asyncio.Lock()
        while corr not in self._replies:
            # One reader at a time: a reader files every reply it gets, and
            # the others find theirs in _replies when they take the lock.
            try:
                async with asyncio.timeout(_remaining(deadline)):
                    async with self._read_lock:
                        if corr in self._replies:
                            break
                        frames = await self._dialer.arecv(_remaining(deadline))
            except (PMetalTimeoutError, TimeoutError) as exc:
                self._release(corr, answered=False)
                raise RequestTimeoutError(f"no reply from {self.address} within "
                                          f"{timeout:.3g} s") from exc
            self._file(frames)
        self._waiting.discard(corr)
        self._release(corr)
        return self._replies.pop(corr)

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

    def take(self, corr: int) -> Envelope | None:
        """The reply to ``corr`` if it has arrived (it is then forgotten)."""
        env = self._replies.pop(corr, None)
        if env is not None:
            self._waiting.discard(corr)
            self._release(corr)
        return env

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
            env = decode(opened, allow_pickle=True, allow_shm=session.local, limits=self._limits)
        except (SecurityError, ProtocolError) as exc:
            unsealed = self._decode_unsealed(frames)
            if isinstance(unsealed.body, Rejected):
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


Handler = Callable[[Incoming], "Message | None"]


class Server:
    """Runs ``handler`` for every message a listener receives, in a thread.

    The handler's return value (if not None) is sent back as the reply. An
    exception in the handler becomes an :class:`ErrorReply` with its
    traceback; the server keeps serving.
    """

    def __init__(self, listener: SecureListener, handler: Handler, *,
                 name: str = "pmetal-server") -> None:
        self.listener = listener
        self._handler = handler
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None

    def start(self) -> Server:
        self._thread.start()
        return self

    def _run(self) -> None:
        listener = self.listener
        try:
            while not self._stopping:
                try:
                    incoming = listener.recv()
                except ClosedError:
                    return
                try:
                    answer = self._handler(incoming)
                except Exception as exc:  # report to the caller, keep serving
                    answer = ErrorReply(type(exc).__name__, str(exc), traceback.format_exc())
                if answer is not None and incoming.envelope.corr:
                    self._reply(incoming, answer)
        except BaseException as exc:
            self.error = exc
            log.exception("server thread died")
        finally:
            listener.close()
            self._stopped.set()

    def _reply(self, incoming: Incoming, answer: Any) -> None:
        try:
            try:
                self.listener.reply(incoming, answer)
            except (TypeError, ProtocolError) as exc:
                # The handler's answer cannot be sent: tell the caller why.
                log.warning("handler answer to %s cannot be sent: %s", incoming.peer, exc)
                self.listener.reply(incoming, ErrorReply(type(exc).__name__,
                                                         f"the reply cannot be sent: {exc}"))
        except (TransportError, PMetalTimeoutError) as exc:
            if isinstance(exc, ClosedError):
                raise
            log.warning("could not reply to %s: %s", incoming.peer, exc)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the listener; waits up to ``timeout``."""
        self._stopping = True
        self.listener.interrupt()
        if not self._stopped.wait(timeout):
            raise PMetalTimeoutError(f"server {self._thread.name} did not stop within {timeout} s")
        self._thread.join(timeout)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
