"""Actor classes and remote functions the runtime tests use.

They live in an importable module (workers get its folder on their
``PYTHONPATH`` from the tests' conftest), so they exercise the
by-reference path; tests define local classes where by-value shipping is
the point.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pmetal

WAIT = 10.0
"""Deadline for anything an actor waits for that the test controls."""


class CustomError(Exception):
    """A user exception with extra state, to check it survives the trip."""

    def __init__(self, code: int) -> None:
        super().__init__(f"custom failure {code}")
        self.code = code


def raise_value_error(message: str) -> None:
    raise ValueError(message)


@pmetal.remote
class Counter:
    """A plain synchronous actor with some state."""

    def __init__(self, start: int = 0) -> None:
        self.n = start
        self.log: list[Any] = []

    def inc(self, k: int = 1) -> int:
        self.n += k
        return self.n

    def value(self) -> int:
        return self.n

    def record(self, item: Any) -> int:
        self.log.append(item)
        return len(self.log)

    def history(self) -> list[Any]:
        return self.log

    def echo(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            return args, kwargs
        return args[0] if len(args) == 1 else args

    def pid(self) -> int:
        return os.getpid()

    def boom(self, message: str = "bad value") -> None:
        raise_value_error(message)

    def fail_custom(self, code: int) -> None:
        raise CustomError(code)

    def block(self, seconds: float) -> str:
        """Stay busy for ``seconds`` (a stand-in for a long computation)."""
        threading.Event().wait(seconds)
        return "unblocked"

    def unpicklable_result(self) -> Any:
        return threading.Lock()

    def call(self, handle: Any, method: str, *args: Any) -> Any:
        """Call another actor through a handle this actor was given."""
        return pmetal.get(getattr(handle, method).remote(*args), timeout=WAIT)

    def call_many(self, handle: Any, method: str, items: list[Any]) -> list[Any]:
        refs = [getattr(handle, method).remote(i) for i in items]
        return pmetal.get(refs, timeout=WAIT)

    def run_function(self, x: int) -> int:
        """Run a remote function from inside an actor."""
        return pmetal.get(square.remote(x), timeout=WAIT)

    def code_origin(self) -> dict[str, Any]:
        """Whether this instance's class is the one its module defines."""
        import importlib
        cls = type(self)
        module = importlib.import_module(cls.__module__)
        defined = getattr(module, cls.__qualname__, None)
        defined = getattr(defined, "__wrapped__", defined)
        return {"module": cls.__module__, "same_class": defined is cls}


@pmetal.remote
class Gate:
    """An async actor: ``wait(key)`` returns once ``open(key)`` was called."""

    def __init__(self) -> None:
        self.events: dict[str, asyncio.Event] = {}
        self.waiting: dict[str, int] = {}

    def _event(self, key: str) -> asyncio.Event:
        return self.events.setdefault(key, asyncio.Event())

    async def wait(self, key: str, result: Any = None) -> Any:
        self.waiting[key] = self.waiting.get(key, 0) + 1
        try:
            await asyncio.wait_for(self._event(key).wait(), WAIT)
        finally:
            self.waiting[key] -= 1
        return key if result is None else result

    async def waiters(self, key: str) -> int:
        return self.waiting.get(key, 0)

    async def open(self, key: str) -> bool:
        self._event(key).set()
        return True

    async def pid(self) -> int:
        return os.getpid()

    async def boom(self, message: str) -> None:
        await asyncio.sleep(0)
        raise KeyError(message)

    def sync_method(self, x: int) -> int:
        return x + 1


@pmetal.remote
class Proxy:
    """An async actor that awaits other actors' ObjectRefs."""

    async def through(self, handle: Any, method: str, *args: Any) -> Any:
        return await getattr(handle, method).remote(*args)


@pmetal.remote(max_concurrency=2)
class Threaded:
    """A sync actor whose methods run in two threads at once."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=WAIT)

    def meet(self, i: int) -> int:
        self.barrier.wait()
        return i


@pmetal.remote
class BadInit:
    def __init__(self, message: str) -> None:
        raise_value_error(message)

    def never(self) -> None:
        """Never reached: the constructor fails."""


@pmetal.remote
class ExitInit:
    """A constructor that ends its process (a crash in native code, a
    library calling exit)."""

    def __init__(self, code: int) -> None:
        os._exit(code)

    def never(self) -> None:
        """Never reached."""


@pmetal.remote
def square(x: int) -> int:
    return x * x


@pmetal.remote
def fail(message: str) -> None:
    raise_value_error(message)


@pmetal.remote
def worker_pid() -> int:
    return os.getpid()


@pmetal.remote
def pause(seconds: float) -> int:
    """Keep a task worker busy for ``seconds``; returns its pid."""
    threading.Event().wait(seconds)
    return os.getpid()


@pmetal.remote
def wait_at(gate: Any, key: str) -> int:
    """Keep a task worker busy until ``gate.open(key)``; returns its pid."""
    pmetal.get(gate.wait.remote(key), timeout=WAIT)
    return os.getpid()


@pmetal.remote
def call_actor(handle: Any, k: int) -> int:
    return pmetal.get(handle.inc.remote(k), timeout=WAIT)


@pmetal.remote
def nested(x: int, timeout: float = WAIT) -> int:
    """A remote function that runs another remote function."""
    return pmetal.get(square.remote(x), timeout=timeout) + 1


@pmetal.remote
class Parent:
    """An actor that creates an actor of its own (it owns it: the child
    ends when this actor's process does)."""

    def make_child(self, start: int = 0) -> Any:
        return Counter.remote(start)

    def pid(self) -> int:
        return os.getpid()


@pmetal.remote(max_restarts=1, max_task_retries=1)
class SlowRestart:
    """An actor whose restart takes ``delay`` seconds: its constructor
    finds the marker file its first incarnation left. A call its death
    failed is sent again to the restarted actor."""

    def __init__(self, marker: str, delay: float) -> None:
        if os.path.exists(marker):
            threading.Event().wait(delay)
        else:
            open(marker, "w").close()

    def pid(self) -> int:
        return os.getpid()
