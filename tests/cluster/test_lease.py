"""The lease of a node's restartable actors (pmetal.cluster.lease): the
quorum anchor (pmetal.cluster.view.vouched_since), the rule that a lapsed
lease waits for the cluster's word, and the gate field the workers read
(pmetal.cluster.clock). The whole story, a host cut off from the others
whose copy stops before the restart on their side, is in
tests/cluster/test_lab_cluster.py."""

from __future__ import annotations

import pytest

from pmetal.cluster.clock import Gate, GateView, cluster_clock
from pmetal.cluster.lease import Lease
from pmetal.cluster.view import LEASE_SHARE, vouched_since

INF = float("inf")
FIVE = ["a", "b", "c", "d", "e"]


@pytest.mark.parametrize(("voters", "echoes", "expected"), [
    (["a"], {}, INF),                                  # alone: nothing to vouch for
    (["a", "b"], {}, INF),                             # a pair carries on alone
    (["b", "c", "d"], {"b": 5.0}, INF),                # a (me) not a member (yet)
    (["a", "b", "c"], {}, -INF),                       # a member no one answered
    (["a", "b", "c"], {"b": 5.0}, 5.0),                # 2 of 3
    (["a", "b", "c"], {"b": 5.0, "c": 7.0}, 7.0),      # the latest that makes a quorum
    (FIVE, {"b": 9.0, "c": 4.0, "d": 6.0}, 6.0),       # 3 of 5: self, b and d since 6
    (FIVE, {"b": 9.0}, -INF),                          # 2 of 5 is no quorum
    (["a", "b", "c", "d"], {"b": 3.0}, 3.0),           # 2 of 4 with the smallest id (a)
    (["a", "b", "c", "d"], {"c": 1.0}, 1.0),
    (["b", "c", "d", "e"], {"c": 2.0}, -INF),          # e (me) and c: 2 of 4 without b
])
def test_a_quorum_vouches_from_its_oldest_needed_echo(
        voters: list[str], echoes: dict[str, float], expected: float) -> None:
    me = "a" if "a" in voters or voters == ["b", "c", "d"] else "e"
    assert vouched_since(me, voters, echoes) == expected


def test_a_lease_runs_from_the_vouched_time_and_lapses_once() -> None:
    lease = Lease(0.5)
    assert lease.renew(0.0, -INF) and lease.until == -INF   # no quorum yet: held, not lapsed
    assert lease.renew(0.1, 0.05) and lease.until == pytest.approx(0.55)
    assert lease.renew(0.5, 0.4) and lease.until == pytest.approx(0.9)
    # Cut off: the echoes stop at 0.4; the lease ends at 0.9 by itself.
    assert lease.renew(0.8, 0.4)
    assert not lease.renew(0.95, 0.4) and lease.lapsed and lease.lapses == 1
    # The partition heals: fresh echoes do not renew a lapsed lease.
    assert lease.renew(1.5, 1.45) and lease.until == pytest.approx(0.9)
    lease.confirmed(1.6)
    assert not lease.lapsed and lease.until == pytest.approx(2.1)
    assert lease.renew(1.7, 1.65) and lease.until == pytest.approx(2.15)


def test_a_confirmation_slower_than_the_lease_runs_from_the_latest_echo() -> None:
    """Asked at 1.0, answered at 1.8 (longer than the 0.5 lease): with
    fresh echoes (a Beat sent at 1.75 that a quorum answered) the lease
    runs from those; it does not lapse again at the next tick. Before, it
    ran from the question alone and lapsed again at once, round after
    round, and a restart on the node never got to run its constructor."""
    lease = Lease(0.5)
    lease.renew(0.0, 0.0)
    assert not lease.renew(0.6, 0.0) and lease.lapsed
    lease.confirmed(1.0, vouched=1.75)
    assert not lease.lapsed and lease.until == pytest.approx(2.25)
    assert lease.renew(1.85, 1.8) and not lease.lapsed
    # Echoes older than the question count for nothing more than it.
    assert not lease.renew(3.0, 1.8) and lease.lapsed
    lease.confirmed(3.2, vouched=1.8)
    assert lease.until == pytest.approx(3.7)


def test_a_lease_with_no_quorum_after_a_granted_one_lapses() -> None:
    """A list that grows past the echoes (new members) leaves no quorum:
    the lease that was granted still lapses at its time, and waits."""
    lease = Lease(0.5)
    lease.renew(0.0, 0.0)
    assert lease.renew(0.2, -INF) and lease.until == -INF
    assert not lease.renew(0.3, 0.25) and lease.lapsed


def test_alone_or_fenced_the_lease_has_no_limit() -> None:
    lease = Lease(0.5)
    assert lease.renew(10.0, INF) and lease.until == INF and not lease.held
    assert lease.renew(100.0, INF)   # never lapses
    lease.renew(101.0, 100.9)
    assert not lease.renew(102.0, 100.9)
    lease.fenced()
    assert not lease.lapsed
    assert lease.renew(102.1, -INF) and lease.renew(103.0, -INF)   # the new incarnation waits


def test_the_lease_is_shorter_than_the_time_to_declare_a_node_dead() -> None:
    assert 0.0 < LEASE_SHARE < 1.0


def test_only_a_restartable_actors_worker_obeys_the_lease() -> None:
    gate = Gate()
    try:
        view = GateView(gate.path, stale=5.0)
        now = cluster_clock()
        gate.tick(now, now - 0.01)          # expired a moment ago
        assert view.check(view.generation) == ""      # not leased: runs on
        view.leased = True
        assert view.check(view.generation) == "lapsed"
        assert view.wait(view.generation, 0.05) == "lapsed"   # bounded
        gate.tick(cluster_clock(), cluster_clock() + 5.0)
        assert view.check(view.generation) == ""
        gate.tick(cluster_clock(), INF)
        assert view.check(view.generation) == ""
        view.close()
    finally:
        gate.close()
