"""Ray's ``ray.util.ActorPool``: spread work over a fixed set of actors.

Each actor runs one submitted call at a time: ``submit`` hands the value to
an idle actor, or queues it until one is returned to the pool (when its
result is taken with ``get_next`` or ``get_next_unordered``). The semantics
are Ray's, including its quirks: ``map`` first discards the results of
earlier submissions, ``get_next`` returns results in submission order and
may not be used after ``get_next_unordered``, and a result is taken (its
actor returned to the pool) before it is fetched, so a call that raised
still frees its actor::

    pool = ActorPool([Worker.remote() for _ in range(4)])
    for out in pool.map(lambda actor, v: actor.work.remote(v), range(100)):
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pmetal.actors.handles import ActorHandle
from pmetal.actors.refs import ObjectRef
from pmetal.errors import GetTimeoutError, PMetalTypeError, PMetalValueError
from pmetal.util import _refs

__all__ = ["ActorPool"]

Submit = Callable[[Any, Any], ObjectRef]
"""``fn(actor, value)``: start one call on ``actor`` and return its ref."""


class ActorPool:
    """A pool of actors that takes work through ``submit`` or ``map``."""

    def __init__(self, actors: Iterable[ActorHandle]) -> None:
        actors = list(actors)
        bad = next((a for a in actors if not isinstance(a, ActorHandle)), None)
        if bad is not None:
            raise PMetalTypeError(f"ActorPool takes actor handles, not {type(bad).__name__}")
        self._idle_actors: list[ActorHandle] = actors
        self._future_to_actor: dict[ObjectRef, tuple[int, ActorHandle]] = {}
        self._index_to_future: dict[int, ObjectRef] = {}
        self._next_task_index = 0
        self._next_return_index = 0
        self._pending_submits: list[tuple[Submit, Any]] = []

    # ---------------------------------------------------------------- map

    def map(self, fn: Submit, values: Iterable[Any]) -> Iterator[Any]:
        """Submit ``fn(actor, v)`` for every value; yield the results in the
        order of ``values``. Results of earlier submissions not taken yet are
        discarded first (as in Ray)."""
        self._discard_pending_results()
        for v in values:
            self.submit(fn, v)
        return self._results(self.get_next)

    def map_unordered(self, fn: Submit, values: Iterable[Any]) -> Iterator[Any]:
        """As :meth:`map`, but yield each result as soon as it is ready."""
        self._discard_pending_results()
        for v in values:
            self.submit(fn, v)
        return self._results(self.get_next_unordered)

    def _results(self, take: Callable[[], Any]) -> Iterator[Any]:
        while self.has_next():
            yield take()

    def _discard_pending_results(self) -> None:
        self._pending_submits.clear()
        for index in sorted(self._index_to_future):
            _, actor = self._future_to_actor.pop(self._index_to_future.pop(index))
            self._idle_actors.append(actor)
        self._next_return_index = self._next_task_index

    # ------------------------------------------------------------- submit

    def submit(self, fn: Submit, value: Any) -> None:
        """Run ``fn(actor, value)`` on an idle actor, or once one is free.
        ``fn`` must return the ObjectRef of the call it started."""
        if not callable(fn):
            raise PMetalTypeError(f"ActorPool.submit: fn must be callable (actor, value) -> "
                                  f"ObjectRef, not {type(fn).__name__}")
        if not self._idle_actors:
            self._pending_submits.append((fn, value))
            return
        actor = self._idle_actors.pop()
        future = fn(actor, value)
        if not isinstance(future, ObjectRef):
            self._idle_actors.append(actor)
            raise PMetalTypeError(f"ActorPool: fn(actor, value) must return the ObjectRef of a "
                                  f"call (actor.method.remote(value)), not "
                                  f"{type(future).__name__}")
        self._future_to_actor[future] = (self._next_task_index, actor)
        self._index_to_future[self._next_task_index] = future
        self._next_task_index += 1

    def has_next(self) -> bool:
        """Whether a submitted call's result has not been taken yet."""
        return bool(self._future_to_actor)

    def get_next(self, timeout: float | None = None, ignore_if_timedout: bool = False) -> Any:
        """The result of the oldest submission not taken yet, waiting up to
        ``timeout`` seconds (GetTimeoutError, also the builtin TimeoutError).
        With ``ignore_if_timedout`` a timed-out submission is given up (its
        actor returns to the pool) before the error is raised."""
        if not self.has_next():
            raise StopIteration("ActorPool.get_next: no more results to get")
        if self._next_return_index >= self._next_task_index:
            raise PMetalValueError("ActorPool.get_next() cannot follow get_next_unordered(); "
                                   "take the rest with get_next_unordered()")
        future = self._index_to_future[self._next_return_index]
        timed_out = False
        if timeout is not None:
            ready, _ = _refs.wait([future], 1, timeout)
            if not ready:
                if not ignore_if_timedout:
                    raise GetTimeoutError(f"ActorPool.get_next: no result within {timeout} s")
                timed_out = True
        del self._index_to_future[self._next_return_index]
        self._next_return_index += 1
        _, actor = self._future_to_actor.pop(future)
        self._return_actor(actor)
        if timed_out:
            raise GetTimeoutError(f"ActorPool.get_next: no result within {timeout} s; the "
                                  f"submission was given up")
        return _refs.get(future)

    def get_next_unordered(self, timeout: float | None = None,
                           ignore_if_timedout: bool = False) -> Any:
        """The first result that is ready, of any submission not taken yet
        (GetTimeoutError after ``timeout`` seconds). With
        ``ignore_if_timedout`` the oldest submission is given up first."""
        if not self.has_next():
            raise StopIteration("ActorPool.get_next_unordered: no more results to get")
        ready, _ = _refs.wait(list(self._future_to_actor), 1, timeout)
        if ready:
            future, timed_out = ready[0], False
        elif ignore_if_timedout:
            future, timed_out = self._index_to_future[min(self._index_to_future)], True
        else:
            raise GetTimeoutError(f"ActorPool.get_next_unordered: no result within {timeout} s")
        index, actor = self._future_to_actor.pop(future)
        del self._index_to_future[index]
        self._next_return_index = max(self._next_return_index, index + 1)
        self._return_actor(actor)
        if timed_out:
            raise GetTimeoutError(f"ActorPool.get_next_unordered: no result within {timeout} "
                                  f"s; the oldest submission was given up")
        return _refs.get(future)

    # ------------------------------------------------------------- actors

    def _return_actor(self, actor: ActorHandle) -> None:
        self._idle_actors.append(actor)
        if self._pending_submits:
            self.submit(*self._pending_submits.pop(0))

    def has_free(self) -> bool:
        """Whether an actor is idle and no submission waits for one."""
        return bool(self._idle_actors) and not self._pending_submits

    def pop_idle(self) -> ActorHandle | None:
        """Take an idle actor out of the pool (None when none is free)."""
        return self._idle_actors.pop() if self.has_free() else None

    def push(self, actor: ActorHandle) -> None:
        """Add ``actor`` to the pool (a waiting submission starts on it)."""
        if not isinstance(actor, ActorHandle):
            raise PMetalTypeError(f"ActorPool.push takes an actor handle, not "
                                  f"{type(actor).__name__}")
        busy = [a for _, a in self._future_to_actor.values()]
        if actor in self._idle_actors or actor in busy:
            raise PMetalValueError(f"ActorPool.push: {actor!r} already belongs to this pool")
        self._return_actor(actor)
