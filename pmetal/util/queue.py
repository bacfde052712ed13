"""Ray's ``ray.util.queue``: a FIFO queue any task or actor can use.

The queue lives in an actor (``_QueueActor``, an asyncio queue); a
:class:`Queue` is a handle to it, so it can be passed to tasks and actors
like any handle. ``put`` and ``get`` block as the standard library's
``queue.Queue`` does: ``block=False`` (or the ``*_nowait`` methods) raises
:class:`Full` or :class:`Empty` at once, ``timeout=t`` after ``t`` seconds,
``timeout=None`` waits as long as it takes. The queue ends with the process
that made it (the actor's owner), or with :meth:`Queue.shutdown`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from pmetal.actors.handles import ActorHandle, remote
from pmetal.actors.refs import ObjectRef
from pmetal.errors import PMetalTypeError, PMetalValueError
from pmetal.util import _refs

__all__ = ["Empty", "Full", "Queue"]


class Empty(Exception):
    """``get`` found the queue empty (``block=False``) or nothing came in
    before its timeout. Ray's ``ray.util.queue.Empty``."""


class Full(Exception):
    """``put`` found the queue full (``block=False``) or no room was made
    before its timeout. Ray's ``ray.util.queue.Full``."""


_EMPTY, _FULL = "empty", "full"
"""What the actor answers instead of raising, so that the caller raises
the plain :class:`Empty` / :class:`Full` (not a remote error wrapping them)."""


class _QueueActor:
    """The actor that holds the items (async: waiting calls cost no thread)."""

    def __init__(self, maxsize: int) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize)

    async def qsize(self) -> int:
        return self.queue.qsize()

    async def empty(self) -> bool:
        return self.queue.empty()

    async def full(self) -> bool:
        return self.queue.full()

    async def put(self, item: Any, timeout: float | None = None) -> str | None:
        try:
            await asyncio.wait_for(self.queue.put(item), timeout)
        except asyncio.TimeoutError:
            return _FULL
        return None

    async def get(self, timeout: float | None = None) -> tuple[str | None, Any]:
        try:
            return None, await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return _EMPTY, None

    async def put_nowait(self, item: Any) -> str | None:
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            return _FULL
        return None

    async def put_nowait_batch(self, items: list[Any]) -> str | None:
        if self.queue.maxsize > 0 and len(items) + self.queue.qsize() > self.queue.maxsize:
            return _FULL
        for item in items:
            self.queue.put_nowait(item)
        return None

    async def get_nowait(self) -> tuple[str | None, Any]:
        try:
            return None, self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return _EMPTY, None

    async def get_nowait_batch(self, num_items: int) -> tuple[str | None, Any]:
        if num_items > self.queue.qsize():
            return _EMPTY, self.queue.qsize()
        return None, [self.queue.get_nowait() for _ in range(num_items)]


_QueueActorClass = remote(_QueueActor)


def _check_timeout(timeout: Any, what: str) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise PMetalTypeError(f"Queue.{what}: timeout must be a number of seconds or None, not "
                              f"{type(timeout).__name__}")
    if not timeout >= 0:
        raise PMetalValueError(f"Queue.{what}: timeout={timeout!r}; it must be a non-negative "
                               f"number")


class Queue:
    """A first-in first-out queue held by an actor (Ray's ``Queue``).

    ``maxsize`` <= 0 means without limit. ``actor_options`` are the
    ``.options(...)`` of the queue's actor (``name``, ``lifetime``, ...)."""

    def __init__(self, maxsize: int = 0, actor_options: dict[str, Any] | None = None) -> None:
        if type(maxsize) is not int:
            raise PMetalTypeError(f"Queue: maxsize must be an int, not {type(maxsize).__name__}")
        if actor_options is not None and not isinstance(actor_options, dict):
            raise PMetalTypeError(f"Queue: actor_options must be a dict of .options(...), not "
                                  f"{type(actor_options).__name__}")
        self.maxsize = maxsize
        self.actor: ActorHandle | None = (
            _QueueActorClass.options(**(actor_options or {})).remote(maxsize))

    def _actor(self) -> ActorHandle:
        if self.actor is None:
            raise PMetalValueError("this Queue was shut down (Queue.shutdown())")
        return self.actor

    def _get(self, ref: ObjectRef, timeout: float | None = None) -> Any:
        return _refs.get(ref, timeout)

    def __len__(self) -> int:
        return self.size()

    def size(self) -> int:
        """The number of items in the queue now."""
        return self._get(self._actor().qsize.remote())

    def qsize(self) -> int:
        """The number of items in the queue now."""
        return self.size()

    def empty(self) -> bool:
        return self._get(self._actor().empty.remote())

    def full(self) -> bool:
        return self._get(self._actor().full.remote())

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """Add ``item``; when the queue is full, wait for room (up to
        ``timeout`` seconds, then :class:`Full`), or with ``block=False``
        raise :class:`Full` at once."""
        if not block:
            outcome = self._get(self._actor().put_nowait.remote(item))
        else:
            _check_timeout(timeout, "put")
            outcome = self._get(self._actor().put.remote(item, timeout))
        if outcome == _FULL:
            raise Full(f"the queue is full ({self.maxsize} items)"
                       + (f" and stayed full for {timeout} s" if block else ""))

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Take the oldest item; when the queue is empty, wait for one (up to
        ``timeout`` seconds, then :class:`Empty`), or with ``block=False``
        raise :class:`Empty` at once."""
        if not block:
            outcome, item = self._get(self._actor().get_nowait.remote())
        else:
            _check_timeout(timeout, "get")
            outcome, item = self._get(self._actor().get.remote(timeout))
        if outcome == _EMPTY:
            raise Empty("the queue is empty" + (f" and stayed empty for {timeout} s"
                                                if block else ""))
        return item

    async def put_async(self, item: Any, block: bool = True,
                        timeout: float | None = None) -> None:
        """:meth:`put` for a coroutine: awaits the queue's actor without
        blocking the event loop."""
        if not block:
            outcome = await self._actor().put_nowait.remote(item)
        else:
            _check_timeout(timeout, "put_async")
            outcome = await self._actor().put.remote(item, timeout)
        if outcome == _FULL:
            raise Full(f"the queue is full ({self.maxsize} items)"
                       + (f" and stayed full for {timeout} s" if block else ""))

    async def get_async(self, block: bool = True, timeout: float | None = None) -> Any:
        """:meth:`get` for a coroutine: awaits the queue's actor without
        blocking the event loop."""
        if not block:
            outcome, item = await self._actor().get_nowait.remote()
        else:
            _check_timeout(timeout, "get_async")
            outcome, item = await self._actor().get.remote(timeout)
        if outcome == _EMPTY:
            raise Empty("the queue is empty" + (f" and stayed empty for {timeout} s"
                                                if block else ""))
        return item

    def put_nowait(self, item: Any) -> None:
        """``put(item, block=False)``."""
        self.put(item, block=False)

    def get_nowait(self) -> Any:
        """``get(block=False)``."""
        return self.get(block=False)

    def put_nowait_batch(self, items: Iterable[Any]) -> None:
        """Add all of ``items`` at once, or none of them (:class:`Full`)."""
        if not isinstance(items, Iterable):
            raise PMetalTypeError(f"Queue.put_nowait_batch takes an iterable of items, not "
                                  f"{type(items).__name__}")
        items = list(items)
        if self._get(self._actor().put_nowait_batch.remote(items)) == _FULL:
            raise Full(f"{len(items)} items do not fit in the queue (maxsize {self.maxsize})")

    def get_nowait_batch(self, num_items: int) -> list[Any]:
        """Take ``num_items`` items at once, or none (:class:`Empty` when
        fewer are in the queue)."""
        if type(num_items) is not int:
            raise PMetalTypeError(f"Queue.get_nowait_batch: num_items must be an int, not "
                                  f"{type(num_items).__name__}")
        if num_items < 0:
            raise PMetalValueError(f"Queue.get_nowait_batch: num_items={num_items}; it must "
                                   f"not be negative")
        outcome, items = self._get(self._actor().get_nowait_batch.remote(num_items))
        if outcome == _EMPTY:
            raise Empty(f"{num_items} items asked for, the queue holds {items}")
        return items

    def shutdown(self, force: bool = False, grace_period_s: float = 5) -> None:
        """End the queue's actor (its items are lost). pmetal kills it at
        once whatever ``force`` says: its calls in flight fail with
        ActorDiedError."""
        from pmetal.actors import context
        if self.actor is not None:
            actor, self.actor = self.actor, None
            context.current().kill(actor._actor_id, True, actor._node_id)
