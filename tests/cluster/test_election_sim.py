"""The election under 10,000 seeded random schedules of faults.

Each schedule (one seed) builds a network of 2 to 7 nodes with a random
message delay (up to 50 ms) and loss (up to 20 %), runs a few simulated
seconds of random faults (crashes, restarts with no memory, partitions
into random groups, heals), then heals everything, restarts what crashed
and lets the network run without faults (the loss stays) for
:data:`STABLE` seconds. Checked all along: no term ever has two masters
(:class:`tests.cluster.simnet.Violation`); checked after the faults: within
:data:`STABLE` seconds every node follows one master, with one term and one
epoch (checked as a moment when all agree: with loss, a follower may lose
its master for a moment later and find it again).

A failing seed names itself; ``PMETAL_SIM_SEED=1234 pytest
tests/cluster/test_election_sim.py`` reruns just that seed.
``PMETAL_SIM_SCHEDULES`` changes how many schedules run (default 5,000; run
10,000 or more after a change to the election).
"""

from __future__ import annotations

import os
import random
import time

import pytest

from pmetal.config import ElectionConfig, HealthConfig
from tests.cluster.simnet import SimNet

SCHEDULES = int(os.environ.get("PMETAL_SIM_SCHEDULES", "5000"))
CHUNKS = 10
STABLE = 8.0            # simulated seconds without faults within which all must agree
# Beats every 0.25 s instead of 0.1 s keep a schedule to a few hundred
# messages; the election's own timing is the default one.
HEALTH = HealthConfig(interval=0.25, degraded_after=0.5, suspect_after=0.75, dead_after=1.0,
                      remove_after=3.0)
ELECTION = ElectionConfig(timeout=0.8, bootstrap=2.0)


def run_schedule(seed: int, trace: list[SimNet] | None = None) -> SimNet:
    """Run the schedule of ``seed``; raise AssertionError naming the seed
    if it breaks a rule. ``trace`` receives the network before it runs."""
    rng = random.Random(seed)
    n = rng.randint(2, 7)
    net = SimNet(n, seed, loss=rng.uniform(0, 0.2), max_delay=rng.uniform(0, 0.05),
                 election=ELECTION, health=HEALTH)
    if trace is not None:
        trace.append(net)
    faults_end = rng.uniform(2.5, 5.0)
    for _ in range(rng.randint(1, 5)):
        when = rng.uniform(0, faults_end)
        fault = rng.random()
        node = rng.choice(net.ids)
        if fault < 0.3:
            net.at(when, lambda node=node: net.crash(node))
        elif fault < 0.5:
            net.at(when, lambda node=node: net.restart(node) if not net.nodes[node].alive
                   else None)
        elif fault < 0.85:
            groups = rng.randint(2, 3)
            split = {node_id: rng.randrange(groups) for node_id in net.ids}
            net.at(when, lambda split=split, groups=groups: net.partition(
                *([k for k, g in split.items() if g == i] for i in range(groups))))
        else:
            net.at(when, net.heal)
    net.run_until(faults_end)
    net.heal()
    for node in list(net.nodes.values()):
        if not node.alive:
            net.restart(node.node_id)
    end = net.now + STABLE
    while net.agreement():
        if net.now >= end:
            raise AssertionError(f"seed {seed}: no single master {STABLE} s after the faults "
                                 f"ended: {net.agreement()}; rerun with PMETAL_SIM_SEED={seed}")
        net.run_for(0.05)
    return net


def _seeds(chunk: int) -> range:
    size = -(-SCHEDULES // CHUNKS)
    return range(chunk * size, min(SCHEDULES, (chunk + 1) * size))


@pytest.mark.skipif("PMETAL_SIM_SEED" in os.environ, reason="PMETAL_SIM_SEED reruns one seed")
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_schedules(chunk: int, record_property: pytest.RecordProperty) -> None:
    start = time.perf_counter()
    seeds = _seeds(chunk)
    messages = 0
    for seed in seeds:
        messages += run_schedule(seed).messages
    took = time.perf_counter() - start
    record_property("schedules", len(seeds))
    record_property("seconds", round(took, 2))
    record_property("messages", messages)


def test_one_seed() -> None:
    """One schedule, printing what every node saw (with ``-s``): seed 0, or
    ``PMETAL_SIM_SEED`` to rerun a failing one."""
    trace: list[SimNet] = []
    try:
        run_schedule(int(os.environ.get("PMETAL_SIM_SEED", "0")), trace)
    finally:
        net = trace[0]
        for at, node_id, event in net.log:
            print(f"{at:8.3f} {node_id} {event.kind} term={event.term} master={event.master} "
                  f"epoch={event.epoch} {event.detail}")
        for node in net.nodes.values():
            s = node.manager.state
            print(f"{node.node_id} alive={node.alive} incarnation={node.incarnation} "
                  f"{s.role.value} term={s.term} master={s.master} epoch={s.epoch} members="
                  f"{[(m.node_id, m.incarnation, m.state) for m in s.members]}")
