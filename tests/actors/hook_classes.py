"""What the worker_process_setup_hook tests run in workers (imported there
by reference)."""

from __future__ import annotations

import os

import pmetal

RUNS: list[str] = []   # one entry per run of a hook in this process


def record_run() -> None:
    RUNS.append(os.environ.get("HOOK_TAG", "no tag"))


def broken() -> None:
    raise OSError("the log folder is missing")


def current_runs() -> tuple[int, list[str]]:
    """This process's runs."""
    return os.getpid(), list(RUNS)


@pmetal.remote
def runs_here() -> tuple[int, list[str]]:
    # RUNS itself, not a copy: a wrapped task still travels by reference.
    return os.getpid(), list(RUNS)


@pmetal.remote
class Host:
    def runs_here(self) -> tuple[int, list[str]]:
        return current_runs()
