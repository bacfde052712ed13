"""Tasks and actors for tests/actors/test_ownership*.py (importable, so
workers load them by reference): they receive, keep, pass on, create and
return ObjectRefs inside values."""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
from typing import Any

import pmetal
from pmetal.actors import context

WAIT = 10.0


@dataclasses.dataclass
class Box:
    """A user object holding a ref."""

    label: str
    ref: Any


def describe(value: Any) -> Any:
    """What arrived: refs as ("ref", done?), containers walked."""
    if isinstance(value, pmetal.ObjectRef):
        return "ref"
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {k: describe(v) for k, v in value.items()}
    if isinstance(value, Box):
        return {"label": value.label, "ref": describe(value.ref)}
    return value


def resolve(value: Any) -> Any:
    """``value`` with every ref in it replaced by its value (pmetal.get)."""
    if isinstance(value, pmetal.ObjectRef):
        return pmetal.get(value, timeout=WAIT)
    if isinstance(value, (list, tuple)):
        return [resolve(v) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v) for k, v in value.items()}
    if isinstance(value, Box):
        return {"label": value.label, "ref": resolve(value.ref)}
    return value


def ownership() -> dict[str, int]:
    """This process's ownership tables, after a garbage collection and once
    its queued releases have gone out."""
    gc.collect()
    objects = context.current().objects
    objects.settled(WAIT)
    stats = objects.statistics()
    return {"owned": stats.owned, "borrowed": stats.borrowed, "freed": stats.freed,
            "rss": rss(), "objects": len(gc.get_objects()), "blocks": sys.getallocatedblocks()}


def rss() -> int:
    """This process's resident memory in bytes (/proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pmetal.remote
class Holder:
    """Receives refs, keeps them, passes them on."""

    def __init__(self) -> None:
        self.kept: Any = None

    def pid(self) -> int:
        return os.getpid()

    def describe(self, *args: Any, **kwargs: Any) -> Any:
        return {"args": describe(list(args)), "kwargs": describe(kwargs)}

    def resolve(self, value: Any) -> Any:
        return resolve(value)

    def get_list(self, value: list[Any]) -> list[Any]:
        return pmetal.get(value, timeout=WAIT)

    def keep(self, value: Any) -> int:
        self.kept = value
        return len(value) if isinstance(value, list) else 1

    def resolve_kept(self) -> Any:
        return resolve(self.kept)

    def drop(self) -> None:
        self.kept = None

    def give_kept(self) -> Any:
        return self.kept

    def pass_on(self, value: Any, other: Any, timeout: float = WAIT) -> int:
        """Hand ``value`` (refs inside) to actor ``other`` to keep, and
        forget it here."""
        return pmetal.get(other.keep.remote(value), timeout=timeout)

    def pass_kept(self, other: Any) -> int:
        """Hand what this actor keeps to actor ``other`` to keep too."""
        return pmetal.get(other.keep.remote(self.kept), timeout=WAIT)

    def relay(self, value: Any, other: Any) -> Any:
        """Ask ``other`` to resolve ``value`` (a chain of borrowers)."""
        return pmetal.get(other.resolve.remote(value), timeout=WAIT)

    def make(self, value: Any) -> list[Any]:
        """Refs owned by this process, inside a value."""
        return [pmetal.put(value)]

    def make_array(self, n: int) -> list[Any]:
        import numpy as np
        return [pmetal.put(np.arange(n, dtype=np.float64))]

    def try_get(self, value: list[Any], timeout: float) -> str:
        try:
            return repr(pmetal.get(value[0], timeout=timeout))
        except pmetal.GetTimeoutError:
            return "timeout"

    def cancel(self, value: list[Any]) -> str:
        try:
            pmetal.cancel(value[0])
        except pmetal.PMetalError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "cancelled"

    def wait_ready(self, value: list[Any], timeout: float) -> int:
        ready, _ = pmetal.wait(value, num_returns=len(value), timeout=timeout)
        return len(ready)

    def ownership(self) -> dict[str, int]:
        return ownership()


@pmetal.remote
class AsyncHolder:
    """An async actor: refs in and out of coroutines."""

    async def make(self, value: Any) -> list[Any]:
        return [pmetal.put(value)]

    async def resolve(self, value: list[Any]) -> list[Any]:
        return [await ref for ref in value]


@pmetal.remote
def make_and_return(received: list[Any]) -> list[Any]:
    """A task returning a ref it created and one it received."""
    return [pmetal.put(7), received[0]]


@pmetal.remote
def add_one(value: list[Any]) -> int:
    return pmetal.get(value[0], timeout=WAIT) + 1
