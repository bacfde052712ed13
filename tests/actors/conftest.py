"""Fixtures for the actor runtime tests: a real cluster per test module.

Every test here runs real node daemons and worker processes on 127.0.0.1.
A module shares one ``pmetal.init(num_workers=NUM_WORKERS)`` (an embedded
node with pre-started workers) through the module-scoped ``cluster``
fixture; a module sets ``NUM_WORKERS`` to change the pool size.

Waiting on *other processes* (a process exiting, a node joining) has no
event to wait on from here, so :func:`wait_until` polls with short waits
under a deadline; everything else waits on results with
``pmetal.get(..., timeout=...)``.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

import pmetal
from pmetal import api, shm
from pmetal.config import load_config

from . import actor_classes

WAIT = 10.0
"""Deadline for results that should come at once on a quiet machine."""

EXIT_WAIT = 5.0
"""Deadline for processes to exit once they were told to (or killed)."""


# --------------------------------------------------------------- processes

def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.02,
               what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after
    ``timeout`` seconds with ``what`` in the message."""
    pause = threading.Event()
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        pause.wait(interval)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rpartition(")")[2].split()[0]
    return state not in ("Z", "X")


def parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[1])


def processes_matching(*needles: str) -> list[int]:
    """Live pids whose command line contains every one of ``needles``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        if all(n in cmdline for n in needles) and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def ancestors(pid: int) -> list[int]:
    """The parent of ``pid``, its parent, ... up to init."""
    out = []
    while pid > 1:
        pid = parent_pid(pid)
        out.append(pid)
    return out


def descendants(pid: int) -> list[int]:
    """Live processes descended from ``pid``: a node's workers, and the fork
    server that forks them (pmetal.node.zygote)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(parent_pid(int(entry.name)), []).append(int(entry.name))
            except (OSError, ValueError):  # gone meanwhile
                continue
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if pid_alive(child):
            found.append(child)
        todo.extend(children.get(child, []))
    return found


def assert_all_exit(pids: Iterable[int], timeout: float = EXIT_WAIT, what: str = "") -> None:
    pids = set(pids)
    try:
        wait_until(lambda: not any(pid_alive(p) for p in pids), timeout,
                   what=f"exit of {what or 'processes'} {sorted(pids)}")
    except AssertionError:
        alive = sorted(p for p in pids if pid_alive(p))
        raise AssertionError(f"{what or 'processes'} still running {timeout} s later: "
                             f"{alive}") from None


def shared_memory_objects(*pids: int) -> list[str]:
    """pmetal's POSIX shared-memory objects (large arrays in flight between
    processes of this machine) that processes ``pids`` created and that
    still exist."""
    return sorted(name[1:] for name in shm.objects(creators=pids))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_line(proc: subprocess.Popen[bytes], timeout: float, what: str) -> str:
    """The next line ``proc`` prints on stdout, waiting at most ``timeout``."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while not data.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                raise AssertionError(f"{what}: no line within {timeout} s (got {data!r})")
            chunk = os.read(fd, 1)
            if not chunk:
                raise AssertionError(f"{what}: exited with {proc.wait(EXIT_WAIT)} before "
                                     f"printing a line (got {data!r})")
            data += chunk
    return data.decode()


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM,
                 timeout: float = EXIT_WAIT) -> int | None:
    """Send ``sig``, wait for exit; SIGKILL if it does not go. Returns the
    exit code it had after ``sig`` (None when it had to be killed)."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(EXIT_WAIT)
        return None


# ------------------------------------------------------------------ cluster

def worker_import_root() -> str:
    """The folder that makes ``actor_classes`` importable under the name
    the test process gave it (workers need it for by-reference code)."""
    parts = actor_classes.__name__.count(".")
    return str(Path(actor_classes.__file__).resolve().parents[parts])


@pytest.fixture(scope="session", autouse=True)
def worker_pythonpath() -> Iterator[None]:
    """Node daemons and workers inherit the environment: give them the tests
    folder so they can import the test actor classes by reference."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (worker_import_root(), old) if p)
    yield
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def shutdown_quietly() -> None:
    """Shut the driver down; a small timeout keeps a slow node from eating
    the suite's budget (test_failures checks that shutdown is prompt)."""
    pmetal.shutdown(timeout=3.0)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """One embedded node for the whole module: ``pmetal.init(num_workers=N)``
    with the module's ``NUM_WORKERS`` and, for the driver, its ``TRANSPORT``
    settings (a dict of TransportConfig fields)."""
    if pmetal.is_initialized():
        shutdown_quietly()
    num_workers = getattr(request.module, "NUM_WORKERS", 2)
    config = load_config(transport=getattr(request.module, "TRANSPORT", {}))
    info = pmetal.init(num_workers=num_workers, config=config)
    try:
        yield info
    finally:
        shutdown_quietly()


@pytest.fixture
def reap() -> Iterator[list[Any]]:
    """A list to put short-lived actor handles in; they are killed after the
    test (when the driver can) so that each test leaves only the module's
    shared actors behind."""
    handles: list[Any] = []
    yield handles
    if not pmetal.is_initialized():
        return
    for handle in handles:
        try:
            pmetal.kill(handle)
        except pmetal.PMetalError:
            pass  # already dead, or the cluster went away with the test


def worker_of(handle: Any) -> dict[str, Any]:
    """The node's record of the worker process hosting ``handle``'s actor."""
    for worker in api.client().status()["workers"]:
        if worker["actor_id"] == handle._actor_id:
            return worker
    raise AssertionError(f"no worker hosts actor {handle!r}")


def actor_state(handle: Any) -> dict[str, Any]:
    for actor in api.client().status()["actors"]:
        if actor["actor_id"] == handle._actor_id:
            return actor
    raise AssertionError(f"the node does not know actor {handle!r}")


def await_restart(handle: Any, incarnation: int, timeout: float) -> None:
    """Wait until ``handle``'s actor is alive in ``incarnation``; a failure
    says what state the node last reported (and why)."""
    last: list[dict[str, Any]] = []

    def restarted() -> bool:
        last[:] = [actor_state(handle)]
        state = last[0]
        return state["state"] == "alive" and state["incarnation"] == incarnation

    try:
        wait_until(restarted, timeout, what=f"actor alive in incarnation {incarnation}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the node last reported {last[0] if last else None}; "
                             f"workers: {api.client().status()['workers']}") from None
