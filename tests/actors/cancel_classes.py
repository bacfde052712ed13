"""Tasks and actors for tests/actors/test_cancel.py (importable, so workers
load them by reference). They block on files the test creates: the test
decides when they go on, without sleeps."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pmetal

WAIT = 10.0
"""How long a blocked call waits for its file before giving up."""


def _wait_for(path: str) -> None:
    pause = threading.Event()
    for _ in range(int(WAIT / 0.01)):
        if Path(path).exists():
            return
        pause.wait(0.01)
    raise TimeoutError(f"{path} was not created within {WAIT} s")


@pmetal.remote
def wait_for_file(path: str, value: Any = None) -> Any:
    """Block until ``path`` exists, then return ``value``."""
    _wait_for(path)
    return value


@pmetal.remote
def touch(_after: Any, path: str) -> str:
    """Create ``path`` (the proof that this task ran)."""
    Path(path).write_text("ran")
    return path


@pmetal.remote
def pair(x: int) -> tuple[int, int]:
    return x, x + 1


@pmetal.remote
def plus_one(x: int) -> int:
    return x + 1


@pmetal.remote
class Recorder:
    """Records the calls it runs, in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def record(self, _after: Any, what: str) -> str:
        self.seen.append(what)
        return what

    def log(self) -> list[str]:
        return list(self.seen)


@pmetal.remote
class AsyncSleeper:
    """An async actor whose ``block`` waits for a file and notes being cancelled."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def block(self, started: str, gate: str) -> str:
        import asyncio
        Path(started).write_text("started")
        try:
            for _ in range(int(WAIT / 0.01)):
                if Path(gate).exists():
                    return "finished"
                await asyncio.sleep(0.01)
            return "gave up"
        except asyncio.CancelledError:
            self.cancelled.append(started)
            raise

    async def seen(self) -> list[str]:
        return list(self.cancelled)


@pmetal.remote
def note_pid_and_block(started: str, gate: str) -> str:
    """Write this worker's pid to ``started``, then block until ``gate`` exists."""
    import os
    Path(started).write_text(str(os.getpid()))
    _wait_for(gate)
    return "finished"


@pmetal.remote(max_concurrency=2)
class Watcher:
    """Threaded: its sync methods run in threads and poll is_canceled()."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def until_cancelled(self, started: str) -> str:
        Path(started).touch()
        pause = threading.Event()
        for _ in range(int(WAIT / 0.01)):
            if pmetal.get_runtime_context().is_canceled():
                self.seen.append("cancelled")
                return "saw it"
            pause.wait(0.01)
        self.seen.append("timed out")
        return "never saw it"

    def quick(self) -> bool:
        return pmetal.get_runtime_context().is_canceled()

    def outcomes(self) -> list[str]:
        return list(self.seen)


@pmetal.remote
def canceled_in_a_task() -> bool:
    return pmetal.get_runtime_context().is_canceled()
