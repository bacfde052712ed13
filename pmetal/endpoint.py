"""Authenticated messaging over a transport: the layer actors talk through.

* :class:`SecureListener` (server role, one per process) admits peers only
  through the namespace handshake and delivers nothing else: a message from
  a peer without a session, with a bad seal, a replayed sequence number or a
  malformed envelope is dropped, logged and counted, and the listener keeps
  serving everyone else.
* :class:`~pmetal.channel.Channel` (client role, in :mod:`pmetal.channel` and
  importable from here) dials one listener, runs the handshake, and offers
  one-way sends, request/response with correlation ids and deadlines, and
  pipelining (``submit`` many, then ``result`` each).
* :class:`Server` runs a handler for a listener in a thread of its own.

Blocking methods keep the event loop off the hot path (a blocking ZeroMQ
round trip costs about half an asyncio one here); each has an ``a``-prefixed
coroutine twin.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pmetal import shm
from pmetal.channel import (MAX_EXPORTED, NO_SESSION, UNDECODABLE, Channel, ChannelStatistics,
                            peek_corr, remaining, wire_limits)
from pmetal.codec import Envelope, decode, encode, frame_bytes
from pmetal.config import PMetalConfig
from pmetal.errors import (AuthenticationError, ClosedError, HandshakeError, PeerError,
                           PMetalTimeoutError, ProtocolError, SecurityError, TransportError)
from pmetal.identity import NodeIdentity
from pmetal.ids import NodeId
from pmetal.security import (NetworkNamespace, ServerHandshake, Session, mode_for, server_finish,
                             server_welcome)
from pmetal.transport import Listener
from pmetal.wire import PROTOCOL_VERSION, Accepted, Confirm, ErrorReply, Hello, Message, Rejected

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

_MAX_UNAUTHENTICATED = 4096


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
    pending_handshakes: int
    expired_handshakes: int
    evicted_handshakes: int
    refused_requests: int = 0
    """Authenticated requests that did not decode, answered with an
    ErrorReply (also counted in dropped_malformed)."""


class SecureListener:
    """A transport listener that only delivers authenticated messages."""

    def __init__(self, listener: Listener, identity: NodeIdentity, namespace: NetworkNamespace,
                 config: PMetalConfig | None = None) -> None:
        self.config = config or PMetalConfig()
        self._listener = listener
        self.identity = identity
        self.namespace = namespace
        self._mode = mode_for(self.config.security)
        self._limits = wire_limits(self.config)
        self._local_limits = wire_limits(self.config, local=True)
        self._sessions: collections.OrderedDict[bytes, Session] = collections.OrderedDict()
        self._pending: dict[bytes, tuple[float, ServerHandshake]] = {}
        self._counts = collections.Counter[str]()
        # Shared-memory objects made for replies. Their receiver unlinks each
        # one once it has mapped it; those still there at close are unlinked
        # then. Never unlinked earlier: a receiver that is slow to read its
        # replies must still find every result.
        self._exported: collections.deque[str] = collections.deque()
        self._exported_check = MAX_EXPORTED
        # Told the reason of every handshake refused (the node's event log).
        self.on_refused: Callable[[str], None] | None = None

    @property
    def address(self) -> str:
        return self._listener.address

    def statistics(self) -> ListenerStatistics:
        c = self._counts
        return ListenerStatistics(c["received"], c["sent"], len(self._sessions), c["handshakes"],
                                  c["refused_handshakes"], c["unauthenticated"], c["malformed"],
                                  c["auth_failures"], len(self._pending),
                                  c["expired_handshakes"], c["evicted_handshakes"],
                                  c["refused_requests"])

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
            route, frames = await self._listener.arecv(remaining(deadline))
            incoming, reply = self._accept(route, frames)
            if reply is not None:
                await self._asend_raw(route, reply)
            if incoming is not None:
                return incoming

    def _accept(self, route: bytes, frames: list[Any]) -> tuple[Incoming | None, list[Any] | None]:
        """Classify one raw message: (delivered message, frames to answer with)."""
        session = self._sessions.get(route)
        if session is not None:
            opened = None
            try:
                opened = session.open_part(frames)
                if opened is None:  # a streamed message still lacks segments
                    return None, None
                env = decode(opened, allow_pickle=True,
                             oob=shm.READER if session.local else None, limits=self._limits)
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
                # The seal verified, so a member sent this: when it was a
                # request, answer at once instead of leaving the caller to
                # its request timeout (a version mismatch, usually).
                self._counts["malformed"] += 1
                log.warning("dropped a malformed message from %s: %s", session.peer, exc)
                return None, self._undecodable(session, opened, exc)
            except Exception as exc:  # noqa: BLE001 - no message may stop the listener
                self._counts["malformed"] += 1
                log.warning("dropped a message from %s that broke its decoding: %s: %s",
                            session.peer, type(exc).__name__, exc)
                return None, self._undecodable(session, opened, exc)
            self._sessions.move_to_end(route)
            self._counts["received"] += 1
            return _tuple_new(Incoming, (route, session.peer, env)), None
        if len(frames) != 1 or len(frame_bytes(frames[0])) > _MAX_UNAUTHENTICATED:
            # Handshake messages are one small frame; nothing bigger is even
            # decoded before a peer has proved the PSK.
            self._counts["malformed"] += 1
            log.info("dropped an oversized message from an unauthenticated peer")
            return None, self._rejection(f"{NO_SESSION}: start with the handshake")
        try:
            env = decode(frames, allow_pickle=False, limits=self._limits)
        except Exception as exc:  # noqa: BLE001 - ProtocolError, or a bug a stranger found
            self._counts["malformed"] += 1
            log.info("dropped a malformed message from an unauthenticated peer: %.200s", exc)
            return None, self._rejection(f"{NO_SESSION}: start with the handshake")
        return None, self._handshake(route, env.body)

    def _undecodable(self, session: Session, frames: list[Any] | None,
                     exc: Exception) -> list[Any] | None:
        """The sealed refusal of an authenticated request that does not
        decode, when its correlation id can still be read; else None."""
        corr = peek_corr(frames) if frames is not None else 0
        if not corr:
            return None   # a one-way message, or no id to answer to
        self._counts["refused_requests"] += 1
        detail = str(exc) if isinstance(exc, ProtocolError) else f"{type(exc).__name__}: {exc}"
        reason = (f"{UNDECODABLE} {corr}: {detail[:300]}; both sides must run the same "
                  f"pmetal protocol version (this one speaks {PROTOCOL_VERSION})")
        try:
            return session.seal(encode(ErrorReply("ProtocolError", reason), corr=corr,
                                       sender=self.identity.node_id, limits=self._limits))
        except (SecurityError, ProtocolError) as seal_exc:
            log.warning("could not refuse request %d of %s: %s", corr, session.peer, seal_exc)
            return None

    def _unsealed_handshake(self, route: bytes, frames: list[Any]) -> Message | None:
        if len(frames) != 1 or len(frame_bytes(frames[0])) > _MAX_UNAUTHENTICATED:
            return None  # handshake messages are one small frame
        try:
            body = decode(frames, limits=self._limits).body
        except Exception:  # noqa: BLE001 - not a handshake message: the caller drops it
            return None
        if isinstance(body, Hello) or (isinstance(body, Confirm) and route in self._pending):
            return body
        return None

    def _handshake(self, route: bytes, body: Message) -> list[Any] | None:
        self._expire_pending()
        try:
            if isinstance(body, Hello):
                welcome, state = server_welcome(self.identity, self.namespace, body, self._mode)
                pending = self._pending
                pending.pop(route, None)
                while len(pending) >= self.config.transport.max_pending_handshakes:
                    # The oldest goes: Hellos that are never confirmed cannot
                    # keep a new peer out, they only push each other out.
                    del pending[next(iter(pending))]
                    self._counts["evicted_handshakes"] += 1
                pending[route] = (time.monotonic(), state)
                return encode(welcome, sender=self.identity.node_id)
            if isinstance(body, Confirm):
                pending = self._pending.pop(route, None)
                if pending is None:
                    raise HandshakeError("Confirm without a Hello")
                session = server_finish(self.namespace, pending[1], body, self._mode)
                self._sessions[route] = session
                if len(self._sessions) > self.config.transport.max_sessions:
                    old_route, old = self._sessions.popitem(last=False)
                    # Told at once: its pending requests fail now instead of
                    # waiting for replies that cannot be sealed any more.
                    self._send_raw(old_route, self._rejection(
                        f"{NO_SESSION}: forgotten, the listener keeps "
                        f"{self.config.transport.max_sessions} sessions at most"))
                    log.info("forgot the least recently used session, with %s", old.peer)
                self._counts["handshakes"] += 1
                log.debug("admitted %s", session.peer)
                return session.seal(encode(Accepted(self.identity.node_id),
                                           sender=self.identity.node_id, limits=self._limits))
        except HandshakeError as exc:
            self._counts["refused_handshakes"] += 1
            # INFO, not WARNING: anyone on the network can send a Hello.
            log.info("refused a handshake: %.200s", exc)
            self._refused(str(exc))
            return self._rejection(str(exc))
        except Exception as exc:  # noqa: BLE001 - no Hello may stop the listener
            # A crafted field that the checks above let through (a bug of
            # ours): refused like a bad proof, and the listener serves on.
            self._pending.pop(route, None)
            self._counts["refused_handshakes"] += 1
            log.info("refused a handshake that broke its checks: %s: %.200s",
                     type(exc).__name__, exc)
            self._refused(f"malformed {type(body).__name__}")
            return self._rejection(f"malformed {type(body).__name__}")
        self._counts["unauthenticated"] += 1
        log.info("dropped a %s from a peer that has not completed the handshake",
                 type(body).__name__)
        return self._rejection(f"{NO_SESSION}: start with the handshake")

    def _refused(self, reason: str) -> None:
        if self.on_refused is not None:
            try:
                self.on_refused(reason)
            except Exception:   # a listener of refusals never stops this one
                log.exception("on_refused failed")

    def _rejection(self, reason: str) -> list[Any]:
        # Reasons may quote what the peer sent: keep the answer small.
        return encode(Rejected(reason[:300]), sender=self.identity.node_id)

    def _expire_pending(self) -> None:
        if not self._pending:
            return
        # Oldest first (insertion order): stop at the first that is young.
        cutoff = time.monotonic() - self.config.transport.handshake_timeout
        pending = self._pending
        while pending:
            route = next(iter(pending))
            if pending[route][0] >= cutoff:
                break
            del pending[route]
            self._counts["expired_handshakes"] += 1

    # ------------------------------------------------------------- sending

    def _seal_for(self, route: bytes, body: Message, corr: int,
                  term: int | None) -> Iterable[list[Any]]:
        session = self._sessions.get(route)
        if session is None:
            # The peer may be waiting for this reply: say so rather than let
            # it wait for its deadline (or for ever).
            self._send_raw(route, self._rejection(f"{NO_SESSION}: forgotten; start with "
                                                  f"the handshake"))
            raise PeerError("no authenticated session with that peer (it never completed "
                            "the handshake, or it was forgotten)")
        if not session.local:
            frames = encode(body, corr=corr, term=term, sender=self.identity.node_id,
                            limits=self._limits)
            return [session.seal(frames)] if len(frames) == 1 else session.iter_parts(frames)
        exported = shm.Exports(session.peer_pid)
        frames = encode(body, corr=corr, term=term, sender=self.identity.node_id,
                        limits=self._local_limits, oob=exported)
        parts = [session.seal(frames)] if len(frames) == 1 else session.iter_parts(frames)
        self._exported.extend(exported)
        if len(self._exported) > self._exported_check:
            self._forget_mapped()
        return parts

    def _forget_mapped(self) -> None:
        """Stop tracking the exported objects that their receivers mapped
        (and so unlinked); check again when the list has doubled."""
        kept = collections.deque(name for name in self._exported if shm.exists(name))
        self._exported.clear()
        self._exported.extend(kept)
        self._exported_check = max(MAX_EXPORTED, 2 * len(kept))

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
