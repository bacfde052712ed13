"""A new user's misuse gets a specific error at once, and nothing is left
running: settings given to ``pmetal.init`` are all kept, a call after
``pmetal.shutdown()`` says so, a call to an actor whose creator died says
that it died."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import pmetal
from pmetal import api
from pmetal.config import load_config

from . import actor_classes
from .conftest import WAIT, assert_all_exit, shutdown_quietly, worker_of


def _node_config(pid: int) -> object:
    """The config the node process ``pid`` loads from its environment."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().partition("=")[::2] for item in raw if item)
    return load_config(env=env)


def test_init_with_config_and_namespace_keeps_every_setting() -> None:
    if pmetal.is_initialized():
        shutdown_quietly()
    # One non-default value in every section.
    cfg = load_config(env={}, transport={"request_timeout": 7.5},
                      actors={"owner_lease": 12.0},
                      health={"dead_after": 1.7, "suspect_after": 1.1},
                      election={"timeout": 1.3}, discovery={"interfaces": "127.0.0.9"},
                      collectives={"timeout": 11.0, "strategy": "ring"},
                      security={"bulk_auth": False})
    want = dataclasses.replace(cfg, security=dataclasses.replace(cfg.security,
                                                                 namespace="misuse-ns"))
    pmetal.init(config=cfg, namespace="misuse-ns")
    try:
        client = api.client()
        assert client.config == want
        assert client.status()["namespace"] == "misuse-ns"
        # The embedded node runs with the same settings.
        node = _node_config(client.status()["pid"])
        for section in ("transport", "actors", "health", "election", "collectives"):
            assert getattr(node, section) == getattr(want, section), section
        assert node.security.bulk_auth is False
    finally:
        shutdown_quietly()


# ------------------------------------------------------------- shutdown

def test_a_call_after_shutdown_raises_at_once_and_starts_nothing() -> None:
    if pmetal.is_initialized():
        shutdown_quietly()
    pmetal.init(num_workers=1)
    counter = actor_classes.Counter.remote(3)
    assert pmetal.get(counter.value.remote(), timeout=WAIT) == 3
    shutdown_quietly()
    started = time.monotonic()
    with pytest.raises(pmetal.NotInitializedError, match="pmetal is shut down.*pmetal.init"):
        counter.value.remote()
    assert time.monotonic() - started < 1.0
    # No node was started for it (auto-init would have made one).
    assert not pmetal.is_initialized() and api._node_proc is None
    # In a new session the old handle's actor is gone (it ended with its
    # session): ActorDiedError, not a wait on an address nobody serves.
    pmetal.init(num_workers=1)
    try:
        started = time.monotonic()
        with pytest.raises(pmetal.ActorDiedError):
            pmetal.get(counter.value.remote(), timeout=WAIT)
        assert time.monotonic() - started < WAIT / 2
    finally:
        shutdown_quietly()


# ------------------------------------------------------ owner's death

def _pid_of(handle: object) -> int:
    return int(worker_of(handle)["pid"])


def test_a_call_on_the_child_of_a_killed_creator_raises_actor_died_at_once(
        cluster: dict[str, object]) -> None:
    parent = actor_classes.Parent.remote()
    called = pmetal.get(parent.make_child.remote(1), timeout=WAIT)
    uncalled = pmetal.get(parent.make_child.remote(2), timeout=WAIT)
    assert pmetal.get(called.value.remote(), timeout=WAIT) == 1   # a link to it exists
    children = [_pid_of(called), _pid_of(uncalled)]
    os.kill(_pid_of(parent), signal.SIGKILL)
    # The creator's node ends its children when it exits (owners.py).
    assert_all_exit(children, what="the children of the killed creator")
    for child in (uncalled, called):
        started = time.monotonic()
        try:
            pmetal.get(child.value.remote(), timeout=WAIT)
        except pmetal.ActorDiedError as exc:
            took = time.monotonic() - started
            # Was RequestTimeoutError after ~39 s for the child never called.
            assert took < 2.0, (took, exc)
            # Its node says why it died (a call sent before the dropped
            # connection was seen says that it dropped).
            assert "owner" in str(exc) or "dropped" in str(exc), exc
        else:
            raise AssertionError(f"a call on the dead child {child!r} returned")


# --------------------------------------------- one actor's trouble

def _latencies_beside(trouble: Callable[[], object], other: object,
                      until: threading.Event) -> list[float]:
    """Run ``trouble()`` in a thread; meanwhile call ``other`` in this one
    until ``until`` is set; each call's time (call to result)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            trouble()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    latencies = []
    deadline = time.monotonic() + 3 * WAIT
    while not until.is_set() and time.monotonic() < deadline:
        started = time.monotonic()
        pmetal.get(other.value.remote(), timeout=WAIT)
        latencies.append(time.monotonic() - started)
    thread.join(WAIT)
    assert not thread.is_alive() and not failure, failure
    return latencies


def test_an_actor_waiting_for_its_restart_holds_up_no_call_to_another(
        cluster: dict[str, object], tmp_path: Path, reap: list[object]) -> None:
    delay = 1.5
    slow = actor_classes.SlowRestart.remote(str(tmp_path / "marker"), delay)
    other = actor_classes.Counter.remote(0)
    reap += [slow, other]
    first = pmetal.get(slow.pid.remote(), timeout=WAIT)
    pmetal.get(other.value.remote(), timeout=WAIT)
    os.kill(first, signal.SIGKILL)
    assert_all_exit([first], what="the killed actor")
    done = threading.Event()
    answered: list[int] = []

    def call_slow() -> None:   # waits about `delay` for the restart
        try:
            answered.append(pmetal.get(slow.pid.remote(), timeout=3 * WAIT))
        finally:
            done.set()

    started = time.monotonic()
    latencies = _latencies_beside(call_slow, other, done)
    waited = time.monotonic() - started
    assert answered and answered[0] != first
    assert waited >= delay * 0.9, "the restart did not take its time: nothing was tested"
    print(f"\n[beside a restart of {waited:.2f} s] {len(latencies)} calls to another "
          f"actor, slowest {max(latencies) * 1000:.1f} ms")
    # Was the whole restart (the lookup held the client-wide lock). The
    # issue's bound is 50 ms; a generous margin holds at load 4 on 2 cores.
    assert max(latencies) < min(0.5, delay / 2), latencies
    # The per-actor lock of the lookup is gone with the lookup.
    from pmetal.actors import context
    assert context.current().locator._locating == {}


def test_an_unreachable_actor_holds_up_no_call_to_another(
        cluster: dict[str, object], reap: list[object]) -> None:
    stuck = actor_classes.Counter.remote(0)
    other = actor_classes.Counter.remote(0)
    reap += [stuck, other]
    pmetal.get(other.value.remote(), timeout=WAIT)
    pid = _pid_of(stuck)   # no link to it yet: the first call opens a session
    os.kill(pid, signal.SIGSTOP)
    done = threading.Event()
    answered: list[int] = []

    def call_stuck() -> None:   # its session opens once the worker runs again
        try:
            answered.append(pmetal.get(stuck.value.remote(), timeout=3 * WAIT))
        finally:
            done.set()

    resume = threading.Timer(1.5, os.kill, (pid, signal.SIGCONT))
    resume.start()
    try:
        latencies = _latencies_beside(call_stuck, other, done)
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)
    assert answered == [0]
    print(f"\n[beside a stopped actor] {len(latencies)} calls to another actor, slowest "
          f"{max(latencies) * 1000:.1f} ms")
    assert max(latencies) < 0.5, latencies
