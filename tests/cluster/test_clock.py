"""The suspension clocks and the gate a node's workers obey
(pmetal.cluster.clock), and what a pause of this node does to its failure
detector (pmetal.cluster.health: its own silence is not held against its
peers). The whole path, a real host stopped and continued, is
tests/cluster/test_suspension_lab.py."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import pytest

from pmetal.cluster.clock import Gate, GateView, cluster_clock, slept
from pmetal.cluster.health import HealthMonitor, HealthStatus
from pmetal.config import HealthConfig

if TYPE_CHECKING:
    from pmetal.cluster.service import ClusterService


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux clocks")
def test_neither_starvation_nor_a_stopped_process_counts_as_sleep() -> None:
    """A busy CPU and a process stopped (SIGSTOP) move CLOCK_BOOTTIME and
    CLOCK_MONOTONIC alike: only a system suspend parts them."""
    before = slept()
    assert before is not None
    end = time.monotonic() + 0.3
    while time.monotonic() < end:   # busy: starvation costs CPU, not sleep
        pass
    # This process stopped and continued by a child, for 0.5 s.
    child = multiprocessing.get_context("fork").Process(target=_stop_parent_for,
                                                        args=(os.getpid(), 0.5))
    t0 = cluster_clock()
    child.start()
    child.join(10)
    assert child.exitcode == 0
    assert cluster_clock() - t0 >= 0.5
    assert abs(slept() - before) < 0.05   # type: ignore[operator]


def test_a_process_starved_between_two_clock_readings_did_not_sleep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler can stop a process between any two system calls: here
    the readings of one bracket straddle 1.5 s of starvation (injected: a
    real preemption cannot be placed between two calls). The machine did
    not sleep, so the two clocks stay 100 s apart; one plain pair of
    readings said 98.5 s, and the difference of two such readings was taken
    for a 1.5 s sleep: the node fenced itself (seen beside CPU hogs)."""
    from pmetal.cluster import clock
    if clock._PAIR is None:
        pytest.skip("this platform cannot tell a sleep")
    counting, _not_counting = clock._PAIR
    now = [1000.0]
    starved = [1.5]   # right after the first reading of the counting clock

    def clock_gettime(which: int) -> float:
        now[0] += 0.0001
        if which == counting:
            reading = now[0] + 100.0
            now[0] += starved.pop() if starved else 0.0
            return reading
        return now[0]

    monkeypatch.setattr(clock.time, "clock_gettime", clock_gettime)
    assert clock.slept() == pytest.approx(100.0, abs=0.001)


def _stop_parent_for(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(pid, signal.SIGCONT)


def test_the_gate_holds_a_worker_until_its_node_opens_it() -> None:
    gate = Gate()
    try:
        view = GateView(gate.path, stale=5.0)
        generation = view.generation
        assert view.check(generation) == ""
        gate.hold()
        assert view.check(generation) == "held"
        assert view.wait(generation, 0.05) == "held"   # bounded
        gate.open()
        assert view.check(generation) == ""
        gate.fence()
        # The actor built before the fence never answers again; a task
        # worker (no generation) and an actor built now do.
        assert view.check(generation) == "fenced"
        assert view.wait(generation, 5.0) == "fenced"    # at once, not after 5 s
        assert view.check(None) == ""
        view.adopt()
        assert view.check(view.generation) == ""
        view.close()
    finally:
        gate.close()
    assert not os.path.exists(gate.path)


def test_the_gate_holds_while_the_node_has_not_ticked() -> None:
    """A whole machine continued after a stop: every process resumes at
    once, and a worker must not answer before its node ticked and saw the
    gap. A tick older than ``stale`` holds it."""
    gate = Gate()
    try:
        view = GateView(gate.path, stale=0.05)
        gate.tick(cluster_clock() - 1.0)
        assert view.check(view.generation) == "held"
        gate.tick(cluster_clock())
        assert view.check(view.generation) == ""
    finally:
        gate.close()


def _read_generations(path: str, reads: int, out: "multiprocessing.Queue[list[str]]") -> None:
    view = GateView(path, stale=60.0)
    seen = [view.read()[1] for _ in range(reads)]
    verdicts = {view.check(1) for _ in range(reads // 10)}
    out.put(sorted({str(g) for g in seen} | {f"check:{v}" for v in verdicts}))


def test_a_worker_reading_while_its_node_ticks_never_sees_a_fence() -> None:
    """The node rewrites the page at every tick while workers read it
    without a lock: a read in the middle of a write must still see the
    generation whole (struct.pack_into zeroed the page before filling it
    in; 85 of 3 million reads saw generation 0, "fenced", and refused an
    actor's creation)."""
    gate = Gate()
    out: multiprocessing.Queue[list[str]] = multiprocessing.get_context("fork").Queue()
    reader = multiprocessing.get_context("fork").Process(
        target=_read_generations, args=(gate.path, 1_000_000, out))
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while reader.is_alive() and time.monotonic() < deadline:
            gate.tick(cluster_clock())
        assert out.get(timeout=10) == ["1", "check:"]
    finally:
        reader.join(10)
        if reader.is_alive():
            reader.kill()
        gate.close()


def test_a_pause_of_this_node_is_not_held_against_its_peers() -> None:
    config = HealthConfig()
    health = HealthMonitor(config, 0.0)
    health.watch("a", 0.0)
    health.watch("b", 0.0)
    # b fell silent before the pause and is dead anyway; a was heard just
    # before this node stopped for 3 s.
    health.tick(1.0)
    assert health.status("b") is HealthStatus.DEAD
    health.heard("a", 1.0)
    health.paused(3.0)
    events = health.tick(4.05)
    assert health.status("a") is HealthStatus.HEALTHY, events
    assert health.status("b") is HealthStatus.DEAD
    # Silence after the pause counts as usual.
    health.tick(4.0 + config.dead_after + 0.1)
    assert health.status("a") is HealthStatus.DEAD


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="gates live in /dev/shm here")
def test_a_gate_left_by_a_dead_node_is_swept_by_the_next() -> None:
    dead = multiprocessing.get_context("fork").Process(target=_leave_a_gate)
    dead.start()
    dead.join(10)
    assert dead.exitcode == 0
    left = [e for e in os.listdir("/dev/shm") if e.startswith("pmetal-gate-")
            and f"-{dead.pid}-" in e]
    assert left, "the child left no gate behind"
    gate = Gate()
    try:
        assert not [e for e in left if os.path.exists(f"/dev/shm/{e}")]
        assert os.path.exists(gate.path)   # the live one stays
    finally:
        gate.close()


def _leave_a_gate() -> None:
    Gate()   # never closed: as a node killed with SIGKILL
    os._exit(0)


# ------------------------------------------------- the service's pause rule

def _service(fenced: list[str]) -> ClusterService:
    from pmetal.cluster.service import ClusterService
    from pmetal.config import load_config
    from pmetal.identity import NodeIdentity
    from pmetal.security import NetworkNamespace
    from pmetal.transport import ZmqTransport
    config = load_config(env={})
    return ClusterService(
        config=config, identity=NodeIdentity.generate(),
        namespace=NetworkNamespace("clock-test", b"clock-test-psk-not-secret-0123456789"),
        transport=ZmqTransport(config.transport), address="tcp://127.0.0.1:1",
        resources={}, profile={}, static_peers=[], on_view=lambda state: None,
        on_fenced=fenced.append, on_dead=lambda node_id: None, gate=Gate())


def test_a_real_sleep_fences_at_once_and_a_stop_asks_first(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The suspension clocks decide (a system suspend cannot be caused in a
    test, so their reading is injected): slept past ``dead_after``, the node
    fences at once; paused as long without sleeping, it holds its workers
    and asks; a gap under ``dead_after / 2`` is no pause."""
    from pmetal.cluster import pauses
    fenced: list[str] = []
    svc = _service(fenced)
    assert svc.gate is not None
    dead_after = svc.config.health.dead_after
    reading = [100.0]
    monkeypatch.setattr(pauses, "slept", lambda: reading[0])
    svc._slept = reading[0]
    others = [{"node_id": "b" * 32, "address": "tcp://127.0.0.1:2"}]
    monkeypatch.setattr(svc, "_others", lambda: others)   # a member the others can drop
    try:
        svc._paused(dead_after * 0.4)
        assert not fenced and svc.confirmed and not svc.gate.held
        # SIGSTOP or starvation: the suspension clocks did not part.
        with caplog.at_level("INFO", logger="pmetal.cluster.service"):
            svc._paused(3.0)
        assert not fenced and not svc.confirmed and svc.gate.held
        assert "the machine did not sleep" in caplog.text
        generation = svc.gate.generation
        # The machine slept 3 s: fenced at once, a new generation, open.
        reading[0] += 3.0
        svc._paused(3.2)
        assert len(fenced) == 1 and "slept for 3.0 s" in fenced[0], fenced
        assert svc.confirmed and not svc.gate.held and svc.gate.generation == generation + 1
        # A short sleep inside a long pause is no reason to fence at once.
        reading[0] += dead_after / 2
        svc._paused(3.0)
        assert len(fenced) == 1 and not svc.confirmed
        # Alone, nobody could have declared it dead: a sleep ends nothing.
        others.clear()
        reading[0] += 3.0
        svc._paused(3.2)
        assert len(fenced) == 1, fenced
    finally:
        svc.gate.close()


def test_a_node_alone_is_confirmed_at_once() -> None:
    import asyncio
    svc = _service([])
    assert svc.gate is not None
    try:
        assert asyncio.run(svc._membership()) == "member"
    finally:
        svc.gate.close()
