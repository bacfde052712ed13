"""``pmetal.init`` sizes its embedded node as Ray's ``ray.init`` does:
``num_cpus``, ``num_gpus`` and ``resources`` are what the node advertises,
and what asks for more than that fails at the call. Real node and worker
processes on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import pmetal
from pmetal.errors import ConfigError, PlacementError

from .conftest import WAIT, shutdown_quietly, wait_until


@pmetal.remote
class Holder:
    def ping(self) -> str:
        return "pong"


@pmetal.remote
def double(x: int) -> int:
    return 2 * x


@pytest.fixture(scope="module")
def sized() -> Iterator[dict[str, Any]]:
    """One embedded node advertising 3 CPUs, 2 GPUs and 4 ``board``."""
    if pmetal.is_initialized():
        shutdown_quietly()
    info = pmetal.init(num_workers=1, num_cpus=3, num_gpus=2, resources={"board": 4})
    try:
        yield info
    finally:
        shutdown_quietly()


def test_the_node_advertises_exactly_what_init_was_given(sized: dict[str, Any]) -> None:
    total = pmetal.cluster_resources()
    assert (total["CPU"], total["GPU"], total["board"]) == (3.0, 2.0, 4.0)
    assert pmetal.nodes()[0]["Resources"]["CPU"] == 3.0
    assert total["memory"] > 0   # still detected: init did not name it


def test_the_node_runs_one_task_worker_per_cpu_it_advertises(sized: dict[str, Any]) -> None:
    """As in Ray, num_cpus=3 runs 3 one-CPU tasks at once (whatever the
    machine's cores), bounded per core for absurd figures."""
    from pmetal import api
    from pmetal.node.daemon import TASK_WORKERS_PER_CORE, task_workers_for

    def task_workers() -> int:   # (the node starts them in the background)
        return sum(1 for w in api.client().status()["workers"] if w["role"] == "task")
    wait_until(lambda: task_workers() >= 3, WAIT, what="3 task workers")
    assert task_workers() == 3
    assert task_workers_for(0.5, 2) == 1 and task_workers_for(0, 2) == 1
    assert task_workers_for(1000, 2) == 2 * TASK_WORKERS_PER_CORE


def test_what_fits_runs_and_holds_its_share(sized: dict[str, Any]) -> None:
    actor = Holder.options(num_cpus=1, num_gpus=2, resources={"board": 1}).remote()
    try:
        assert pmetal.get(actor.ping.remote(), timeout=WAIT) == "pong"
        free = pmetal.available_resources()
        assert (free["CPU"], free["GPU"], free["board"]) == (2.0, 0.0, 3.0)
    finally:
        pmetal.kill(actor)
    assert pmetal.get(double.options(num_gpus=2).remote(4), timeout=WAIT) == 8


@pytest.mark.parametrize("options, words", [
    ({"num_cpus": 4}, "CPU"),
    ({"num_gpus": 3}, "GPU"),
    ({"resources": {"board": 5}}, "board"),
    ({"resources": {"other": 1}}, "other"),
])
def test_asking_for_more_than_the_node_has_is_a_placement_error(
        sized: dict[str, Any], options: dict[str, Any], words: str) -> None:
    # What no node could ever hold fails at once (what only lacks room now waits).
    with pytest.raises(PlacementError, match=words):
        Holder.options(**options).remote()
    with pytest.raises(PlacementError, match=words):
        pmetal.get(double.options(**options).remote(1), timeout=WAIT)


def test_a_task_no_node_can_run_fails_at_get_and_warns_at_the_call(
        sized: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Ray leaves it pending (a script that never gets it goes on); pmetal
    goes on too, warns, and its get raises PlacementError at once."""
    with caplog.at_level("WARNING", logger="pmetal.actors.handles"):
        ref = double.options(num_cpus=5, resources={"board": 1}).remote(1)
        first, second = double.options(num_gpus=3, num_returns=2).remote(1)
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    assert "no node has that much" in caplog.records[0].getMessage()
    assert "pmetal.get of its ref raises PlacementError" in caplog.records[0].getMessage()
    ready, _ = pmetal.wait([ref], timeout=0)   # done: it will never run
    assert ready == [ref]
    for r in (ref, first, second):
        with pytest.raises(PlacementError, match="CPU|GPU"):
            pmetal.get(r)   # without a timeout: at once, never after waiting
    with pytest.raises(PlacementError, match="CPU"):
        pmetal.get(ref, timeout=WAIT)
    assert pmetal.get(double.remote(4), timeout=WAIT) == 8   # the node is fine


@pytest.mark.parametrize("kwargs, error, words", [
    ({"num_cpus": -1}, ValueError, "num_cpus=-1"),
    ({"num_gpus": float("nan")}, ValueError, "num_gpus=nan"),
    ({"num_cpus": "4"}, TypeError, "num_cpus must be a number, not str"),
    ({"num_gpus": True}, TypeError, "num_gpus must be a number, not bool"),
    ({"num_cpus": 2, "resources": {"CPU": 2}}, ValueError, "CPU given twice"),
    ({"resources": {"board": -1}}, ValueError, "'board' must not be negative"),
    ({"address": "127.0.0.1:1", "num_cpus": 2}, ConfigError, "num_cpus configure the embedded"),
    ({"address": "auto", "num_gpus": 1, "resources": {"x": 1}}, ConfigError,
     "num_gpus and resources configure the embedded"),
])
def test_bad_sizes_are_refused_naming_the_argument(kwargs: dict[str, Any], error: type,
                                                   words: str) -> None:
    # Checked before anything starts or connects (whether or not a node runs).
    with pytest.raises(error, match=words) as info:
        pmetal.init(**kwargs)
    assert isinstance(info.value, pmetal.PMetalError)


def test_memory_is_held_against_the_nodes_memory_like_num_cpus(sized: dict[str, Any]) -> None:
    total = pmetal.cluster_resources()["memory"]
    quarter = float(int(total // 4))
    before = pmetal.available_resources()["memory"]
    actor = Holder.options(memory=int(quarter)).remote()
    try:
        assert pmetal.get(actor.ping.remote(), timeout=WAIT) == "pong"
        assert pmetal.available_resources()["memory"] == before - quarter
    finally:
        pmetal.kill(actor)
    # A task's memory is checked at the call, not held (as its num_cpus).
    assert pmetal.get(double.options(memory=int(quarter)).remote(5), timeout=WAIT) == 10


def test_more_memory_than_any_node_has_is_a_placement_error(sized: dict[str, Any]) -> None:
    too_much = int(pmetal.cluster_resources()["memory"] * 2)
    with pytest.raises(PlacementError, match="memory"):
        Holder.options(memory=too_much).remote()
    with pytest.raises(PlacementError, match="memory"):
        pmetal.get(double.options(memory=too_much).remote(1), timeout=WAIT)


@pytest.mark.parametrize("options, error, words", [
    ({"memory": -1}, ValueError, "memory=-1"),
    ({"memory": "1G"}, TypeError, "memory must be a number, not str"),
    ({"memory": True}, TypeError, "memory must be a number, not bool"),
    ({"memory": 1, "resources": {"memory": 1}}, ValueError, "memory given twice"),
])
def test_bad_memory_is_refused_naming_the_option(options: dict[str, Any], error: type,
                                                 words: str) -> None:
    with pytest.raises(error, match=words):
        Holder.options(**options)
    with pytest.raises(error, match=words):
        double.options(**options)
