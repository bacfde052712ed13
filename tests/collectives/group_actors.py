"""Actor classes of the collective group tests (workers import them by
reference, so they live in a module of their own)."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import numpy as np

import pmetal
from pmetal import collective

WAIT = 20.0
"""Deadline for anything an actor waits for that the test controls."""


@pmetal.remote(max_concurrency=2)
class Member:
    """A member of collective groups. Two calls run at once, so the test
    can ask whether a long operation has started while it runs."""

    def __init__(self) -> None:
        self.progress = threading.Event()
        self.kept: Any = None

    def pid(self) -> int:
        return os.getpid()

    def join(self, name: str) -> tuple[int, int, int]:
        group = collective.get_group(name)
        return group.rank, group.size, group.epoch

    def all_reduce(self, name: str, value: np.ndarray, op: str = "sum") -> np.ndarray:
        group = collective.get_group(name)
        x = np.array(value) * (group.rank + 1)
        result = group.all_reduce(x, op=op)
        assert result is x   # numpy arrays are reduced in place
        return x

    def broadcast(self, name: str, root: int) -> np.ndarray:
        group = collective.get_group(name)
        return group.broadcast(np.full(6, float(group.rank)), root=root)

    def all_gather(self, name: str) -> np.ndarray:
        group = collective.get_group(name)
        return group.all_gather(np.arange(3, dtype=np.int64) + 10 * group.rank)

    def spin(self, name: str, n_elements: int, rounds: int) -> int:
        """All_reduce ``rounds`` times (every rank the same count), setting
        ``progress`` after the first; a failure raises to the caller."""
        group = collective.get_group(name)
        x = np.ones(n_elements, np.float32)
        for done in range(rounds):
            group.all_reduce(x)
            x[:] = 1.0
            self.progress.set()
        return rounds

    def started(self) -> bool:
        return self.progress.wait(WAIT)

    def statistics(self, name: str) -> Any:
        return collective.get_group(name).statistics()

    def keep(self, name: str) -> int:
        self.kept = collective.get_group(name)
        return int(self.kept.epoch)

    def use_kept(self) -> np.ndarray:
        return self.kept.all_reduce(np.ones(4))


@pmetal.remote
class AsyncMember:
    """An async actor: get_group and the operations block, so they run in a
    thread and the actor's event loop stays free."""

    async def all_reduce(self, name: str, value: np.ndarray, op: str = "sum") -> np.ndarray:
        group = await asyncio.to_thread(collective.get_group, name)
        x = np.array(value) * (group.rank + 1)
        await asyncio.to_thread(group.all_reduce, x, op)
        return x
