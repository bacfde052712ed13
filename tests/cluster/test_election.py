"""The election state machine on simulated time (tests/cluster/simnet.py):
one master among 1-5 nodes, re-election after the master dies, stickiness,
check-quorum, the tie-breaker, joins, removal, fencing and merges.

Every network here is seeded and its clock is simulated, so each test is
exact and fast; "within" bounds are in simulated seconds.
"""

from __future__ import annotations

import random

import pytest

from pmetal.cluster.election import ElectionManager, Role
from pmetal.cluster.view import MemberEntry, has_quorum
from pmetal.config import ElectionConfig, HealthConfig
from pmetal.wire import Beat, ClusterView, JoinCluster, VoteRequest
from tests.cluster.simnet import SimNet

ELECTION = ElectionConfig()          # the defaults: timeout 0.8 s, bootstrap 2 s
HEALTH = HealthConfig(remove_after=3.0)
DELAY = 0.01                         # the largest message delay in these networks


def network(n: int, seed: int = 1, **kw: object) -> SimNet:
    return SimNet(n, seed, max_delay=DELAY, election=ELECTION, health=HEALTH, **kw)


def formed(net: SimNet, limit: float = ELECTION.bootstrap + 2.0) -> str:
    """Run until every live node follows one master; that master."""
    net.run_until_true(lambda: net.agreement() == "", limit)
    return net.masters_now()[0].node_id


def state(net: SimNet, node_id: str):  # noqa: ANN201 - ElectionState
    return net.nodes[node_id].manager.state


def events(net: SimNet, node_id: str, kind: str) -> list:
    return [e for _, n, e in net.log if n == node_id and e.kind == kind]


# ------------------------------------------------------------------ quorum

@pytest.mark.parametrize(("granted", "voters", "expected"), [
    ({"a"}, ["a"], True),
    ({"a"}, ["a", "b"], False),         # two nodes: one alone is not a quorum...
    ({"b"}, ["a", "b"], False),
    ({"a", "b"}, ["a", "b"], True),
    ({"a", "b"}, ["a", "b", "c"], True),
    ({"c"}, ["a", "b", "c"], False),
    ({"a", "d"}, ["a", "b", "c", "d"], True),   # an even split: the half with "a"
    ({"b", "c"}, ["a", "b", "c", "d"], False),
    ({"x", "y"}, ["a", "b"], False),    # votes from non-members do not count
    (set(), [], False),
])
def test_quorum(granted: set[str], voters: list[str], expected: bool) -> None:
    assert has_quorum(granted, voters) is expected


@pytest.mark.parametrize(("granted", "voters", "dead", "expected"), [
    ({"b"}, ["a", "b"], {"a"}, True),   # ... unless it holds the other dead
    ({"a"}, ["a", "b"], {"b"}, True),
    ({"a"}, ["a", "b"], {"a"}, False),
    (set(), ["a", "b"], {"a", "b"}, False),
    ({"b"}, ["a", "b", "c"], {"a", "c"}, False),   # dead voters count only in a list of two
])
def test_quorum_of_two_with_a_dead_member(granted: set[str], voters: list[str], dead: set[str],
                                          expected: bool) -> None:
    assert has_quorum(granted, voters, dead) is expected


# ----------------------------------------------------------------- election

@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_one_master_is_elected(n: int) -> None:
    net = network(n)
    master = formed(net)
    states = [state(net, node_id) for node_id in net.ids]
    assert {s.master for s in states} == {master}
    assert len({(s.term, s.epoch) for s in states}) == 1
    assert [m.node_id for m in states[0].members] == sorted(net.ids)
    assert all(m.state == "alive" for m in states[0].members)
    # Nobody elects during the bootstrap window.
    assert min(at for at, _, e in net.log if e.kind == "elected") >= ELECTION.bootstrap


@pytest.mark.parametrize(("n", "seed"), [(3, 1), (3, 2), (5, 3), (5, 4)])
def test_a_new_master_soon_after_the_master_dies(n: int, seed: int) -> None:
    net = network(n, seed)
    old = formed(net)
    old_term = state(net, old).term
    net.crash(old)
    took = net.run_until_true(lambda: net.agreement() == "", 5.0)
    new = net.masters_now()[0].node_id
    assert new != old
    assert state(net, new).term > old_term
    # Silence for the timeout, its random part, a tick, two round trips.
    bound = ELECTION.timeout * 1.5 + HEALTH.interval + 4 * DELAY
    assert took <= bound, f"re-election took {took:.3f} s of simulated time, bound {bound}"
    assert took < 2.0


def test_a_follower_back_from_a_partition_does_not_depose_the_master() -> None:
    net = network(3, seed=5)
    master = formed(net)
    term = state(net, master).term
    loner = next(i for i in net.ids if i != master)
    net.partition([loner])
    net.run_for(5.0)
    # Alone it cannot get pre-votes, so its term never moved.
    assert state(net, loner).term == term
    assert state(net, loner).role is Role.FOLLOWER
    net.heal()
    net.run_for(1.0)
    assert net.agreement() == ""
    assert net.masters_now()[0].node_id == master
    assert state(net, master).term == term


def test_a_node_that_hears_its_master_refuses_votes() -> None:
    net = network(3, seed=6)
    master = formed(net)
    follower, rogue = (i for i in net.ids if i != master)
    s = state(net, follower)
    manager = net.nodes[follower].manager
    for pre in (True, False):
        out = manager.receive(rogue, VoteRequest(s.term + 5, rogue, s.epoch, pre), net.now)
        assert len(out) == 1 and not out[0].message.granted
        assert "alive" in out[0].message.reason
    assert manager.state.term == s.term and manager.state.voted_for == s.voted_for


def test_a_master_cut_off_from_the_majority_steps_down() -> None:
    net = network(3, seed=7)
    old = formed(net)
    net.partition([old])
    cut = net.now
    net.run_until_true(lambda: state(net, old).role is not Role.MASTER,
                       ELECTION.timeout + 2 * HEALTH.interval)
    assert events(net, old, "no_master")[-1].at - cut <= ELECTION.timeout + 2 * HEALTH.interval
    others = [i for i in net.ids if i != old]
    net.run_until_true(lambda: any(state(net, i).role is Role.MASTER for i in others), 3.0)
    # The minority side never gets a master back while cut off.
    net.run_for(3.0)
    assert state(net, old).role is not Role.MASTER
    net.heal()
    formed(net, 3.0)
    assert net.masters_now()[0].node_id in others


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("lose", ["master", "follower"])
def test_two_nodes_the_survivor_of_either_is_master_soon(seed: int, lose: str) -> None:
    net = network(2, seed, ids=["a", "b"])
    master = formed(net)
    gone = master if lose == "master" else next(i for i in net.ids if i != master)
    survivor = next(i for i in net.ids if i != gone)
    net.crash(gone)
    took = net.run_until_true(lambda: state(net, survivor).role is Role.MASTER, 3.0)
    # Declared dead, then up to half a timeout of random wait, and a tick.
    assert took <= HEALTH.dead_after + ELECTION.timeout / 2 + 2 * HEALTH.interval + DELAY
    if lose == "follower":
        assert not events(net, survivor, "no_master")   # a sitting master keeps its role
    net.restart(gone)
    assert formed(net, ELECTION.bootstrap + 3.0) == survivor


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_two_nodes_cut_apart_each_has_a_master_and_the_higher_term_wins_the_heal(
        seed: int) -> None:
    net = network(2, seed, ids=["a", "b"])
    master = formed(net)
    other = next(i for i in net.ids if i != master)
    term = state(net, master).term
    net.partition(["a"], ["b"])
    net.run_for(2.0)
    assert state(net, master).role is Role.MASTER and state(net, master).term == term
    assert state(net, other).role is Role.MASTER and state(net, other).term > term
    net.heal()
    assert formed(net, 3.0) == other
    # The loser's list held it alive; the winner's holds it dead: fenced.
    assert events(net, master, "fenced")
    assert not events(net, other, "fenced")


def test_four_nodes_split_two_two_the_half_with_the_smallest_id_keeps_a_master() -> None:
    net = network(4, seed=8)
    formed(net)
    net.partition(["n0", "n3"], ["n1", "n2"])
    net.run_for(4.0)
    assert {i for i in net.ids if state(net, i).role is Role.MASTER} <= {"n0", "n3"}
    assert len(net.masters_now()) == 1
    assert state(net, "n1").master == state(net, "n2").master == ""
    net.heal()
    formed(net, 3.0)


# --------------------------------------------------------------- membership

def test_a_node_started_later_joins_the_existing_master() -> None:
    net = network(3, seed=9)
    master = formed(net)
    term = state(net, master).term
    net.add_node("n9")
    net.run_until_true(lambda: net.agreement() == "" and len(state(net, master).members) == 4,
                       ELECTION.bootstrap)
    assert net.masters_now()[0].node_id == master and state(net, master).term == term
    assert [m.node_id for m in state(net, "n9").members] == ["n0", "n1", "n2", "n9"]
    assert not events(net, "n9", "elected")


def test_a_dead_member_is_marked_then_removed() -> None:
    net = network(4, seed=10)
    master = formed(net)
    victim = next(i for i in net.ids if i != master)
    epoch = state(net, master).epoch
    net.crash(victim)
    crashed = net.now

    def entry() -> MemberEntry | None:
        return next((m for m in state(net, master).members if m.node_id == victim), None)

    net.run_until_true(lambda: getattr(entry(), "state", None) == "dead",
                       HEALTH.dead_after + HEALTH.interval)
    assert state(net, master).epoch > epoch
    net.run_until_true(lambda: entry() is None, HEALTH.remove_after + HEALTH.interval)
    assert net.now - crashed >= HEALTH.remove_after
    net.run_for(0.5)
    assert net.agreement() == ""
    assert all(victim not in [m.node_id for m in state(net, i).members]
               for i in net.ids if i != victim)


def test_a_node_declared_dead_is_fenced_and_rejoins_as_a_new_incarnation() -> None:
    net = network(3, seed=11)
    master = formed(net)
    sleeper = next(i for i in net.ids if i != master)
    net.partition([sleeper])      # a suspended laptop, as the others see it
    net.run_for(HEALTH.dead_after + 0.5)
    assert {m.node_id: m.state for m in state(net, master).members}[sleeper] == "dead"
    net.heal()
    net.run_until_true(lambda: bool(events(net, sleeper, "fenced")), 1.0)
    net.run_until_true(lambda: net.agreement() == "" and all(
        m.state == "alive" for m in state(net, master).members), 2.0)
    entry = {m.node_id: m for m in state(net, master).members}[sleeper]
    assert entry.incarnation == 2 == net.nodes[sleeper].incarnation
    assert net.masters_now()[0].node_id == master


@pytest.mark.parametrize("new_master", [False, True])
def test_a_node_removed_while_cut_off_is_fenced_when_it_returns(new_master: bool) -> None:
    """It missed the view that dropped it (its actors were restarted
    elsewhere meanwhile): back as the same incarnation it is fenced, not
    taken in again; also by a master elected after the removal."""
    net = network(3, seed=16)
    master = formed(net)
    away = next(i for i in net.ids if i != master)
    net.partition([away])
    net.run_until_true(lambda: away not in [m.node_id for m in state(net, master).members],
                       HEALTH.dead_after + HEALTH.remove_after + 1.0)
    if new_master:
        net.crash(master)
        rest = [i for i in net.ids if i not in (master, away)]
        net.partition([away], rest)
        net.run_until_true(lambda: state(net, rest[0]).role is Role.MASTER, 5.0)
        net.restart(master)
    net.heal()
    net.run_until_true(lambda: bool(events(net, away, "fenced")), 2.0)

    def listed() -> dict[str, int]:
        return {m.node_id: m.incarnation
                for m in net.masters_now()[0].manager.state.members if m.state == "alive"}

    net.run_until_true(lambda: net.agreement() == "" and away in listed(),
                       ELECTION.bootstrap + 3.0)
    assert listed()[away] == 2 == net.nodes[away].incarnation


@pytest.mark.parametrize("seed", [12, 13, 14, 15])
def test_two_clusters_formed_apart_merge_under_the_higher_term(seed: int) -> None:
    net = network(5, seed=seed)
    net.partition(["n0", "n1", "n2"], ["n3", "n4"])
    net.run_for(ELECTION.bootstrap + 2.0)
    big = next(i for i in ("n0", "n1", "n2") if state(net, i).role is Role.MASTER)
    small = next(i for i in ("n3", "n4") if state(net, i).role is Role.MASTER)
    terms = state(net, big).term, state(net, small).term
    winner, loser = (big, small) if terms[0] > terms[1] else (small, big)
    net.heal()
    assert formed(net, 3.0) == winner
    assert state(net, winner).term > max(terms)
    assert sorted(m.node_id for m in state(net, winner).members) == net.ids
    assert events(net, loser, "no_master")


def test_a_join_that_claims_the_masters_own_id_is_refused() -> None:
    net = network(2, seed=14)
    master = formed(net)
    manager = net.nodes[master].manager
    manager.events()
    epoch = manager.state.epoch
    clone = {"node_id": master, "address": "sim://clone", "incarnation": 7}
    manager.receive("n7", JoinCluster(0, [{"node_id": "n7", "address": "sim://n7",
                                           "incarnation": 1}, clone]), net.now)
    refused = [e for e in manager.events() if e.kind == "refused"]
    assert len(refused) == 1 and master in refused[0].detail
    assert manager.state.epoch == epoch and manager.statistics().joins_refused == 1


# -------------------------------------------------------------- stale terms

def test_messages_from_a_stale_term_are_refused() -> None:
    net = network(3, seed=13)
    master = formed(net)
    follower = next(i for i in net.ids if i != master)
    manager = net.nodes[follower].manager
    before = manager.state
    stale = before.term - 1
    manager.receive("n9", ClusterView(stale, "n9", before.epoch + 5, []), net.now)
    manager.receive("n9", Beat("n9", 1, "sim://n9", stale, "n9", before.epoch + 5, 1, 0.0),
                    net.now)
    after = manager.state
    assert (after.master, after.term, after.epoch) == (before.master, before.term, before.epoch)
    assert manager.statistics().stale >= 2


def test_a_fresh_node_elects_nobody_during_bootstrap() -> None:
    me = {"node_id": "a", "address": "tcp://127.0.0.1:1", "incarnation": 1}
    m = ElectionManager(me, ELECTION, HEALTH, now=0.0, rng=random.Random(1))
    t = 0.0
    while t < ELECTION.bootstrap - HEALTH.interval:
        assert m.tick(t) == []
        t += HEALTH.interval
    assert m.state.role is Role.FOLLOWER and m.state.term == 0
    out = m.receive("b", VoteRequest(7, "b", 0, False), t)
    assert not out[0].message.granted and out[0].message.reason == "bootstrapping"
    m.tick(ELECTION.bootstrap)                      # alone: it founds its own cluster
    m.tick(ELECTION.bootstrap + ELECTION.timeout)
    assert m.state.role is Role.MASTER and m.state.term > 0
    assert [e.kind for e in m.events()][:2] == ["elected", "master"]
