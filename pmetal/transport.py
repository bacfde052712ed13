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
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import zmq
import zmq.asyncio

from pmetal.config import TransportConfig
from pmetal.errors import (BackpressureError, ClosedError, PeerError, PMetalTimeoutError,
                           TransportError)

__all__ = [
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
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not 'host:port' or a transport URL")
    return f"tcp://{host}:{port}"


# ------------------------------------------------------------------ ZeroMQ

_CLOSE_WAIT = 1.0   # s a closing listener waits for ZeroMQ to release its port

# Monitor readers whose socket had not finished closing when we stopped
# waiting. libzmq sends monitor events from its I/O thread with a blocking
# send: an event for a PAIR reader that is already closed blocks that thread
# for good, and every socket of the context stops moving (seen as handshakes
# that never complete). So a reader is closed only after EVENT_MONITOR_STOPPED,
# the last event libzmq sends; until then it is parked here.
_parked_monitors: list[zmq.Socket] = []
_parked_lock = threading.Lock()


def _monitor_url() -> str:
    # pyzmq's default name comes from the socket's file descriptor, which a
    # new socket can reuse while the old monitor's endpoint is still bound.
    return f"inproc://pmetal-monitor-{os.urandom(8).hex()}"


def _drained(monitor: zmq.Socket, timeout: float) -> bool:
    """Read events until EVENT_MONITOR_STOPPED (True) or ``timeout`` (False)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if not monitor.poll(max(0, int(left * 1000))):
            return False
        event = monitor.recv_multipart()[0]
        if int.from_bytes(event[:2], "little") == zmq.EVENT_MONITOR_STOPPED:
            return True


def _retire_monitor(monitor: zmq.Socket, timeout: float) -> None:
    """Close the reader of a monitor whose socket is closing, once libzmq has
    stopped the monitor; park it if that takes longer than ``timeout``."""
    with _parked_lock:
        for parked in [m for m in _parked_monitors if _drained(m, 0)]:
            parked.close(linger=0)
            _parked_monitors.remove(parked)
    if _drained(monitor, timeout):
        monitor.close(linger=0)
        return
    log.warning("a closed ZeroMQ socket had not stopped its monitor after %.3g s; "
                "keeping the monitor open until it does", timeout)
    with _parked_lock:
        _parked_monitors.append(monitor)

class _ZmqSocket:
    """Shared plumbing of the ROUTER and DEALER wrappers."""

    def __init__(self, ctx: zmq.Context, kind: int, cfg: TransportConfig) -> None:
        self._ctx = ctx
        self._cfg = cfg
        self._closed = False
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, cfg.send_hwm)
        sock.setsockopt(zmq.RCVHWM, cfg.recv_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, int(cfg.reconnect_ivl * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(cfg.reconnect_ivl_max * 1000))
        self._sock = sock
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
            # The sync wrapper does not know: when it is garbage collected its
            # __del__ would check the freed handle, find a new socket that
            # libzmq put at the same address (a socket opened since), and
            # close *that* one ('Socket operation on non-socket', or a
            # handshake that never gets an answer). Mark it closed.
            self._sock._closed = True
        else:
            self._sock.close(linger=0)


class ZmqListener(_ZmqSocket):
    """A ROUTER socket bound to ``address`` (port 0 or ``*``: any free port)."""

    _copied = 2

    def __init__(self, ctx: zmq.Context, address: str, cfg: TransportConfig) -> None:
        super().__init__(ctx, zmq.ROUTER, cfg)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
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
        listener drops (on one machine: the listener's process died).

        The dialer owns it: ``close()`` stops the monitor before closing the
        PAIR socket. Never close it yourself (see ``_retire_monitor``)."""
        if self._monitor is None:
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED, _monitor_url())
        return self._monitor

    def _close_socket(self) -> None:
        if self._monitor is not None:
            try:
                # Stops the monitor under libzmq's own lock: no event is sent
                # after this, so closing the reader below is safe.
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
            self._monitor = None
        super()._close_socket()

    def __init__(self, ctx: zmq.Context, address: str, cfg: TransportConfig) -> None:
        super().__init__(ctx, zmq.DEALER, cfg)
        self._monitor: zmq.Socket | None = None
        self.route = os.urandom(8)
        self._sock.setsockopt(zmq.ROUTING_ID, self.route)
        self.address = normalize_address(address)
        self._sock.connect(self.address)

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
    the ZeroMQ context (shared by default)."""

    def __init__(self, cfg: TransportConfig | None = None,
                 context: zmq.Context | None = None) -> None:
        self.config = cfg or TransportConfig()
        self.context = context or zmq.Context.instance()

    def listen(self, address: str) -> ZmqListener:
        return ZmqListener(self.context, address, self.config)

    def dial(self, address: str) -> ZmqDialer:
        return ZmqDialer(self.context, address, self.config)
