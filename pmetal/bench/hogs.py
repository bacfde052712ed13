"""CPU hogs for the under-load measurement of ``pmetal bench pipeline``.

A hog is a child process that spins in a Python busy loop: it takes a core
whenever the scheduler gives it one, as another engineer's test run would.
:func:`cpu_hogs` owns them: it starts each in a session of its own and, on
leaving, kills each session and reaps the process, whatever ended the
block (an exception, Ctrl-C).

Two further guards cover the case where the bench itself dies without
running its ``finally`` (SIGKILL, a crash): a hog ends by itself at its
deadline, and as soon as its parent is gone (it checks the parent's pid
between million-iteration spins, a few milliseconds apart).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

from pmetal.errors import ConfigError

__all__ = ["HOG_DEADLINE", "alive", "cpu_hogs", "hog_code"]

HOG_DEADLINE = 900.0  # seconds a hog lives at most, should nothing kill it


def hog_code(parent: int, deadline: float) -> str:
    """The program a hog runs: spin until ``deadline`` seconds have passed
    or ``parent`` is no longer its parent."""
    return ("import os, time\n"
            f"end = time.monotonic() + {deadline!r}\n"
            f"while os.getppid() == {parent} and time.monotonic() < end:\n"
            "    for _ in range(1_000_000):\n"
            "        pass\n")


@contextlib.contextmanager
def cpu_hogs(count: int, *, deadline: float = HOG_DEADLINE) -> Iterator[list[int]]:
    """``count`` busy-loop processes for the duration of the block; yields
    their pids. Every hog is killed and reaped when the block ends."""
    if count < 0 or deadline <= 0:
        raise ConfigError(f"{count} hogs for {deadline} s: need 0 or more, a positive deadline")
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            hogs.append(subprocess.Popen(
                [sys.executable, "-c", hog_code(os.getpid(), deadline)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))
        yield [h.pid for h in hogs]
    finally:
        for hog in hogs:
            with contextlib.suppress(ProcessLookupError):  # gone already: its deadline
                os.killpg(hog.pid, signal.SIGKILL)   # its session: the hog and anything it made
        for hog in hogs:
            hog.wait()


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie is not); tests check
    by pid that no hog outlived the bench."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
