"""A two-machine cluster survives either machine's loss, and a healed split
leaves one copy of each actor (docs/cluster.md, "Two-node clusters").

Two hosts of a network-namespace lab (tests/netlab.py), one node daemon
each (static peers), a driver on the host that is not the master's. The
driver places a restartable actor on the master's host; then the master's
host dies (SIGKILL to every process on it) or is cut off, and the driver,
on the survivor, restarts the actor, creates another and forms a
collective group, each timed from the fault. The issue's target is 2 s
from the loss; the bound asserted is 4 s, which holds with other tests
beside these on two cores, and the figures are printed (``-s``).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netlab import lab_available

from .lab import ROOT, LabCluster, formed_cluster

pytestmark = pytest.mark.skipif(lab_available() is not None, reason=lab_available() or "")

HOSTS = [1, 2]
BOUND = 4.0    # s from the fault; the target is 2 s
STEP = 30.0    # s any other step may take before the test calls it a hang

DRIVER = r"""
import json, os, sys, time
import numpy as np
import pmetal
from pmetal import collective
from pmetal.config import load_config

@pmetal.remote(max_restarts=3)
class Keeper:
    def __init__(self):
        self.n = 0
    def incr(self):
        self.n += 1
        return self.n

@pmetal.remote
class Rank:
    def ping(self):
        return os.getpid()
    def reduce(self, name):
        return float(collective.get_group(name).all_reduce(np.ones(4, np.float32)).sum())

def emit(**kw):
    print(json.dumps({"t": time.time(), **kw}), flush=True)

pmetal.init(address=sys.argv[1], psk=bytes.fromhex(sys.argv[2]), namespace=sys.argv[3],
            config=load_config(transport={"request_timeout": 20.0, "connect_timeout": 10.0}))
k = Keeper.options(node=sys.argv[4], name="keeper").remote()
n = pmetal.get(k.incr.remote(), timeout=20)
# The same steps on the whole cluster, for comparison.
t0 = time.monotonic()
ranks = [Rank.remote() for _ in range(2)]
pmetal.get([r.ping.remote() for r in ranks], timeout=20)
placing = time.monotonic() - t0
t0 = time.monotonic()
collective.create_group(ranks, name="both")
forming = time.monotonic() - t0
for r in ranks:
    pmetal.kill(r)
emit(step="created", n=n, node=k._node_id, placing=placing, forming=forming)
sys.stdin.readline()   # the test takes the master's host away now
t0 = time.monotonic()
while True:   # the restart: calls fail (ActorDiedError) until it answers
    try:
        n = pmetal.get(k.incr.remote(), timeout=10)
        break
    except pmetal.ActorDiedError:
        if time.monotonic() - t0 > 30:
            raise
emit(step="restarted", after=time.monotonic() - t0, n=n, node=k._node_id)
ranks = [Rank.remote() for _ in range(2)]
pmetal.get([r.ping.remote() for r in ranks], timeout=20)
emit(step="placed", after=time.monotonic() - t0)
group = collective.create_group(ranks, name="two")
emit(step="group", after=time.monotonic() - t0, term=group.term)
sums = pmetal.get([r.reduce.remote("two") for r in ranks], timeout=20)
emit(step="reduced", after=time.monotonic() - t0, sums=sums)
sys.stdin.readline()   # the test heals the network (if it cut it) and looks
emit(step="after", n=pmetal.get(k.incr.remote(), timeout=10), node=k._node_id)
"""


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[LabCluster]:
    with formed_cluster(HOSTS, tmp_path) as c:
        yield c


def _report(what: str, seconds: float) -> None:
    print(f"\n[two nodes] {what}: {seconds:.3f} s", flush=True)


def _status(c: LabCluster, index: int) -> dict:
    return c.status(index)


def _copies(c: LabCluster, name: str, hosts: list[int]) -> list[int]:
    """Those of ``hosts`` whose node holds a record of actor ``name`` that is
    not dead."""
    return [i for i in hosts for a in _status(c, i)["actors"]
            if a.get("name") == name and a.get("state") != "dead"]


class _Driver:
    def __init__(self, c: LabCluster, index: int, target: str) -> None:
        node = c.nodes[index]
        self.proc = c.lab.python(index, DRIVER, node.address, c.psk.hex(), c.namespace, target,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=(c.tmp / "driver.log").open("wb"),
                                 env=c._env(index, c.psk), cwd=ROOT, text=True)
        self.log = c.tmp / "driver.log"

    def step(self, name: str) -> dict:
        from .lab import read_line
        try:
            return read_line(self.proc, STEP, name)   # type: ignore[arg-type]
        except AssertionError:
            print(self.log.read_text(errors="replace")[-3000:])
            raise

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def _start(c: LabCluster) -> tuple[int, int, _Driver]:
    master = c.nodes[HOSTS[0]].state["master"]
    lost = next(i for i in HOSTS if c.nodes[i].node_id == master)
    survivor = next(i for i in HOSTS if i != lost)
    driver = _Driver(c, survivor, master)
    created = driver.step("created")
    assert created["n"] == 1 and created["node"] == master, created
    _report("two actors placed and answering, whole cluster", created["placing"])
    _report("create_group, whole cluster", created["forming"])
    return lost, survivor, driver


def _after_the_loss(driver: _Driver, survivor_id: str) -> None:
    restarted = driver.step("restarted")
    placed = driver.step("placed")
    group = driver.step("group")
    reduced = driver.step("reduced")
    _report("loss to the restartable actor answering on the survivor", restarted["after"])
    _report("loss to two new actors placed and answering", placed["after"])
    _report("loss to create_group returning", group["after"])
    assert restarted["node"] == survivor_id and restarted["n"] == 1, restarted
    assert reduced["sums"] == [8.0, 8.0], reduced
    assert restarted["after"] < BOUND and placed["after"] < BOUND, (restarted, placed)
    assert group["after"] < BOUND, group


def test_the_survivor_of_the_masters_death_restarts_places_and_forms_groups(
        pair: LabCluster) -> None:
    lost, survivor, driver = _start(pair)
    try:
        pair.kill(lost)   # kill -9 of every process on the master's host
        driver.go()
        _after_the_loss(driver, pair.nodes[survivor].node_id)
        state = pair.nodes[survivor].state
        assert state["master"] == pair.nodes[survivor].node_id, state
        assert _copies(pair, "keeper", [survivor]) == [survivor]
    finally:
        driver.close()


def test_a_healed_split_leaves_one_copy_the_higher_terms(pair: LabCluster) -> None:
    lost, survivor, driver = _start(pair)
    try:
        pair.lab.isolate(lost)   # the cable, not the machine: the master lives on
        cut = time.monotonic()
        driver.go()
        _after_the_loss(driver, pair.nodes[survivor].node_id)
        # Each side has a master while cut off: the sitting one kept its
        # role, the survivor took a term above it.
        pair.wait(lambda: pair.nodes[survivor].state.get("master")
                  == pair.nodes[survivor].node_id, STEP, "the survivor is master")
        survivor_term = pair.nodes[survivor].state["term"]
        pair.lab.rejoin(lost)
        healed = time.monotonic()
        took = pair.wait(lambda: pair.agreed(HOSTS, members=HOSTS), STEP,
                         "one master over both hosts again")
        _report("rejoin to one master over both hosts", took)
        state = pair.nodes[lost].state
        assert state["master"] == pair.nodes[survivor].node_id, state   # the higher term
        assert state["term"] >= survivor_term
        # The loser was fenced: its copy of the actor ended, the winner's lives.
        deadline = time.monotonic() + STEP
        while (copies := _copies(pair, "keeper", HOSTS)) != [survivor]:
            assert time.monotonic() < deadline, f"copies of the actor on hosts {copies}"
            time.sleep(0.2)
        driver.go()
        after = driver.step("after")
        assert after["node"] == pair.nodes[survivor].node_id and after["n"] == 2, after
        _report("cut to heal", healed - cut)
    finally:
        driver.close()
