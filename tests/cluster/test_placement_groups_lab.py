"""Placement groups and scheduling strategies across machines: three hosts
of a network-namespace lab (tests/netlab.py), one node daemon on each
(static peers), one driver on host 1 for the whole module.

The driver runs the steps the tests send on its stdin and prints one JSON
line per step (node ids as its actors and tasks report them with
``pmetal.get_runtime_context().get_node_id()``, and
``available_resources()`` before, during and after). Needs root (the lab)
and skips otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from netlab import NetLab, lab_available

from cluster.lab import LabCluster, read_line

pytestmark = pytest.mark.skipif(lab_available() is not None,
                                reason=lab_available() or "")

HOSTS = [1, 2, 3]

DRIVER = r"""
import json, sys, threading, time
import pmetal
from pmetal.util import (get_placement_group, placement_group, placement_group_table,
                         remove_placement_group)
from pmetal.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
from pmetal.util.scheduling_strategies import PlacementGroupSchedulingStrategy as InGroup

@pmetal.remote
class Where:
    def node(self):
        return pmetal.get_runtime_context().get_node_id()

@pmetal.remote
def where():
    return pmetal.get_runtime_context().get_node_id()

@pmetal.remote
def fan_out(count):
    # A task that starts SPREAD tasks and waits for them (each node has one
    # task worker: the children must not queue behind their parents).
    return pmetal.get([where.options(scheduling_strategy="SPREAD").remote()
                       for _ in range(count)], timeout=20)

def cpus():
    return pmetal.available_resources()["CPU"]

def in_group(strategy, count, cpu):
    before = cpus()
    pg = placement_group([{"CPU": cpu}] * count, strategy=strategy)
    assert pg.wait(10), placement_group_table(pg)
    held = cpus()
    actors = [Where.options(num_cpus=cpu, scheduling_strategy=InGroup(pg, i)).remote()
              for i in range(count)]
    nodes = pmetal.get([a.node.remote() for a in actors], timeout=10)
    tasks = pmetal.get([where.options(scheduling_strategy=InGroup(pg, i)).remote()
                        for i in range(count)], timeout=10)
    table = placement_group_table(pg)["bundles_to_node_id"]
    remove_placement_group(pg)
    return {"actors": nodes, "tasks": tasks, "bundles": [table[i] for i in range(count)],
            "before": before, "held": held, "after": cpus()}

def infeasible(count):
    before = cpus()
    pg = placement_group([{"CPU": 1}] * count, strategy="STRICT_SPREAD")
    waited = pg.wait(1.0)
    entry = placement_group_table(pg)
    during = cpus()
    ready = pg.ready()
    remove_placement_group(pg)
    try:
        pmetal.get(ready, timeout=10)
        error = ""
    except pmetal.PlacementError as exc:
        error = str(exc)
    return {"waited": waited, "state": entry["state"], "why": entry["stats"]["scheduling_state"],
            "before": before, "during": during, "after": cpus(), "error": error}

def affinity(*nodes):
    refs = [where.options(scheduling_strategy=On(n)).remote() for n in nodes for _ in range(2)]
    try:
        pmetal.get(where.options(scheduling_strategy=On("f" * 16)).remote(), timeout=10)
        error = ""
    except pmetal.PlacementError as exc:
        error = str(exc)
    soft = pmetal.get(where.options(scheduling_strategy=On("f" * 16, soft=True)).remote(),
                      timeout=10)
    return {"ran": pmetal.get(refs, timeout=10), "error": error, "soft": soft}

def spread(count):
    return {"ran": pmetal.get([where.options(scheduling_strategy="SPREAD").remote()
                               for _ in range(count)], timeout=10),
            "nested": pmetal.get([fan_out.options(scheduling_strategy="SPREAD").remote(3)
                                  for _ in range(3)], timeout=30)}

def stays(name, seconds):
    deadline = time.monotonic() + seconds
    pause = threading.Event()
    states = set()
    while time.monotonic() < deadline:
        states.add(placement_group_table(get_placement_group(name))["state"])
        pause.wait(0.1)
    return {"states": sorted(states)}

def owner_gone(name):
    deadline = time.monotonic() + 10
    pause = threading.Event()
    while time.monotonic() < deadline:
        try:
            get_placement_group(name)
        except ValueError:
            why = [e["stats"]["scheduling_state"] for e in placement_group_table().values()
                   if e["name"] == name]
            return {"gone": True, "after": cpus(), "why": why}
        pause.wait(0.05)
    return {"gone": False}

def created(name):
    return {"state": placement_group_table(get_placement_group(name))["state"],
            "cpus": cpus()}

KEPT = {}

def before_loss():
    moving = placement_group([{"CPU": 0.5}] * 3, strategy="SPREAD", name="moving")
    stuck = placement_group([{"CPU": 0.5}] * 3, strategy="STRICT_SPREAD", name="stuck")
    assert moving.wait(10) and stuck.wait(10)
    table = placement_group_table(moving)["bundles_to_node_id"]
    here = [i for i in range(3) if table[i] == pmetal.get_runtime_context().get_node_id()][0]
    KEPT["actor"] = Where.options(num_cpus=0.25,
                                  scheduling_strategy=InGroup(moving, here)).remote()
    # On the host to die (the last bundle's, not ours): restarted in its bundle's new place.
    doomed = [i for i in range(3) if table[i] != table[here]][-1]
    KEPT["restarted"] = Where.options(num_cpus=0.25, max_restarts=1, max_task_retries=1,
                                      scheduling_strategy=InGroup(moving, doomed)).remote()
    pmetal.get([KEPT["actor"].node.remote(), KEPT["restarted"].node.remote()], timeout=10)
    return {"moving": [table[i] for i in range(3)], "doomed": doomed, "doomed_on": table[doomed]}

def after_loss(dead):
    moving, stuck = get_placement_group("moving"), get_placement_group("stuck")
    deadline = time.monotonic() + 15
    pause = threading.Event()
    while time.monotonic() < deadline:
        entry = placement_group_table(moving)
        if entry["state"] == "CREATED" and dead not in entry["bundles_to_node_id"].values():
            break
        pause.wait(0.05)
    nodes = [entry["bundles_to_node_id"].get(i) for i in range(3)]
    # Its restart may still be under way (a slow one under load took more
    # than actors.restart_wait): the call waits for it, as the node says
    # "restarting" (before, it failed with "no actor ... in this cluster").
    restarted = pmetal.get(KEPT["restarted"].node.remote(), timeout=30)
    actors = [Where.options(num_cpus=0.25, scheduling_strategy=InGroup(moving, i)).remote()
              for i in range(3)]
    out = {"moving": nodes, "state": entry["state"],
           "stuck": placement_group_table(stuck)["state"],
           "stuck_ready": stuck.wait(0.2),
           "kept": pmetal.get(KEPT["actor"].node.remote(), timeout=10),
           "restarted": restarted,
           "actors": pmetal.get([a.node.remote() for a in actors], timeout=10)}
    remove_placement_group(moving)
    remove_placement_group(stuck)
    return out

STEPS = {"in_group": in_group, "infeasible": infeasible, "affinity": affinity,
         "spread": spread, "owner_gone": owner_gone, "created": created,
         "before_loss": before_loss, "after_loss": after_loss, "stays": stays}
pmetal.init(address=sys.argv[1], psk=bytes.fromhex(sys.argv[2]), namespace="lab")
print(json.dumps({"step": "ready", "node": pmetal.get_runtime_context().get_node_id(),
                  "cpus": cpus()}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        out = STEPS[cmd["step"]](*cmd.get("args", []))
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps({"step": cmd["step"], **out}), flush=True)
"""

# A second driver (host 2) that makes a group, says so, and exits.
# "remote": as a driver on another machine (no shared-memory token to prove
# it shares its node's machine), so its node gives it a lease to renew.
OWNER = r"""
import json, sys
import pmetal
from pmetal.util import placement_group
if sys.argv[4] == "remote":
    from pmetal import shm
    shm._posixshmem = None
pmetal.init(address=sys.argv[1], psk=bytes.fromhex(sys.argv[2]), namespace="lab")
pg = placement_group([{"CPU": 1}], strategy="STRICT_PACK", name=sys.argv[3])
assert pg.wait(10)
print(json.dumps({"step": "made"}), flush=True)
sys.stdin.readline()
"""


class Driver:
    def __init__(self, proc: Any, hello: dict[str, Any]) -> None:
        self.proc = proc
        self.node = hello["node"]
        self.cpus = hello["cpus"]

    def run(self, step: str, *args: Any, timeout: float = 15.0) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"step": step, "args": list(args)}).encode() + b"\n")
        self.proc.stdin.flush()
        out = read_line(self.proc, timeout, step)
        assert "error" not in out or step in ("affinity", "infeasible"), out
        return out


LEASE = 2.0   # s: the nodes' owner lease (a driver that is not watched renews it)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabCluster]:
    with NetLab(len(HOSTS)) as net:
        c = LabCluster(net, tmp_path_factory.mktemp("pglab"), discovery=False,
                       env={"PMETAL_ACTORS_OWNER_LEASE": str(LEASE)})
        try:
            c.start_many(HOSTS)
            c.wait(lambda: c.agreed(HOSTS, members=HOSTS), 30.0, "3 members agreed")
            yield c
        finally:
            c.close()


@pytest.fixture(scope="module")
def driver(lab: LabCluster) -> Iterator[Driver]:
    with lab.driver(1, DRIVER, [lab.nodes[1].address, lab.psk.hex()], "pg-driver",
                    stdin=True) as proc:
        yield Driver(proc, read_line(proc, 30.0, "ready"))


def ids(lab: LabCluster) -> list[str]:
    return [lab.nodes[i].node_id for i in HOSTS]


def test_strict_spread_puts_each_bundle_on_another_host(lab: LabCluster,
                                                        driver: Driver) -> None:
    out = driver.run("in_group", "STRICT_SPREAD", 3, 1.0)
    assert sorted(out["actors"]) == sorted(ids(lab)), out   # one actor on each host
    assert out["actors"] == out["bundles"] == out["tasks"], out   # each in its bundle's host
    assert (out["before"] - out["held"], out["after"]) == (3.0, out["before"]), out


def test_strict_pack_puts_every_bundle_on_one_host(lab: LabCluster, driver: Driver) -> None:
    out = driver.run("in_group", "STRICT_PACK", 3, 0.5)
    assert set(out["actors"]) == set(out["tasks"]) == set(out["bundles"]) == {driver.node}, out
    assert (out["before"] - out["held"], out["after"]) == (1.5, out["before"]), out


def test_spread_and_pack_groups(lab: LabCluster, driver: Driver) -> None:
    spread = driver.run("in_group", "SPREAD", 3, 1.0)
    assert sorted(spread["bundles"]) == sorted(ids(lab)), spread
    pack = driver.run("in_group", "PACK", 2, 1.0)   # fits the driver's host: stays there
    assert pack["bundles"] == [driver.node] * 2 and pack["actors"] == pack["bundles"], pack


def test_an_infeasible_strict_spread_stays_pending_until_removed(driver: Driver) -> None:
    out = driver.run("infeasible", 4)
    assert (out["waited"], out["state"]) == (False, "PENDING"), out
    assert "STRICT_SPREAD needs 4 nodes" in out["why"] and "has 3" in out["why"], out
    assert out["before"] == out["during"] == out["after"] == driver.cpus, out
    assert "was removed" in out["error"], out


def test_tasks_with_node_affinity_run_on_the_named_host(lab: LabCluster,
                                                        driver: Driver) -> None:
    out = driver.run("affinity", *ids(lab))
    assert out["ran"] == [n for n in ids(lab) for _ in range(2)], out
    assert "node affinity: node ffffffffffffffff is not a live member" in out["error"], out
    assert out["soft"] == driver.node, out


def test_spread_tasks_land_on_every_host(lab: LabCluster, driver: Driver) -> None:
    out = driver.run("spread", 6, timeout=40.0)
    assert sorted(set(out["ran"])) == sorted(ids(lab)), out
    # SPREAD tasks started by SPREAD tasks (one task worker per host) all ran.
    assert all(len(ran) == 3 and set(ran) <= set(ids(lab)) for ran in out["nested"]), out


@pytest.mark.parametrize("where, end, why", [
    ("local", "shutdown", "shut down"), ("local", "killed", "exited"),
    ("remote", "killed", "lease lapsed")])
def test_a_group_ends_with_the_driver_that_made_it(lab: LabCluster, driver: Driver, where: str,
                                                    end: str, why: str) -> None:
    """A driver of node 2 makes a group, then shuts down (pmetal.shutdown at
    exit tells its node) or is killed: its node watches its pid, or, for a
    driver that cannot prove it shares the node's machine ("remote"), the
    lease it renews (it does: the group outlives 1.5 leases) lapses."""
    name = f"owned-{where}-{end}"
    with lab.driver(2, OWNER, [lab.nodes[2].address, lab.psk.hex(), name, where], name,
                    stdin=True) as owner:
        read_line(owner, 20.0, "made")
        made = driver.run("created", name)
        assert made["state"] == "CREATED" and made["cpus"] == driver.cpus - 1, made
        if where == "remote":
            assert driver.run("stays", name, 1.5 * LEASE)["states"] == ["CREATED"]
        if end == "killed":
            owner.kill()
        else:
            owner.stdin.close()   # the script ends: pmetal.shutdown() at exit
        owner.wait(timeout=10)
    out = driver.run("owner_gone", name)
    assert out["gone"] and out["after"] == driver.cpus, out
    assert len(out["why"]) == 1 and "its owner" in out["why"][0] and why in out["why"][0], out


def test_the_bundles_of_a_dead_host_are_placed_again(lab: LabCluster, driver: Driver) -> None:
    """Last in the module (it kills a host other than the driver's, then
    starts its node again): a SPREAD group's bundle on the dead host goes to
    a live one, and the restartable actor placed in it follows; its other
    bundles (and the actor in one) stay; a STRICT_SPREAD group of three
    cannot, and is RESCHEDULING (not ready) until a third host is back."""
    before = driver.run("before_loss")
    dead = before["doomed_on"]
    assert sorted(before["moving"]) == sorted(ids(lab)), before
    host = next(i for i in HOSTS if lab.nodes[i].node_id == dead)
    lab.kill(host)
    try:
        out = driver.run("after_loss", dead, timeout=30.0)
        assert out["state"] == "CREATED" and dead not in out["moving"], out
        assert [n for n in out["moving"] if n] == out["moving"], out
        kept = [n for n, m in zip(before["moving"], out["moving"]) if n != dead]
        assert kept == [n for n, b in zip(out["moving"], before["moving"]) if b != dead], out
        assert out["actors"] == out["moving"] and out["kept"] == driver.node, out
        assert (out["stuck"], out["stuck_ready"]) == ("RESCHEDULING", False), out
        # The actor of the lost bundle came back where that bundle went.
        assert out["restarted"] == out["moving"][before["doomed"]] != dead, out
    finally:
        lab.start(host)
        lab.wait(lambda: lab.agreed(HOSTS, members=HOSTS), 30.0, "host 3 back")
