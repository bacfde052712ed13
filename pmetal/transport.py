"""Frame transports: a listener (ZeroMQ ROUTER role) and dialers (DEALER role).

A transport moves lists of frames and knows nothing of messages or security;
``pmetal.endpoint`` puts the wire protocol and sessions on top. Two
implementations share one contract (tested by one conformance suite):

* :class:`ZmqTransport`: ROUTER/DEALER over TCP (``tcp://host:port``).
* :class:`~pmetal.memtransport.MemoryTransport` (in :mod:`pmetal.memtransport`):
  in-process queues (``mem://name``), for tests and deterministic simulations.

Contract
--------
* ``Listener.recv(timeout)`` returns ``(route, frames)``; ``Listener.send(route,
  frames, timeout)`` answers the dialer that ``route`` names. A dialer's
  ``send``/``recv`` talk to the one listener it dialed. Messages between one
  dialer and its listener arrive in order, whole or not at all.
* Every blocking call takes a ``timeout`` in seconds. For ``recv``, ``None``
  waits for ever; for ``send``, ``None`` means ``TransportConfig.send_timeout``.
  ``recv`` raises :class:`~pmetal.errors.PMetalTimeoutError` when it passes;
  ``send`` raises :class:`~pmetal.errors.BackpressureError` when the peer's queue
  stays full (high-water mark) until the deadline, so a slow peer cannot make
  a sender's memory grow without bound. Sending to a route that is gone
  raises :class:`~pmetal.errors.PeerError`.
* Each blocking call has an ``a``-prefixed coroutine twin for asyncio.
* ``Listener.interrupt()`` may be called from any thread: a ``recv`` blocked
  in another thread raises :class:`~pmetal.errors.ClosedError` (that is how a
  server thread is stopped). Everything else belongs to the thread that uses
  the object (ZeroMQ sockets are not thread-safe).
* A ZeroMQ dialer reconnects by itself when its listener restarts.

ZeroMQ sockets and strangers
----------------------------
libzmq reads whole multipart messages (and queues them, counting messages,
not bytes) before pmetal sees their first byte, so a check in pmetal cannot
bound what a peer without a session makes a process hold. A
:class:`ZmqTransport` built with :class:`CurveKeys` (what every pmetal
process uses; the keys come from the namespace PSK, see
``NetworkNamespace.curve_keys``) therefore runs the ZMTP CURVE mechanism on
every TCP connection: a peer that does not know the namespace keys cannot
complete the ZMTP handshake, and libzmq drops its connection before it
reads a frame of application data. A connection that has not completed that
handshake within ``handshake_timeout`` is closed. Dialers take random
128-bit routing ids (sent inside the encrypted handshake), and a listener
refuses a second connection that claims a routing id already in use: a
connection cannot take over another's route. The monitors that report
dropped and refused connections are :mod:`pmetal.zmqmonitor`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

import zmq
import zmq.asyncio

from pmetal.config import TransportConfig
from pmetal.errors import (BackpressureError, ClosedError, PeerError, PMetalTimeoutError,
                           TransportError)
from pmetal.values import Address
from pmetal.zmqmonitor import (_HANDSHAKE_FAILED, _MONITORED, REFUSAL_REASONS, _monitor_url,
                               _open_monitor, _retire_monitor)

__all__ = [
    "CurveKeys",
    "Dialer",
    "Listener",
    "Transport",
    "ZmqTransport",
    "normalize_address",
]

log = logging.getLogger(__name__)

Frames = list[Any]

# Plain ints: pyzmq's enum constants cost a microsecond per use on the hot path.
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_RCVTIMEO = int(zmq.RCVTIMEO)
_COPY_BELOW = 65536
# pyzmq's compiled send, without the Python wrapper (routing_id/group
# handling we never use): one Python frame less per small message.
_zsend = zmq.backend.Socket.send


class Listener(Protocol):
    address: str

    def send(self, route: bytes, frames: Sequence[Any], timeout: float | None = None) -> None: ...
    def recv(self, timeout: float | None = None) -> tuple[bytes, Frames]: ...
    async def asend(self, route: bytes, frames: Sequence[Any],
                    timeout: float | None = None) -> None: ...
    async def arecv(self, timeout: float | None = None) -> tuple[bytes, Frames]: ...
    def interrupt(self) -> None: ...
    def close(self) -> None: ...


class Dialer(Protocol):
    address: str

    def send(self, frames: Sequence[Any], timeout: float | None = None) -> None: ...
    def recv(self, timeout: float | None = None) -> Frames: ...
    async def asend(self, frames: Sequence[Any], timeout: float | None = None) -> None: ...
    async def arecv(self, timeout: float | None = None) -> Frames: ...
    def close(self) -> None: ...


class Transport(Protocol):
    def listen(self, address: str) -> Listener: ...
    def dial(self, address: str) -> Dialer: ...


def normalize_address(address: str) -> str:
    """``host:port`` becomes ``tcp://host:port``; full URLs pass through."""
    if "://" in address:
        return address
    try:
        return Address.parse(address).url()
    except ValueError as exc:
        raise ValueError(f"address {address!r} is not 'host:port' or a transport URL "
                         f"({exc})") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback (127.0.0.0/8, ::1,
    bracketed or not, or "localhost"): traffic to it never leaves the
    machine. Any other host name is not: it may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------ ZeroMQ

@dataclass(frozen=True, repr=False)
class CurveKeys:
    """ZMTP CURVE keys (32 raw bytes each) shared by a namespace: every
    listener is a CURVE server with the server pair, every dialer a CURVE
    client with the client pair."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __post_init__(self) -> None:
        for name in ("server_public", "server_secret", "client_public", "client_secret"):
            if len(getattr(self, name)) != 32:
                raise ValueError(f"CurveKeys.{name} must be 32 bytes")

    def __repr__(self) -> str:
        # Not even the public keys: a listener admits any client that knows
        # its public key (no ZAP check), so that key is as secret as the PSK.
        return "CurveKeys(...)"


_MAX_OPEN_FILES = 1 << 16
_raised_nofile = False


def raise_open_file_limit(cap: int = _MAX_OPEN_FILES) -> int:
    """Raise this process's soft limit of open files to its hard limit
    (at most ``cap``), once; returns the soft limit in force.

    Each TCP connection holds a file descriptor, and the usual soft limits
    (256 on macOS, 1024 on Linux) are reached by a thousand idle
    connections, while the hard limit is usually far higher."""
    global _raised_nofile
    if resource is None:
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _raised_nofile:
        return soft
    _raised_nofile = True
    want = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    # macOS refuses more than OPEN_MAX (10,240) whatever the hard limit says.
    error: Exception | None = None
    for attempt in (want, min(want, 10_240)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (attempt, hard))
            return attempt
        except (ValueError, OSError) as exc:
            error = exc
    log.warning("cannot raise the open-file limit from %s to %s: %s", soft, want, error)
    return soft


_CLOSE_WAIT = 1.0   # s a closing listener waits for ZeroMQ to release its port


class _ZmqSocket:
    """Shared plumbing of the ROUTER and DEALER wrappers."""

    def __init__(self, ctx: zmq.Context, kind: int, cfg: TransportConfig) -> None:
        self._ctx = ctx
        self._cfg = cfg
        self._closed = False
        try:
            sock = ctx.socket(kind)
        except zmq.ZMQError as exc:
            # EMFILE: out of file descriptors or of ZeroMQ sockets. A
            # TransportError, so that callers report it instead of dying.
            raise TransportError(f"cannot open a ZeroMQ socket: {exc}") from exc
        self._sock = sock
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, cfg.send_hwm)
        sock.setsockopt(zmq.RCVHWM, cfg.recv_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, int(cfg.reconnect_ivl * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(cfg.reconnect_ivl_max * 1000))
        # A connection that has not completed the ZMTP (CURVE) handshake by
        # then is closed: idle half-open connections do not hold descriptors.
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(cfg.handshake_timeout * 1000))
        # A listener refuses a connection that claims a routing id in use:
        # heartbeats close a connection that died half-open, so that its
        # peer's reconnection is not refused for ever.
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(cfg.heartbeat_ivl * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(cfg.heartbeat_ivl * 3000))
        self._rcvtimeo = -1
        self._async: zmq.asyncio.Socket | None = None
        self._lock = threading.Lock()

    address: str

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} {self.address} is closed")

    # Leading frames received as bytes (cheaper for small frames): route and
    # envelope on a ROUTER, the envelope alone on a DEALER.
    _copied = 1

    def _recv_frames(self, timeout: float | None) -> Frames:
        """One multipart message. A blocking recv with RCVTIMEO is the cheapest
        wait ZeroMQ offers (no poll call, no exception on the fast path)."""
        self._check_open()
        sock = self._sock
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        if ms != self._rcvtimeo:
            sock.setsockopt(_RCVTIMEO, ms)
            self._rcvtimeo = ms
        try:
            if self._copied == 2:
                # ROUTER: a route part is always followed by the message, and
                # all parts arrive together.
                frames: Frames = [sock.recv()]
            else:
                frames = []
            frame = sock.recv(copy=False)
        except zmq.Again:
            raise PMetalTimeoutError(f"nothing received on {self.address} "
                                     f"within {timeout:.3g} s") from None
        except zmq.ZMQError as exc:
            if self._closed:
                raise ClosedError(f"{self.address} was closed") from exc
            raise TransportError(f"receive on {self.address} failed: {exc}") from exc
        # Frame.more, not getsockopt(RCVMORE): a third of the cost per part.
        more = frame.more
        frames.append(frame.bytes)   # the envelope, small: as bytes
        while more:
            frame = sock.recv(copy=False)
            more = frame.more
            frames.append(frame)
        return frames

    def _send_now(self, frames: Sequence[Any]) -> None:
        """Queue one multipart message or raise zmq.Again; small frames are
        copied (cheaper than zero-copy bookkeeping), large ones are not."""
        send = self._sock.send
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            flags = _NOBLOCK if i == last else _NOBLOCK_MORE
            if len(frame) < _COPY_BELOW:  # len() of a memoryview counts items: fine, views are bytes
                send(frame, flags)
            else:
                send(frame, flags, copy=False)

    def _send_frames(self, frames: Sequence[Any], timeout: float | None) -> None:
        self._check_open()
        try:
            self._send_now(frames)
            return
        except zmq.Again:
            pass
        except zmq.ZMQError as exc:
            raise self._send_error(exc) from exc
        timeout = self._cfg.send_timeout if timeout is None else timeout
        if not self._sock.poll(int(timeout * 1000), zmq.POLLOUT):
            raise BackpressureError(
                f"peer of {self.address} did not drain its queue within {timeout:.3g} s "
                f"(high-water mark {self._cfg.send_hwm} messages)")
        try:
            self._send_now(frames)
        except zmq.Again as exc:
            raise BackpressureError(f"send queue to {self.address} is full") from exc
        except zmq.ZMQError as exc:
            raise self._send_error(exc) from exc

    def _send_error(self, exc: zmq.ZMQError) -> TransportError:
        if exc.errno == zmq.EHOSTUNREACH:
            return PeerError(f"peer is not connected to {self.address} (gone or never came)")
        return TransportError(f"send on {self.address} failed: {exc}")

    def _asock(self) -> zmq.asyncio.Socket:
        if self._async is None:
            self._async = zmq.asyncio.Socket.from_socket(self._sock)
        return self._async

    async def _arecv_frames(self, timeout: float | None) -> Frames:
        self._check_open()
        try:
            # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a
            # cancellation that races the receive completing.
            async with asyncio.timeout(timeout):
                return await self._asock().recv_multipart(copy=False)
        except TimeoutError:
            raise PMetalTimeoutError(f"nothing received on {self.address} within "
                                     f"{timeout:.3g} s") from None
        except zmq.ZMQError as exc:
            if self._closed:
                raise ClosedError(f"{self.address} was closed") from exc
            raise TransportError(f"receive on {self.address} failed: {exc}") from exc

    async def _asend_frames(self, frames: Sequence[Any], timeout: float | None) -> None:
        self._check_open()
        timeout = self._cfg.send_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(timeout):
                await self._asock().send_multipart(frames, copy=False)
        except TimeoutError:
            raise BackpressureError(f"peer of {self.address} did not drain its queue within "
                                    f"{timeout:.3g} s") from None
        except zmq.ZMQError as exc:
            raise self._send_error(exc) from exc

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._close_socket()

    def _close_socket(self) -> None:
        if self._async is not None:
            # The asyncio twin shadows the same ZeroMQ socket: closing it
            # cancels its waiters, leaves the event loop and closes the socket.
            self._async.close(linger=0)
            self._async = None
            # The owner must know, or it closes that address again when it is
            # garbage-collected, and by then libzmq may have given the memory
            # to a new socket (seen as "Socket operation on non-socket" on a
            # node's fresh channel to a worker).
            self._sock._closed = True
        else:
            self._sock.close(linger=0)


class ZmqListener(_ZmqSocket):
    """A ROUTER socket bound to ``address`` (port 0 or ``*``: any free port)."""

    _copied = 2

    def __init__(self, ctx: zmq.Context, address: str, cfg: TransportConfig,
                 curve: CurveKeys | None = None) -> None:
        raise_open_file_limit()
        super().__init__(ctx, zmq.ROUTER, cfg)
        self._curve = curve is not None
        self._refusals: zmq.asyncio.Socket | None = None
        self.refused: dict[str, int] = dict.fromkeys(REFUSAL_REASONS.values(), 0)
        # Told the reason of each refusal counted (the node's event log).
        self.on_refused: Callable[[str], None] | None = None
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # No ROUTER_HANDOVER: a connection that claims a routing id in use is
        # refused, so nobody can take over another peer's route.
        if curve is not None:
            self._sock.setsockopt(zmq.CURVE_SERVER, 1)
            self._sock.setsockopt(zmq.CURVE_SECRETKEY, curve.server_secret)
        url = normalize_address(address)
        if url.startswith("tcp://") and url.endswith(":0"):
            url = url[:-2] + ":*"
        try:
            self._sock.bind(url)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # interrupt() sends to this inproc endpoint of the same ROUTER from a
        # throwaway DEALER whose routing id is a secret: remote peers cannot
        # forge it, and receiving needs no poller.
        self._wake_route = b"\xffwake-" + os.urandom(16)
        self._wake_url = f"inproc://pmetal-wake-{self._wake_route[6:].hex()}"
        self._sock.bind(self._wake_url)

    async def count_refusals(self) -> None:
        """Count the connections refused inside ZeroMQ, by reason, in
        :attr:`refused` until cancelled: a CURVE listener's ZMTP handshakes
        that failed (a peer without the namespace's keys, a peer that is
        not ZeroMQ at all), which never reach pmetal's own handshake. Read
        from the socket's monitor as the events come (its queue has no
        limit, so nothing may leave it unread); nothing to count without
        CURVE."""
        if not self._curve:
            return
        with self._lock:
            if self._closed or self._refusals is not None:
                return
            reader = _open_monitor(self._sock, _HANDSHAKE_FAILED)
            self._refusals = zmq.asyncio.Socket.from_socket(reader)
            refusals = self._refusals
        while True:
            try:
                frames = await refusals.recv_multipart()
            except zmq.ZMQError:   # closed with the listener
                return
            reason = REFUSAL_REASONS.get(int.from_bytes(frames[0][:2], "little"))
            if reason is not None:
                self.refused[reason] += 1
                if self.on_refused is not None:
                    self.on_refused(reason)

    def interrupt(self) -> None:
        with self._lock:
            if self._closed:
                return
            poke = self._ctx.socket(zmq.DEALER)
            poke.setsockopt(zmq.ROUTING_ID, self._wake_route)
            poke.setsockopt(zmq.LINGER, 1000)
            poke.connect(self._wake_url)
            poke.send(b"", zmq.NOBLOCK)
            poke.close()

    def _close_socket(self) -> None:
        if self._refusals is not None:
            try:
                # Stops the monitor under libzmq's own lock: no event is
                # sent after this, so closing its reader is safe.
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._refusals.close(linger=0)
            self._refusals = None
        # ZeroMQ closes the listening TCP socket later, in its I/O thread;
        # wait (bounded) for the socket to be gone so the port can be bound
        # again at once.
        try:
            monitor = self._sock.get_monitor_socket(zmq.EVENT_CLOSED | zmq.EVENT_MONITOR_STOPPED,
                                                   _monitor_url())
        except zmq.ZMQError:  # already closed underneath us: nothing to wait for
            super()._close_socket()
            return
        super()._close_socket()
        _retire_monitor(monitor, _CLOSE_WAIT)

    def recv(self, timeout: float | None = None) -> tuple[bytes, Frames]:
        frames = self._recv_frames(timeout)
        route = frames.pop(0)
        if route == self._wake_route:
            raise ClosedError(f"receive on {self.address} interrupted")
        return route, frames

    def send(self, route: bytes, frames: Sequence[Any], timeout: float | None = None) -> None:
        if len(frames) == 1 and not self._closed and len(frames[0]) < _COPY_BELOW:
            # The common small reply, without the general loop. ZeroMQ checks
            # the high-water mark (and the route) on the first part only.
            sock = self._sock
            try:
                _zsend(sock, route, _NOBLOCK_MORE)
                _zsend(sock, frames[0], _NOBLOCK)
                return
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                raise self._send_error(exc) from exc
        self._send_frames([route, *frames], timeout)

    async def arecv(self, timeout: float | None = None) -> tuple[bytes, Frames]:
        route, *frames = await self._arecv_frames(timeout)
        if route.bytes == self._wake_route:
            raise ClosedError(f"receive on {self.address} interrupted")
        return route.bytes, frames

    async def asend(self, route: bytes, frames: Sequence[Any],
                    timeout: float | None = None) -> None:
        await self._asend_frames([route, *frames], timeout)


class ZmqDialer(_ZmqSocket):
    """A DEALER socket connected to one listener."""

    @property
    def socket(self) -> zmq.Socket:
        """The ZeroMQ socket, for polling it together with others."""
        return self._sock

    def monitor_disconnects(self) -> zmq.Socket:
        """A PAIR socket that becomes readable when the TCP connection to the
        listener drops (on one machine: the listener's process died). Its
        events are EVENT_DISCONNECTED and, for a CURVE dialer, the
        EVENT_HANDSHAKE_FAILED_* kinds (each followed by a disconnect).

        The dialer owns it: ``close()`` stops the monitor before closing the
        PAIR socket. Never close it yourself (see ``_retire_monitor``)."""
        self._monitor_kept = True
        if self._monitor is None:
            self._monitor = _open_monitor(self._sock, _MONITORED)
        return self._monitor

    def watch_handshake(self, on: bool) -> None:
        """Watch for a refused CURVE handshake while a pmetal handshake runs
        (a Channel turns it on and off around its handshake). libzmq retries
        a refused handshake quietly; its monitor is the only sign that the
        listener has other namespace keys. Off again after the handshake, so
        a dialer holds no extra sockets (ZeroMQ's limit is per context)."""
        if on:
            if self._curve and self._monitor is None:
                self._monitor = _open_monitor(self._sock, _MONITORED)
        elif self._monitor is not None and not self._monitor_kept:
            self._stop_monitor()

    def refused(self) -> bool:
        """Whether the listener refused this dialer's ZMTP CURVE handshake
        (it has other namespace keys: another PSK or namespace name).

        Known only while :meth:`watch_handshake` is on and nobody else reads
        the monitor (a reader of :meth:`monitor_disconnects` must see every
        disconnect, so its events are left to it)."""
        if self._monitor is None or self._monitor_kept or self._closed:
            return self._refused
        while self._monitor.poll(0):
            event = self._monitor.recv_multipart()[0]
            if int.from_bytes(event[:2], "little") & _HANDSHAKE_FAILED:
                self._refused = True
        return self._refused

    def _stop_monitor(self) -> None:
        assert self._monitor is not None
        try:
            # Stops the monitor under libzmq's own lock: no event is sent
            # after this, so closing the reader below is safe.
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._monitor = None

    def _close_socket(self) -> None:
        if self._monitor is not None:
            self._stop_monitor()
        super()._close_socket()

    def __init__(self, ctx: zmq.Context, address: str, cfg: TransportConfig,
                 curve: CurveKeys | None = None) -> None:
        super().__init__(ctx, zmq.DEALER, cfg)
        self._monitor: zmq.Socket | None = None
        # Random, so not guessable; sent inside the encrypted CURVE handshake.
        self.route = os.urandom(16)
        self._sock.setsockopt(zmq.ROUTING_ID, self.route)
        if curve is not None:
            self._sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
            self._sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.client_public)
            self._sock.setsockopt(zmq.CURVE_SECRETKEY, curve.client_secret)
        self._curve = curve is not None
        self._refused = False
        self._monitor_kept = False   # monitor_disconnects() handed it out
        self.address = normalize_address(address)
        try:
            self._sock.connect(self.address)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot dial {self.address}: {exc}") from exc

    def recv(self, timeout: float | None = None) -> Frames:
        return self._recv_frames(timeout)

    def send(self, frames: Sequence[Any], timeout: float | None = None) -> None:
        if len(frames) == 1 and not self._closed and len(frames[0]) < _COPY_BELOW:
            try:  # the common small request, without the general loop
                _zsend(self._sock, frames[0], _NOBLOCK)
                return
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                raise self._send_error(exc) from exc
        self._send_frames(frames, timeout)

    async def arecv(self, timeout: float | None = None) -> Frames:
        return await self._arecv_frames(timeout)

    async def asend(self, frames: Sequence[Any], timeout: float | None = None) -> None:
        await self._asend_frames(frames, timeout)


class ZmqTransport:
    """ROUTER/DEALER over TCP. One per process is enough; it owns nothing but
    the ZeroMQ context (shared by default).

    ``curve``: the namespace's CURVE keys (``NetworkNamespace.curve_keys()``).
    Every pmetal process passes them; without them the sockets run ZeroMQ's
    NULL mechanism, and a stranger can make a listener buffer messages
    before pmetal's handshake sees them (tests of the bare transport only).
    """

    def __init__(self, cfg: TransportConfig | None = None,
                 context: zmq.Context | None = None, *, curve: CurveKeys | None = None) -> None:
        self.config = cfg or TransportConfig()
        self.context = context or zmq.Context.instance()
        self.curve = curve

    def listen(self, address: str) -> ZmqListener:
        return ZmqListener(self.context, address, self.config, self.curve)

    def dial(self, address: str) -> ZmqDialer:
        return ZmqDialer(self.context, address, self.config, self.curve)
