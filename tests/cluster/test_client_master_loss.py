"""A driver's calls while the master's machine dies with an actor on it:
three node daemons on loopback (static peers), a driver in this process
connected to a follower.

A restartable actor's calls made during the loss wait for its restart (the
next master's) within ``max_task_retries`` instead of failing with "no actor
X in this cluster"; a call to an actor that will not come back fails
within ``actors.restart_wait``; and calls to an actor elsewhere are never
held up meanwhile.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

import pmetal
from pmetal.config import load_config

from .test_scheduler import WAIT, agreed_master, three  # noqa: F401 - the fixture

RESTART_WAIT = 5.0


@pmetal.remote(max_restarts=3, max_task_retries=2)
class Restartable:
    def ping(self) -> int:
        return os.getpid()


@pmetal.remote
class Plain:
    def ping(self) -> int:
        return os.getpid()


def test_calls_during_the_masters_loss_wait_for_the_restart(
        three: list[dict[str, Any]]) -> None:  # noqa: F811 - the fixture
    master_id = agreed_master(three)
    master = next(n for n in three if n["node_id"] == master_id)
    origin = next(n for n in three if n is not master)
    pmetal.init(address=origin["address"], psk=origin["psk"],
                config=load_config(transport={"request_timeout": WAIT},
                                   actors={"restart_wait": RESTART_WAIT}))
    kept = Restartable.options(node=master_id).remote()
    lost = Plain.options(node=master_id).remote()
    near = Plain.options(node=origin["node_id"]).remote()
    first = pmetal.get(kept.ping.remote(), timeout=WAIT)
    pmetal.get([lost.ping.remote(), near.ping.remote()], timeout=WAIT)

    errors: list[BaseException] = []
    answers: list[tuple[float, int]] = []
    near_latency: list[float] = []
    stop = threading.Event()

    def call_kept() -> None:   # one call after another, through the loss
        while not stop.is_set():
            try:
                pid = pmetal.get(kept.ping.remote(), timeout=WAIT)
                answers.append((time.monotonic(), pid))   # when it answered
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    caller = threading.Thread(target=call_kept)
    caller.start()
    os.killpg(master["proc"].pid, signal.SIGKILL)
    killed = time.monotonic()
    # Meanwhile, calls to an actor on a live node go on undisturbed.
    while not stop.is_set() and time.monotonic() - killed < WAIT:
        started = time.monotonic()
        pmetal.get(near.ping.remote(), timeout=WAIT)
        near_latency.append(time.monotonic() - started)
        if any(pid != first for _, pid in answers):
            stop.set()
    stop.set()
    caller.join(WAIT)
    assert not caller.is_alive() and not errors, errors
    back = next(t for t, pid in answers if pid != first) - killed
    print(f"\n[master loss] the restartable actor answered from its new incarnation "
          f"{back:.2f} s after the kill; {len(near_latency)} calls to an actor on a live "
          f"node meanwhile, slowest {max(near_latency) * 1000:.1f} ms")
    assert back < RESTART_WAIT + 2.0
    assert max(near_latency) < 0.5, near_latency
    # An actor that cannot come back fails within the documented bound.
    started = time.monotonic()
    with pytest.raises(pmetal.ActorDiedError):
        pmetal.get(lost.ping.remote(), timeout=WAIT)
    assert time.monotonic() - started < RESTART_WAIT + 2.0
