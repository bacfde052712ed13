"""Collective groups of real actors (pmetal.collective): create_group in
the driver, get_group and the operations inside actor methods, members
connected over TCP on 127.0.0.1 through an embedded node's workers.

Every wait is a ``pmetal.get(..., timeout=...)``; the worker killed with
SIGKILL is waited for through /proc under a deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pmetal
from pmetal import (
    ActorDiedError,
    CollectiveError,
    PMetalTypeError,
    PMetalValueError,
    collective,
)
from pmetal.collectives.group import Schedule
from pmetal.collectives.rendezvous import Formation, Rendezvous, ring_order
from pmetal.config import CollectiveConfig, load_config

from .group_actors import AsyncMember, Member

WAIT = 20.0
"""Deadline for results that come at once on a quiet machine (the suite
runs next to others on two cores)."""

DEATH_WAIT = 10.0
"""How soon the survivors of a killed member must fail; the operations'
timeout below is three times that, so failing by it would not pass."""

CONFIG = CollectiveConfig(timeout=3 * DEATH_WAIT, connect_timeout=WAIT)


def _tests_root() -> str:
    return str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    """An embedded node whose workers can import :mod:`group_actors`."""
    if pmetal.is_initialized():
        pmetal.shutdown(timeout=3.0)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_tests_root(), old) if p)
    try:
        yield pmetal.init(num_workers=4, config=load_config(
            transport={"handshake_timeout": 2.0, "request_timeout": 10.0}))
    finally:
        pmetal.shutdown(timeout=3.0)
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@pytest.fixture
def members(cluster: dict[str, Any]) -> Iterator[Callable[[int], list[Any]]]:
    """``members(n)``: n new Member actors, killed after the test."""
    made: list[Any] = []

    def make(n: int) -> list[Any]:
        handles = [Member.remote() for _ in range(n)]
        made.extend(handles)
        return handles

    yield make
    for handle in made:
        try:
            pmetal.kill(handle)
        except pmetal.PMetalError:
            pass  # killed by the test already


@pytest.fixture
def group_name(request: pytest.FixtureRequest, cluster: dict[str, Any]) -> Iterator[str]:
    name = request.node.name
    yield name
    collective.destroy_group(name)


def _pid_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        if stat and stat[0] in ("Z", "X"):
            return
        assert time.monotonic() < deadline, f"process {pid} still runs {timeout} s after SIGKILL"
        time.sleep(0.02)  # no event tells another process's exit


def test_all_reduce_inside_actor_methods(members: Any, group_name: str) -> None:
    actors = members(3)
    handle = collective.create_group(actors, name=group_name, config=CONFIG)
    assert (handle.name, handle.size, handle.epoch) == (group_name, 3, 1)
    assert handle.members == tuple(actors)
    assert handle.term == handle.schedule.term
    assert sorted(handle.schedule.order) == [0, 1, 2]

    joined = pmetal.get([a.join.remote(group_name) for a in actors], timeout=WAIT)
    assert joined == [(0, 3, 1), (1, 3, 1), (2, 3, 1)]

    value = np.arange(5, dtype=np.float32)
    results = pmetal.get([a.all_reduce.remote(group_name, value) for a in actors], timeout=WAIT)
    for result in results:   # rank r contributes value * (r + 1)
        np.testing.assert_array_equal(result, value * 6)
    ints = np.array([3, -7, 1 << 40], dtype=np.int64)
    results = pmetal.get([a.all_reduce.remote(group_name, ints, "max") for a in actors],
                         timeout=WAIT)
    for result in results:
        np.testing.assert_array_equal(result, np.maximum(ints, ints * 3))
        assert result.dtype == np.int64
    for rank, stats in enumerate(pmetal.get([a.statistics.remote(group_name) for a in actors],
                                            timeout=WAIT)):
        assert (stats.rank, stats.size, stats.epoch, stats.operations) == (rank, 3, 1, 2)
        assert stats.bytes_sent > 0 and stats.bytes_received > 0 and stats.spent is None


def test_async_actors_join_a_group_with_plain_ones(members: Any, group_name: str) -> None:
    (plain,) = members(1)
    asynchronous = [AsyncMember.remote() for _ in range(2)]
    try:
        actors = [asynchronous[0], plain, asynchronous[1]]
        collective.create_group(actors, name=group_name, config=CONFIG)
        value = np.arange(4, dtype=np.int64)
        for result in pmetal.get([a.all_reduce.remote(group_name, value) for a in actors],
                                 timeout=WAIT):
            np.testing.assert_array_equal(result, value * 6)
    finally:
        for actor in asynchronous:
            pmetal.kill(actor)


def test_broadcast_from_every_root_and_all_gather(members: Any, group_name: str) -> None:
    actors = members(3)
    collective.create_group(actors, name=group_name, config=CONFIG)
    for root in range(3):
        results = pmetal.get([a.broadcast.remote(group_name, root) for a in actors],
                             timeout=WAIT)
        for result in results:
            np.testing.assert_array_equal(result, np.full(6, float(root)))
    gathered = pmetal.get([a.all_gather.remote(group_name) for a in actors], timeout=WAIT)
    expected = np.array([[0, 1, 2], [10, 11, 12], [20, 21, 22]], dtype=np.int64)
    for result in gathered:
        np.testing.assert_array_equal(result, expected)


def test_get_group_refuses_the_driver_unknown_names_and_outsiders(
        members: Any, group_name: str) -> None:
    inside, outsider = members(2)
    with pytest.raises(PMetalValueError, match="inside a method"):
        collective.get_group(group_name)
    with pytest.raises(PMetalValueError, match="no collective group named 'no-such-group'"):
        pmetal.get(inside.join.remote("no-such-group"), timeout=WAIT)
    collective.create_group([inside], name=group_name, config=CONFIG)
    with pytest.raises(PMetalValueError, match="not a member"):
        pmetal.get(outsider.join.remote(group_name), timeout=WAIT)
    assert pmetal.get(inside.join.remote(group_name), timeout=WAIT) == (0, 1, 1)


def test_create_group_is_idempotent_and_checks_its_arguments(
        members: Any, group_name: str) -> None:
    a, b = members(2)
    first = collective.create_group([a, b], name=group_name, config=CONFIG)
    again = collective.create_group([a, b], name=group_name, config=CONFIG)
    assert again.epoch == first.epoch == 1
    swapped = collective.create_group([b, a], name=group_name, config=CONFIG)
    assert swapped.epoch == 2
    assert pmetal.get([a.join.remote(group_name), b.join.remote(group_name)],
                      timeout=WAIT) == [(1, 2, 2), (0, 2, 2)]
    with pytest.raises(PMetalTypeError):
        collective.create_group([], name=group_name)
    with pytest.raises(PMetalTypeError):
        collective.create_group(["not an actor"], name=group_name)
    with pytest.raises(PMetalValueError, match="listed twice"):
        collective.create_group([a, a], name=group_name)
    with pytest.raises(PMetalValueError):
        collective.create_group([a], name="")


def test_a_killed_member_fails_every_survivor_then_the_survivors_reform(
        members: Any, group_name: str) -> None:
    actors = members(3)
    collective.create_group(actors, name=group_name, config=CONFIG)
    assert pmetal.get([a.keep.remote(group_name) for a in actors], timeout=WAIT) == [1, 1, 1]
    victim, survivors = actors[1], [actors[0], actors[2]]
    victim_pid = pmetal.get(victim.pid.remote(), timeout=WAIT)

    # 1 MiB all_reduces (the ring) until a member dies.
    spins = [a.spin.remote(group_name, 1 << 18, 10**9) for a in actors]
    assert pmetal.get(victim.started.remote(), timeout=WAIT)
    os.kill(victim_pid, signal.SIGKILL)
    killed = time.monotonic()
    for ref in (spins[0], spins[2]):
        with pytest.raises(CollectiveError) as failure:
            pmetal.get(ref, timeout=DEATH_WAIT)
        assert "form the group again" in str(failure.value)
    elapsed = time.monotonic() - killed
    print(f"both survivors raised CollectiveError {elapsed * 1000:.0f} ms after the SIGKILL "
          f"(operation timeout {CONFIG.timeout:g} s)")
    assert elapsed < DEATH_WAIT
    with pytest.raises(ActorDiedError):
        pmetal.get(spins[1], timeout=WAIT)
    _pid_gone(victim_pid, WAIT)

    reformed = collective.create_group(survivors, name=group_name, config=CONFIG)
    assert (reformed.epoch, reformed.size) == (2, 2)
    assert pmetal.get([a.join.remote(group_name) for a in survivors],
                      timeout=WAIT) == [(0, 2, 2), (1, 2, 2)]
    value = np.arange(4, dtype=np.float64)
    for result in pmetal.get([a.all_reduce.remote(group_name, value) for a in survivors],
                             timeout=WAIT):
        np.testing.assert_array_equal(result, value * 3)
    # The group object of epoch 1 is refused, saying why.
    with pytest.raises(CollectiveError, match="epoch 1.*stale epoch is refused"):
        pmetal.get(survivors[0].use_kept.remote(), timeout=WAIT)


def test_a_stalled_member_fails_the_others_at_the_timeout_then_all_reform(
        members: Any, group_name: str) -> None:
    """SIGSTOP (a member that hangs without closing anything): the others
    raise at the operation's timeout, not later; once it runs again the same
    three actors form a new epoch and work."""
    config = CollectiveConfig(timeout=2.0, connect_timeout=WAIT)
    actors = members(3)
    collective.create_group(actors, name=group_name, config=config)
    victim = actors[0]
    victim_pid = pmetal.get(victim.pid.remote(), timeout=WAIT)
    spins = [a.spin.remote(group_name, 1 << 10, 10**9) for a in actors]
    assert pmetal.get(victim.started.remote(), timeout=WAIT)
    os.kill(victim_pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        for ref in spins[1:]:
            with pytest.raises(CollectiveError, match="form the group again"):
                pmetal.get(ref, timeout=config.timeout + DEATH_WAIT)
        elapsed = time.monotonic() - stopped
        print(f"both others raised CollectiveError {elapsed:.2f} s after the SIGSTOP "
              f"(operation timeout {config.timeout:g} s)")
        assert elapsed < config.timeout + DEATH_WAIT
    finally:
        os.kill(victim_pid, signal.SIGCONT)
    with pytest.raises(CollectiveError):   # its peers closed their connections
        pmetal.get(spins[0], timeout=WAIT)

    again = collective.create_group(actors, name=group_name, config=config)
    assert again.epoch == 2   # the same members, but epoch 1 failed
    assert pmetal.get([a.join.remote(group_name) for a in actors],
                      timeout=WAIT) == [(0, 3, 2), (1, 3, 2), (2, 3, 2)]
    value = np.ones(3, dtype=np.int32)
    for result in pmetal.get([a.all_reduce.remote(group_name, value) for a in actors],
                             timeout=WAIT):
        np.testing.assert_array_equal(result, value * 6)


def test_create_group_starts_a_new_rendezvous_actor_when_the_old_one_died(
        members: Any, group_name: str) -> None:
    actors = members(2)
    collective.create_group(actors, name=group_name, config=CONFIG)
    assert pmetal.get([a.join.remote(group_name) for a in actors],
                      timeout=WAIT) == [(0, 2, 1), (1, 2, 1)]
    pmetal.kill(pmetal.get_actor(f"pmetal-collective:{group_name}"))
    again = collective.create_group(actors, name=group_name, config=CONFIG)
    assert again.epoch == 1   # a new rendezvous actor counts from 1 again
    value = np.arange(3, dtype=np.float64)
    for result in pmetal.get([a.all_reduce.remote(group_name, value) for a in actors],
                             timeout=WAIT):
        np.testing.assert_array_equal(result, value * 3)


def test_destroy_group(members: Any, group_name: str) -> None:
    (actor,) = members(1)
    collective.create_group([actor], name=group_name, config=CONFIG)
    assert pmetal.get(actor.join.remote(group_name), timeout=WAIT) == (0, 1, 1)
    assert collective.destroy_group(group_name) is True
    assert collective.destroy_group(group_name) is False
    with pytest.raises(PMetalValueError, match="no collective group"):
        pmetal.get(actor.join.remote(group_name), timeout=WAIT)
    # The name is free again: a new rendezvous actor, counting from 1.
    assert collective.create_group([actor], name=group_name, config=CONFIG).epoch == 1
    assert pmetal.get(actor.join.remote(group_name), timeout=WAIT) == (0, 1, 1)


# ------------------------------------------------- the pure parts, no cluster

def _request(name: str, members: tuple[str, ...], **config: Any) -> Formation:
    cfg = CollectiveConfig(**config)
    schedule = Schedule.from_config(name, len(members), cfg)
    return Formation(name, 0, "", members, ("n1", "n2") * (len(members) // 2), schedule, 0,
                     cfg.timeout, cfg.connect_timeout)


class _FixedView(Rendezvous):
    """The rendezvous actor's logic, with the cluster it reads fixed."""

    def cluster_view(self) -> dict[str, Any]:
        return {"term": 7, "epoch": 3, "role": "master", "topology": {
            "nodes": [{"node_id": "n1"}, {"node_id": "n2"}], "links": []}}


def test_ring_order_follows_the_topology_and_keeps_a_node_s_ranks_together() -> None:
    fast, slow = 0.001, 0.010
    links = {("a", "c"): fast, ("b", "c"): fast, ("b", "d"): fast, ("a", "d"): fast,
             ("a", "b"): slow, ("c", "d"): slow}
    topology = {"nodes": [{"node_id": n} for n in "abcd"],
                "links": [{"a": a, "b": b, "latency": t, "bandwidth": None, "measured_at": 1.0}
                          for (a, b), t in links.items()]}
    # Ranks 0 and 4 share node a; the best ring is a c b d.
    assert ring_order(["a", "b", "c", "d", "a"], topology) == (0, 4, 2, 1, 3)
    assert ring_order(["a", "a", "a"], topology) == (0, 1, 2)
    assert ring_order(["a", "zz"], topology) == (0, 1)   # a node the topology lacks
    assert ring_order(["b", "a"], None) == (0, 1)


def test_the_rendezvous_forms_idempotently_and_refuses_stale_and_late_joins() -> None:
    async def scenario() -> None:
        rv = _FixedView("g")
        first = await rv.form(_request("g", ("x", "y")))
        assert first.epoch == first.schedule.epoch == 1
        assert (first.schedule.term, first.cluster_epoch, first.schedule.order) == (7, 3, (0, 1))
        assert (await rv.form(_request("g", ("x", "y")))) is first
        second = await rv.form(_request("g", ("x", "y"), strategy="ring"))
        assert second.epoch == 2 and second.tag != first.tag
        # A rank of the old formation is refused; one alone times out
        # naming the rank that did not come, and leaves no address behind.
        with pytest.raises(CollectiveError, match="stale epoch is refused"):
            await rv.join(first.formation_id, 0, ("127.0.0.1", 1), 1.0)
        with pytest.raises(CollectiveError, match=r"rank\(s\) \[1\]"):
            await rv.join(second.formation_id, 0, ("127.0.0.1", 1), 0.05)
        both = await asyncio.gather(rv.join(second.formation_id, 0, ("127.0.0.1", 1), 5.0),
                                    rv.join(second.formation_id, 1, ("127.0.0.1", 2), 5.0))
        assert both[0] == both[1] == [("127.0.0.1", 1), ("127.0.0.1", 2)]
        with pytest.raises(CollectiveError, match="after every member connected"):
            await rv.join(second.formation_id, 1, ("127.0.0.1", 3), 5.0)
        # Once an operation failed in it, the same request forms anew.
        assert (await rv.form(_request("g", ("x", "y"), strategy="ring"))) is second
        assert (await rv.failed(second.formation_id)) is second
        third = await rv.form(_request("g", ("x", "y"), strategy="ring"))
        assert third.epoch == 3 and third.formation_id != second.formation_id

    asyncio.run(asyncio.wait_for(scenario(), WAIT))
