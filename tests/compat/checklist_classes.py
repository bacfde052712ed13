"""Tasks and actors for test_ray_checklist (importable, so workers load them
by reference). Written the way a Ray user writes them: plain
``@pmetal.remote`` code, nothing pmetal-specific beyond the import."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pmetal

WAIT = 10.0
"""How long a call waits for the others it must overlap with."""


# ------------------------------------------------------------------ tasks

@pmetal.remote
def echo(x: Any) -> Any:
    return x


@pmetal.remote
def add(a: int, b: int) -> int:
    return a + b


@pmetal.remote(num_returns=3)
def three() -> tuple[int, int, int]:
    return 0, 1, 2


@pmetal.remote
def fail(message: str) -> None:
    raise ValueError(message)


@pmetal.remote
def is_a_ref(x: Any) -> bool:
    return isinstance(x, pmetal.ObjectRef)


@pmetal.remote
def meet(meeting: Any, n: int, timeout: float = WAIT) -> bool:
    """Returns once ``n`` callers met: only if they run at the same time."""
    return pmetal.get(meeting.arrive.remote(n, timeout), timeout=timeout + WAIT)


@pmetal.remote
def wait_for(gate: Any, key: Any) -> Any:
    pmetal.get(gate.wait.remote(key), timeout=WAIT)
    return key


@pmetal.remote
def signal_then_sleep(gate: Any, key: Any, seconds: float) -> None:
    pmetal.get(gate.open.remote(key), timeout=WAIT)
    time.sleep(seconds)


@pmetal.remote(max_retries=0)
def exit_process() -> None:
    os._exit(1)


@pmetal.remote(max_retries=2)
def exit_the_first_time(marker: str) -> str:
    """Kills its own worker on the first run; a retry finds the marker."""
    path = Path(marker)
    if not path.exists():
        path.write_text("ran once")
        os._exit(1)
    return "second run"


class Flaky(Exception):
    pass


@pmetal.remote(max_retries=2, retry_exceptions=[Flaky])
def flaky_once(marker: str) -> str:
    path = Path(marker)
    if not path.exists():
        path.write_text("failed once")
        raise Flaky("first run")
    return "retried"


@pmetal.remote
def env_var(name: str) -> str | None:
    return os.environ.get(name)


@pmetal.remote
def read_file(name: str) -> str:
    return Path(name).read_text()


@pmetal.remote
def call_counter(counter: Any, n: int) -> list[int]:
    return pmetal.get([counter.increment.remote() for _ in range(n)], timeout=WAIT)


@pmetal.remote
def runtime_ids() -> dict[str, Any]:
    ctx = pmetal.get_runtime_context()
    return {"job": str(ctx.get_job_id()), "node": str(ctx.get_node_id()),
            "task": str(ctx.get_task_id()), "actor": ctx.get_actor_id()}


@pmetal.remote
def make_and_return_a_ref(value: Any) -> Any:
    return pmetal.put(value)


@pmetal.remote
def get_the_nested(refs: list[Any]) -> list[Any]:
    return pmetal.get(refs, timeout=WAIT)


@pmetal.remote
def count_up(n: int) -> Any:
    yield from range(n)


@pmetal.remote
def slow_count(n: int, pause: float) -> Any:
    for i in range(n):
        time.sleep(pause)
        yield i


@pmetal.remote
def yield_then_wait(gate: Any) -> Any:
    yield "first"
    pmetal.get(gate.wait.remote("rest"), timeout=WAIT)
    yield "second"


@pmetal.remote
def yield_then_fail() -> Any:
    yield 0
    raise ValueError("in the generator")


@pmetal.remote
def node_of_task() -> str:
    return str(pmetal.get_runtime_context().get_node_id())


# ----------------------------------------------------------------- actors

@pmetal.remote
class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self) -> int:
        self.value += 1
        return self.value

    def fail(self) -> None:
        raise KeyError("in a method")

    def pid(self) -> int:
        return os.getpid()

    def ids(self) -> dict[str, Any]:
        ctx = pmetal.get_runtime_context()
        return {"job": str(ctx.get_job_id()), "actor": str(ctx.get_actor_id()),
                "task": str(ctx.get_task_id())}

    def me(self) -> Any:
        return pmetal.get_runtime_context().current_actor

    def node(self) -> str:
        return str(pmetal.get_runtime_context().get_node_id())

    @pmetal.method(num_returns=2)
    def pair(self) -> tuple[int, int]:
        return self.value, -self.value

    def keep(self, refs: list[Any]) -> None:
        self.kept = refs

    def read_kept(self) -> list[Any]:
        return pmetal.get(self.kept, timeout=WAIT)

    def put_nested(self, value: Any) -> list[Any]:
        return [pmetal.put(value)]

    def stream(self, n: int) -> Any:
        yield from range(n)


@pmetal.remote
class Parent:
    """Creates a child actor, which it owns."""

    def child(self) -> Any:
        self.kept = Counter.remote()
        return self.kept


@pmetal.remote
class Canceller:
    """A sync actor whose method polls for its own cancellation."""

    def __init__(self) -> None:
        self.outcome = "did not run"

    def until_cancelled(self) -> str:
        deadline = time.monotonic() + WAIT
        self.outcome = "never saw it"
        while time.monotonic() < deadline:
            if pmetal.get_runtime_context().is_canceled():
                self.outcome = "saw it"
                break
            time.sleep(0.01)
        return self.outcome

    def last_outcome(self) -> str:
        return self.outcome


@pmetal.remote(max_restarts=1, max_task_retries=1)
class Phoenix:
    """Dies in ``die_once`` the first time; its restart reruns the constructor."""

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)
        self.calls = 0
        self.boots = int(self.marker.read_text()) + 1 if self.marker.exists() else 1
        self.marker.write_text(str(self.boots))

    def die_once(self) -> int:
        if self.boots == 1:
            os._exit(1)
        return self.boots

    def count(self) -> int:
        self.calls += 1
        return self.calls


@pmetal.remote
class Meeting:
    """Async actor: ``arrive(n)`` returns once ``n`` callers are inside."""

    def __init__(self) -> None:
        self.arrived = 0
        self.everyone = asyncio.Event()

    async def arrive(self, n: int, timeout: float = WAIT) -> bool:
        self.arrived += 1
        if self.arrived >= n:
            self.everyone.set()
        await asyncio.wait_for(self.everyone.wait(), timeout)
        return True


@pmetal.remote(max_concurrency=3)
class ThreadedMeeting:
    """Plain methods in 3 threads: ``arrive`` returns once 3 are inside."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(3, timeout=WAIT)

    def arrive(self) -> int:
        return self.barrier.wait()


@pmetal.remote
class AsyncBuilt:
    """Its constructor is a coroutine (Ray runs it on the actor's loop)."""

    async def __init__(self, value: int) -> None:
        await asyncio.sleep(0)
        self.value = value

    async def get(self) -> int:
        return self.value


@pmetal.remote(max_concurrency=8)
class Gate:
    """``wait(key)`` returns once ``open(key)`` was called (or after ``WAIT``)."""

    def __init__(self) -> None:
        self._events: dict[Any, threading.Event] = {}
        self._lock = threading.Lock()

    def _event(self, key: Any) -> threading.Event:
        with self._lock:
            return self._events.setdefault(key, threading.Event())

    def open(self, key: Any) -> None:
        self._event(key).set()

    def wait(self, key: Any) -> bool:
        return self._event(key).wait(WAIT)


@pmetal.remote
class Sleeper:
    """An async actor whose ``nap`` notes whether it was cancelled."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()

    async def nap(self) -> str:
        self.started.set()
        try:
            await asyncio.sleep(WAIT)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return "slept"

    async def wait_started(self) -> bool:
        await asyncio.wait_for(self.started.wait(), WAIT)
        return True

    async def was_cancelled(self) -> bool:
        await asyncio.wait_for(self.cancelled.wait(), WAIT)
        return True
