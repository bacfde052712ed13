"""Actors, functions and exceptions for tests/actors/test_ray_semantics.py
(importable, so workers load them by reference)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pmetal

WAIT = 10.0
"""How long a call waits for the others it must overlap with."""


class AppError(Exception):
    """Its __init__ takes other arguments than it passes on as args."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"[{code}] {text}")
        self.code = code
        self.text = text


class KeywordOnlyError(Exception):
    def __init__(self, *, reason: str) -> None:
        super().__init__()
        self.reason = reason


class HoldsALockError(Exception):
    """An attribute that cannot be pickled: the error still arrives as this class."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.lock = threading.Lock()


@pmetal.remote
def raise_holding_a_lock(what: str) -> None:
    raise HoldsALockError(what)


@pmetal.remote
def raise_app_error(code: int, text: str) -> None:
    raise AppError(code, text)


@pmetal.remote
class Raiser:
    def app(self, code: int, text: str) -> None:
        raise AppError(code, text)

    def keyword_only(self, reason: str) -> None:
        raise KeywordOnlyError(reason=reason)

    def through_a_task(self, code: int, text: str) -> None:
        pmetal.get(raise_app_error.remote(code, text), timeout=WAIT)   # lets it through


# ------------------------------------------------------------ concurrency

@pmetal.remote
class Meeting:
    """Each ``meet`` waits until ``parties`` calls have arrived; ``peak``
    is the most calls that ran at once."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.lock = threading.Lock()
        self.arrived = self.active = self.peak = 0
        self.all_here = threading.Event()

    def meet(self, i: int) -> int:
        with self.lock:
            self.arrived += 1
            self.active += 1
            self.peak = max(self.peak, self.active)
            if self.arrived >= self.parties:
                self.all_here.set()
        try:
            if not self.all_here.wait(WAIT):
                raise TimeoutError(f"only {self.arrived} of {self.parties} calls ran at once")
        finally:
            with self.lock:
                self.active -= 1
        return i

    def peak_seen(self) -> int:
        return self.peak


@pmetal.remote
class AsyncMeeting:
    """``Meeting`` for coroutines."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.arrived = self.active = self.peak = 0
        self.all_here: asyncio.Event | None = None

    async def meet(self, i: int) -> int:
        if self.all_here is None:
            self.all_here = asyncio.Event()
        self.arrived += 1
        self.active += 1
        self.peak = max(self.peak, self.active)
        if self.arrived >= self.parties:
            self.all_here.set()
        try:
            await asyncio.wait_for(self.all_here.wait(), WAIT)
        except TimeoutError:
            raise TimeoutError(f"only {self.arrived} of {self.parties} calls ran at once") from None
        finally:
            self.active -= 1
        return i

    async def peak_seen(self) -> int:
        return self.peak


# ---------------------------------------------------------------- retries

def _first_time(marker: str) -> bool:
    """True the first time it is called with ``marker`` (on this machine)."""
    try:
        Path(marker).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


@pmetal.remote
def exit_the_first_time(marker: str) -> str:
    if _first_time(marker):
        os._exit(3)   # the worker dies mid-task
    return "ran again"


@pmetal.remote
def fail_times(counter: str, times: int, error: str) -> int:
    """Raise ``error`` on the first ``times`` runs; count every run."""
    path = Path(counter)
    runs = (int(path.read_text()) if path.exists() else 0) + 1
    path.write_text(str(runs))
    if runs <= times:
        raise {"ValueError": ValueError, "KeyError": KeyError}[error](f"run {runs}")
    return runs


@pmetal.remote
class Fragile:
    def exit_the_first_time(self, marker: str) -> int:
        if _first_time(marker):
            os._exit(3)   # the actor's process dies mid-call
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()


# ----------------------------------------------------------------- arrays

@pmetal.remote
def echo_task(value: object) -> object:
    return value


@pmetal.remote
def array_kind(value: object) -> str:
    """What the worker received: 'numpy', 'mlx' or the type name."""
    module = type(value).__module__
    return "mlx" if module.startswith("mlx") else "numpy" if module == "numpy" else module


@pmetal.remote
class Holder:
    """Keeps the value its constructor got."""

    def __init__(self, value: object) -> None:
        self.value = value

    def get(self) -> object:
        return self.value
