"""Tasks and actors for test_ray_surface and test_ray_util (importable, so
workers load them by reference)."""

from __future__ import annotations

import threading
from typing import Any

import pmetal


def _runtime_ids() -> dict[str, Any]:
    ctx = pmetal.get_runtime_context()
    return {**ctx.get(), "node_prop": str(ctx.node_id), "actor_prop": ctx.actor_id,
            "task_prop": ctx.task_id, "job_prop": ctx.job_id}


@pmetal.remote
def runtime_ids_in_a_task() -> dict[str, Any]:
    """The runtime context as a task sees it."""
    return _runtime_ids()


@pmetal.remote
class RuntimeIds:
    """The runtime context as an actor method sees it."""

    def ids(self) -> dict[str, Any]:
        return _runtime_ids()

    def me(self) -> Any:
        return pmetal.get_runtime_context().current_actor


@pmetal.remote
class AsyncRuntimeIds:
    """The same in an async actor, from a coroutine and a plain method."""

    async def ids(self) -> dict[str, Any]:
        return _runtime_ids()

    def plain_ids(self) -> dict[str, Any]:
        return _runtime_ids()


@pmetal.remote
class Doubler:
    """A pool actor: doubles, or waits for a gate first."""

    def double(self, x: int) -> int:
        return 2 * x

    def double_after(self, x: int, gate: Any, timeout: float = 10.0) -> int:
        pmetal.get(gate.wait.remote(x), timeout=timeout)
        return 2 * x


@pmetal.remote(max_concurrency=8)
class Gate:
    """Calls of ``wait(key)`` return once ``open(key)`` was called."""

    def __init__(self) -> None:
        self._events: dict[Any, threading.Event] = {}
        self._lock = threading.Lock()

    def _event(self, key: Any) -> threading.Event:
        with self._lock:
            return self._events.setdefault(key, threading.Event())

    def open(self, key: Any) -> None:
        self._event(key).set()

    def wait(self, key: Any, timeout: float = 10.0) -> bool:
        return self._event(key).wait(timeout)
