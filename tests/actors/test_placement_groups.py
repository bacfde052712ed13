"""Placement groups on one embedded node (loopback): the API, what a group
holds, pending groups, removal, and every refusal of bad input.

The module shares one ``pmetal.init(num_cpus=4)``. Across machines (the
strategies that need several nodes, tasks on other nodes) see
``tests/cluster/test_placement_groups_lab.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

import pmetal
import pmetal.util
from pmetal.errors import GetTimeoutError, PlacementError, PMetalTypeError, PMetalValueError
from pmetal.util import (PlacementGroup, get_placement_group, placement_group,
                         placement_group_table, remove_placement_group)
from pmetal.util.scheduling_strategies import PlacementGroupSchedulingStrategy as InGroup

from .conftest import WAIT, shutdown_quietly, wait_until

CPUS = 4.0


@pytest.fixture(scope="module", autouse=True)
def node() -> Iterator[dict[str, Any]]:
    if pmetal.is_initialized():
        shutdown_quietly()
    info = pmetal.init(num_workers=2, num_cpus=CPUS)
    try:
        yield info
    finally:
        shutdown_quietly()


@pytest.fixture
def groups() -> Iterator[list[PlacementGroup]]:
    """Groups to remove after the test (the node's CPUs are all free again)."""
    made: list[PlacementGroup] = []
    yield made
    for pg in made:
        remove_placement_group(pg)
    assert pmetal.available_resources()["CPU"] == CPUS


@pmetal.remote
class Where:
    def node(self) -> str:
        return pmetal.get_runtime_context().get_node_id()


@pmetal.remote
def pid() -> int:
    return os.getpid()


def cpus() -> float:
    return pmetal.available_resources()["CPU"]


def test_rays_import_paths() -> None:
    import importlib
    from pmetal.util import scheduling_strategies
    module = importlib.import_module("pmetal.util.placement_group")   # as Ray: the function
    # is pmetal.util.placement_group, the module is what `from ... import` reads
    assert pmetal.util.placement_group is placement_group is module.placement_group
    assert scheduling_strategies.PlacementGroupSchedulingStrategy is InGroup
    assert module.PlacementGroup is PlacementGroup


def test_a_group_holds_its_bundles_and_its_actors_take_from_them(
        groups: list[PlacementGroup], node: dict[str, Any]) -> None:
    pg = placement_group([{"CPU": 1}, {"CPU": 2}], strategy="STRICT_PACK", name="held")
    groups.append(pg)
    assert pmetal.get(pg.ready(), timeout=WAIT) == pg   # Ray: ready() resolves to the group
    assert pg.wait(0) is True
    assert (pg.bundle_count, pg.bundle_specs) == (2, [{"CPU": 1.0}, {"CPU": 2.0}])
    assert pg.id.hex() == pg.id and get_placement_group("held") == pg
    assert cpus() == CPUS - 3   # held by the group, whether or not anything runs in it
    entry = placement_group_table(pg)
    assert entry["state"] == "CREATED" and entry["strategy"] == "STRICT_PACK"
    assert entry["bundles_to_node_id"] == {0: node["node_id"], 1: node["node_id"]}
    assert pg.id in placement_group_table()

    # An actor in bundle 1 takes its CPUs from the bundle, not the node.
    actor = Where.options(num_cpus=2, scheduling_strategy=InGroup(pg, 1)).remote()
    assert pmetal.get(actor.node.remote(), timeout=WAIT) == node["node_id"]
    assert cpus() == CPUS - 3
    # The bundle is full now; a bigger actor than a bundle never fits.
    with pytest.raises(PlacementError, match="more than any bundle"):
        Where.options(num_cpus=3, scheduling_strategy=InGroup(pg)).remote()
    # Tasks run in it too (checked against the bundle, not held), the old options too.
    assert pmetal.get(pid.options(scheduling_strategy=InGroup(pg, 0)).remote(), timeout=WAIT)
    assert pmetal.get(pid.options(placement_group=pg, placement_group_bundle_index=0).remote(),
                      timeout=WAIT)
    legacy = Where.options(placement_group=pg, placement_group_bundle_index=0).remote()
    assert pmetal.get(legacy.node.remote(), timeout=WAIT) == node["node_id"]

    # Removing the group ends its actors and gives its CPUs back.
    remove_placement_group(pg)
    groups.remove(pg)
    assert cpus() == CPUS
    # A call sent while the group's actors are being ended may see only its
    # connection drop ("its process died"); once that is known here, a call
    # says why the actor is dead.
    with pytest.raises(pmetal.ActorDiedError):
        pmetal.get(actor.node.remote(), timeout=WAIT)
    with pytest.raises(pmetal.ActorDiedError, match="placement group .* was removed"):
        pmetal.get(actor.node.remote(), timeout=WAIT)
    with pytest.raises(PlacementError, match="was removed"):
        pg.wait(0)
    with pytest.raises(PlacementError, match="was removed"):
        Where.options(scheduling_strategy=InGroup(pg)).remote()
    with pytest.raises(PlacementError, match="was removed"):
        pmetal.get(pid.options(scheduling_strategy=InGroup(pg)).remote(), timeout=WAIT)
    assert placement_group_table(pg)["state"] == "REMOVED"
    with pytest.raises(PMetalValueError, match="no placement group named 'held'"):
        get_placement_group("held")


def test_an_infeasible_group_stays_pending_until_removed() -> None:
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    assert pg.wait(0.2) is False   # one node: two bundles on different nodes never fit
    with pytest.raises(GetTimeoutError):
        pmetal.get(pg.ready(), timeout=0.1)
    entry = placement_group_table(pg)
    assert entry["state"] == "PENDING" and entry["bundles_to_node_id"] == {}
    assert "infeasible: STRICT_SPREAD needs 2 nodes" in entry["stats"]["scheduling_state"]
    assert cpus() == CPUS   # a pending group holds nothing
    ready = pg.ready()
    remove_placement_group(pg)
    with pytest.raises(PlacementError, match="was removed"):
        pmetal.get(ready, timeout=WAIT)
    assert cpus() == CPUS


def test_a_pending_group_is_created_once_resources_free(groups: list[PlacementGroup]) -> None:
    first = placement_group([{"CPU": 3}])
    assert first.wait(WAIT)
    second = placement_group([{"CPU": 2}], strategy="PACK")
    groups.append(second)
    assert second.wait(0.1) is False
    assert "waiting for resources" in placement_group_table(second)["stats"]["scheduling_state"]
    # A task for the pending group waits for it (an actor's creation would
    # wait too, up to its deadline); so does one for a group removed meanwhile.
    waiting = pid.options(scheduling_strategy=InGroup(second)).remote()
    doomed = placement_group([{"CPU": 4}])
    never = pid.options(scheduling_strategy=InGroup(doomed)).remote()
    assert pmetal.wait([waiting, never], num_returns=1, timeout=0.1)[0] == []
    remove_placement_group(doomed)
    with pytest.raises(PlacementError, match="was removed"):
        pmetal.get(never, timeout=WAIT)
    remove_placement_group(first)
    assert second.wait(WAIT)
    assert cpus() == CPUS - 2
    assert pmetal.get(waiting, timeout=WAIT) > 0


def test_a_detached_group_and_names(groups: list[PlacementGroup]) -> None:
    pg = placement_group([{"CPU": 0.5}], name="kept", lifetime="detached")
    groups.append(pg)
    assert placement_group_table(pg)["lifetime"] == "detached"
    with pytest.raises(ValueError, match="a placement group named 'kept' already exists"):
        placement_group([{"CPU": 0.5}], name="kept")


@pytest.mark.parametrize("bundles, match", [
    ([], "non-empty list"),
    ({"CPU": 1}, "non-empty list"),
    ([{}], "bundle 0 is {}"),
    ([{"CPU": 1}, {"CPU": 0}], "bundle 1 .* every amount is 0"),
    ([{"CPU": -1}], "must be a finite number >= 0"),
    ([{"CPU": "1"}], "must be a finite number >= 0"),
    ([{"": 1}], "non-empty strings"),
])
def test_bad_bundles_are_refused(bundles: Any, match: str) -> None:
    with pytest.raises(PMetalValueError, match=match):
        placement_group(bundles)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(PMetalValueError, match="unknown strategy 'STRICT_SPRED'; did you mean "
                                               "'STRICT_SPREAD'"):
        placement_group([{"CPU": 1}], strategy="STRICT_SPRED")
    with pytest.raises(PMetalValueError, match="lifetime must be"):
        placement_group([{"CPU": 1}], lifetime="forever")
    with pytest.raises(PMetalTypeError, match="expected a PlacementGroup"):
        remove_placement_group("pg")  # type: ignore[arg-type]
    with pytest.raises(PMetalValueError, match="no placement group named 'nobody'"):
        get_placement_group("nobody")


def test_bad_strategy_options_are_refused(groups: list[PlacementGroup]) -> None:
    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    groups.append(pg)
    with pytest.raises(PMetalValueError, match="placement_group_bundle_index=2 is out of range: "
                                               "placement group .* has 2 bundles"):
        InGroup(pg, 2)
    with pytest.raises(PMetalValueError, match="out of range"):
        Where.options(placement_group=pg, placement_group_bundle_index=-2)
    with pytest.raises(PMetalTypeError, match="must be an int"):
        InGroup(pg, "0")  # type: ignore[arg-type]
    with pytest.raises(PMetalTypeError, match="must be a PlacementGroup"):
        InGroup("pg")
    with pytest.raises(PMetalValueError, match="give one"):
        pid.options(placement_group=pg, scheduling_strategy="SPREAD")
    with pytest.raises(PMetalValueError, match="needs placement_group="):
        pid.options(placement_group_bundle_index=1)
    with pytest.raises(PlacementError, match="more than bundle 0"):
        pmetal.get(pid.options(num_cpus=2, scheduling_strategy=InGroup(pg, 0)).remote(),
                   timeout=WAIT)


def test_a_group_is_removed_when_its_driver_shuts_down() -> None:
    """``pmetal.shutdown()`` ends the driver's non-detached groups, as its
    actors (here: the next init starts a fresh node, so the old node's
    table is read through a second client before the shutdown completes)."""
    from pmetal.actors import context
    pg = placement_group([{"CPU": 1}], name="mine")
    assert pg.wait(WAIT)
    client = context.current()
    assert client.detach(timeout=WAIT) == 1   # the group (it made no actor)
    assert placement_group_table(pg)["state"] == "REMOVED"
    assert cpus() == CPUS


@pmetal.remote
def node_of_task() -> str:
    return pmetal.get_runtime_context().get_node_id()


def test_task_strategies_on_a_node_alone(node: dict[str, Any]) -> None:
    """SPREAD and node affinity on one node run on its own task workers;
    an unknown node, or a task bigger than every node, is a PlacementError."""
    from pmetal.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
    own = node["node_id"]
    refs = [node_of_task.options(scheduling_strategy=s).remote()
            for s in ("SPREAD", "DEFAULT", On(own), On(own[:8]), On("f" * 16, soft=True))]
    assert pmetal.get(refs, timeout=WAIT) == [own] * 5
    with pytest.raises(PlacementError, match="node ffffffffffffffff is not a live member"):
        pmetal.get(node_of_task.options(scheduling_strategy=On("f" * 16)).remote(), timeout=WAIT)
    with pytest.raises(PlacementError, match="no node has that much"):
        pmetal.get(node_of_task.options(num_cpus=64, scheduling_strategy="SPREAD").remote(),
                   timeout=WAIT)


@pmetal.remote
class Parent:
    """Starts a child actor and a child task with no strategy of their own."""

    def group(self) -> Any:
        current = pmetal.util.get_current_placement_group()
        return current.id if current is not None else None

    def children(self) -> tuple[Any, Any, float]:
        child = Parent.options(num_cpus=1).remote()
        task = pmetal.get(node_of_task.remote(), timeout=WAIT)
        return pmetal.get(child.group.remote(), timeout=WAIT), task, cpus()


def test_an_actor_knows_its_group_and_captures_its_children(groups: list[PlacementGroup],
                                                           node: dict[str, Any]) -> None:
    assert pmetal.util.get_current_placement_group() is None   # a driver is in no group
    pg = placement_group([{"CPU": 2}])
    groups.append(pg)
    assert pg.wait(WAIT)
    capturing = Parent.options(num_cpus=1, scheduling_strategy=InGroup(
        pg, placement_group_capture_child_tasks=True)).remote()
    assert pmetal.get(capturing.group.remote(), timeout=WAIT) == pg.id
    child_group, ran_on, free = pmetal.get(capturing.children.remote(), timeout=WAIT)
    assert (child_group, ran_on) == (pg.id, node["node_id"])
    assert free == CPUS - 2   # the child's CPU came out of the bundle, not the node
    plain = Parent.options(scheduling_strategy=InGroup(pg)).remote()
    assert pmetal.get(plain.group.remote(), timeout=WAIT) == pg.id
    child_group, _, free = pmetal.get(plain.children.remote(), timeout=WAIT)
    assert child_group is None and free == CPUS - 3   # not captured: the node's CPU
    pmetal.kill(plain)   # its child dies with it (the node watches the owner's pid)
    wait_until(lambda: cpus() == CPUS - 2, WAIT, what="the uncaptured child's CPU back")


def test_pmetal_status_lists_the_groups(groups: list[PlacementGroup],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from pmetal.actors import context
    from pmetal.cli.status import _print_status
    pg = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD", name="shown")
    groups.append(pg)
    _print_status(context.current().status(), {"pid": 0})
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = next((i for i, line in enumerate(lines) if pg.id in line), None)
    assert at is not None, out
    row, reason = lines[at], lines[at + 1]   # the reason is wrapped under its row
    assert "shown" in row and "STRICT_SPREAD" in row and "PENDING" in row, out
    assert "infeasible: STRICT_SPREAD needs 2 nodes" in reason, out


def test_rays_spellings_of_no_group_and_of_a_node_id(node: dict[str, Any]) -> None:
    """``PlacementGroupSchedulingStrategy(placement_group=None)`` is no group
    (Ray's way out of a capture); a node id from the runtime context (a str
    subclass with ``.hex()``) names a node, as in Ray's scheduling example."""
    from pmetal.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
    here = pmetal.get_runtime_context().node_id
    assert On(here).node_id == node["node_id"] and type(On(here).node_id) is str
    assert pmetal.get(node_of_task.options(scheduling_strategy=On(here)).remote(),
                      timeout=WAIT) == node["node_id"]
    assert pmetal.get(node_of_task.options(scheduling_strategy=InGroup(None)).remote(),
                      timeout=WAIT) == node["node_id"]
