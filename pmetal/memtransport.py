"""An in-process transport: the Listener/Dialer contract of
:mod:`pmetal.transport` over bounded queues, for tests and simulations
(election and failure-detector schedules, endpoint tests without sockets).

Queues are guarded by a condition variable and can be used from threads and
from asyncio at once; a full queue applies backpressure exactly like a
ZeroMQ socket at its high-water mark.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import threading
from collections.abc import Sequence
from typing import Any

from pmetal.config import TransportConfig
from pmetal.errors import (BackpressureError, ClosedError, PeerError, PMetalTimeoutError,
                           TransportError)
from pmetal.transport import Frames

__all__ = ["MemoryTransport"]

class _Inbox:
    """A bounded queue that blocking threads and asyncio tasks can both wait on."""

    def __init__(self, capacity: int, name: str) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._capacity = capacity
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._interrupted = False
        self.closed = False
        self.name = name

    def put(self, item: Any, timeout: float | None) -> None:
        with self._cond:
            if self.closed:
                raise PeerError(f"{self.name} is closed")
            if len(self._items) >= self._capacity and not self._cond.wait_for(
                    lambda: len(self._items) < self._capacity or self.closed, timeout):
                raise BackpressureError(f"{self.name} stayed full for {timeout:.3g} s "
                                        f"(capacity {self._capacity} messages)")
            if self.closed:
                raise PeerError(f"{self.name} is closed")
            self._items.append(item)
            self._cond.notify_all()
            self._wake_async()

    def _wake_async(self) -> None:
        for loop, fut in self._waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, fut)
        self._waiters.clear()

    def get(self, timeout: float | None) -> Any:
        with self._cond:
            ok = self._cond.wait_for(lambda: self._items or self._interrupted or self.closed,
                                     timeout)
            return self._take(ok, timeout)

    def _take(self, ok: bool, timeout: float | None) -> Any:
        if self._interrupted:
            self._interrupted = False
            raise ClosedError(f"receive on {self.name} interrupted")
        if self.closed:
            raise ClosedError(f"{self.name} is closed")
        if not ok:
            raise PMetalTimeoutError(f"nothing received on {self.name} within {timeout:.3g} s")
        item = self._items.popleft()
        self._cond.notify_all()
        return item

    async def aget(self, timeout: float | None) -> Any:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with self._cond:
                if self._items or self._interrupted or self.closed:
                    return self._take(True, timeout)
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, fut))
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                with self._cond:
                    return self._take(bool(self._items), timeout)
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                with self._cond:
                    if (loop, fut) in self._waiters:
                        self._waiters.remove((loop, fut))

    def interrupt(self) -> None:
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()
            self._wake_async()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
            self._wake_async()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _athread(fn: Any, *args: Any) -> Any:
    # Memory sends block only on a full queue; a thread keeps the loop free.
    return await asyncio.to_thread(fn, *args)


class MemoryListener:
    def __init__(self, hub: MemoryTransport, address: str) -> None:
        self._hub = hub
        self.address = address
        self.inbox = _Inbox(hub.config.recv_hwm, f"listener {address}")

    def recv(self, timeout: float | None = None) -> tuple[bytes, Frames]:
        return self.inbox.get(timeout)

    async def arecv(self, timeout: float | None = None) -> tuple[bytes, Frames]:
        return await self.inbox.aget(timeout)

    def send(self, route: bytes, frames: Sequence[Any], timeout: float | None = None) -> None:
        if self.inbox.closed:
            raise ClosedError(f"listener {self.address} is closed")
        dialer = self._hub._dialers.get(route)
        if dialer is None or dialer.inbox.closed:
            raise PeerError(f"peer is not connected to {self.address} (gone or never came)")
        timeout = self._hub.config.send_timeout if timeout is None else timeout
        dialer.inbox.put([bytes(memoryview(f).cast("B")) for f in frames], timeout)

    async def asend(self, route: bytes, frames: Sequence[Any],
                    timeout: float | None = None) -> None:
        await _athread(self.send, route, frames, timeout)

    def interrupt(self) -> None:
        self.inbox.interrupt()

    def close(self) -> None:
        self.inbox.close()
        if self._hub._listeners.get(self.address) is self:
            del self._hub._listeners[self.address]


class MemoryDialer:
    def __init__(self, hub: MemoryTransport, address: str) -> None:
        self._hub = hub
        self.address = address
        self.route = os.urandom(8)
        self.inbox = _Inbox(hub.config.recv_hwm, f"dialer to {address}")

    def send(self, frames: Sequence[Any], timeout: float | None = None) -> None:
        if self.inbox.closed:
            raise ClosedError(f"dialer to {self.address} is closed")
        listener = self._hub._listeners.get(self.address)
        if listener is None:
            raise PeerError(f"nothing listens on {self.address}")
        timeout = self._hub.config.send_timeout if timeout is None else timeout
        # Copy like a socket would: the caller may reuse its buffers at once.
        listener.inbox.put((self.route, [bytes(memoryview(f).cast("B")) for f in frames]),
                           timeout)

    async def asend(self, frames: Sequence[Any], timeout: float | None = None) -> None:
        await _athread(self.send, frames, timeout)

    def recv(self, timeout: float | None = None) -> Frames:
        return self.inbox.get(timeout)

    async def arecv(self, timeout: float | None = None) -> Frames:
        return await self.inbox.aget(timeout)

    def close(self) -> None:
        self.inbox.close()
        self._hub._dialers.pop(self.route, None)


class MemoryTransport:
    """In-process transport: listeners and dialers are queues in one hub."""

    _ids = itertools.count()

    def __init__(self, cfg: TransportConfig | None = None) -> None:
        self.config = cfg or TransportConfig()
        self._listeners: dict[str, MemoryListener] = {}
        self._dialers: dict[bytes, MemoryDialer] = {}

    def listen(self, address: str = "mem://") -> MemoryListener:
        if address in ("mem://", "mem://*"):
            address = f"mem://{next(self._ids)}"
        if address in self._listeners:
            raise TransportError(f"cannot listen on {address}: address in use")
        listener = MemoryListener(self, address)
        self._listeners[address] = listener
        return listener

    def dial(self, address: str) -> MemoryDialer:
        dialer = MemoryDialer(self, address)
        self._dialers[dialer.route] = dialer
        return dialer
