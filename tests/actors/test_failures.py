"""Failures of the actor runtime: clear errors at the call site, dead and
killed actors, ``kill -9`` of workers with restarts, and shutdown (or a
killed driver) leaving no stray process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pmetal
from pmetal import (
    ActorDiedError,
    NotInitializedError,
    PlacementError,
    PMetalError,
    RemoteError,
    api,
)
from pmetal.actors.handles import ActorHandle
from pmetal.actors.serialization import code_ref
from pmetal.wire import ActorLocation, CreateActor, LeaseWorkers, WorkerList

from .actor_classes import BadInit, Counter, ExitInit, pause, square, worker_pid
from .conftest import (
    EXIT_WAIT,
    WAIT,
    actor_state,
    assert_all_exit,
    await_restart,
    descendants,
    pid_alive,
    read_line,
    shared_memory_objects,
    stop_process,
    wait_until,
    worker_of,
)

NUM_WORKERS = 2
TRANSPORT = {"handshake_timeout": 2.0, "request_timeout": 5.0}
"""The driver gives up on a dead peer sooner (a live worker answers a
handshake in milliseconds; nothing here takes seconds to construct)."""

pytestmark = pytest.mark.usefixtures("cluster")

DEATH_WAIT = 5.0
"""How soon a call pending on a dead actor must fail."""

RESTART_WAIT = 20.0
"""Deadline for a restart (it may start a worker process on a busy machine)."""


@pytest.fixture(scope="module")
def counter(cluster: dict[str, Any]) -> Any:
    return Counter.remote()


def kill_9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    assert_all_exit([pid], what="the SIGKILLed worker")


# ------------------------------------------------- errors at the call site

def test_unpicklable_arguments_fail_at_the_call_site(counter: Any) -> None:
    lock = threading.Lock()
    with pytest.raises(TypeError, match="pickle"):
        counter.echo.remote(lock)
    with pytest.raises(TypeError, match="pickle"):
        counter.echo.remote(1, key=lock)
    with pytest.raises(TypeError, match="pickle"):
        square.remote(lock)
    with pytest.raises(TypeError, match="pickle"):
        Counter.remote(lock)
    # Nothing was sent: the actor is fine.
    assert pmetal.get(counter.echo.remote("still fine"), timeout=WAIT) == "still fine"


def test_unpicklable_result_is_a_clear_error(counter: Any) -> None:
    with pytest.raises(TypeError, match="pickle") as info:
        pmetal.get(counter.unpicklable_result.remote(), timeout=WAIT)
    assert isinstance(info.value, RemoteError)
    assert pmetal.get(counter.echo.remote(1), timeout=WAIT) == 1


def test_unknown_method_fails_at_the_call_site(counter: Any) -> None:
    with pytest.raises(AttributeError, match="no_such_method") as info:
        counter.no_such_method.remote()
    assert "inc" in str(info.value)  # the message lists the methods there are
    with pytest.raises(AttributeError):
        counter._private  # noqa: B018


def test_constructor_failure_is_raised_at_creation() -> None:
    with pytest.raises(ValueError, match="no good") as info:
        BadInit.remote("no good")
    assert isinstance(info.value, RemoteError)
    assert "in raise_value_error" in info.value.remote_traceback


def test_constructor_that_exits_its_process_is_actor_died_at_once() -> None:
    # The node watches the worker while the constructor runs: its exit is
    # the answer (the old node waited 30 s for a reply that never came).
    start = time.monotonic()
    with pytest.raises(ActorDiedError, match="exited with code 7") as info:
        ExitInit.remote(7)
    assert time.monotonic() - start < DEATH_WAIT
    assert "ExitInit" in str(info.value) and "constructor" in str(info.value)


def test_bad_num_cpus_is_a_clear_error_at_the_call_site() -> None:
    with pytest.raises(TypeError, match="num_cpus must be a number, not str 'lots'"):
        Counter.options(num_cpus="lots").remote()
    with pytest.raises(ValueError, match="num_cpus=-1; it must be at least 0"):
        Counter.options(num_cpus=-1).remote()


def _raw_create(options: dict[str, Any]) -> CreateActor:
    """A CreateActor as any authenticated peer could send it (no client-side checks)."""
    cls = Counter.__wrapped__
    cls_id, ref = code_ref(cls)
    base = {"name": "", "node": "", "num_cpus": 0, "resources": {}, "max_restarts": 0,
            "max_concurrency": 1, "class_name": "Counter", "methods": ["inc"],
            "is_async": False}
    return CreateActor(api.client().new_actor_id(), cls_id, ref, [], {}, {**base, **options})


@pytest.mark.parametrize("options, error, words", [
    ({"num_cpus": "lots"}, TypeError, "num_cpus must be a number"),
    ({"num_cpus": -1}, ValueError, "num_cpus must not be negative"),
    ({"resources": {"GPU": -1}}, ValueError, "'GPU' must not be negative"),
    ({"resources": {"CPU": "lots"}}, TypeError, "'CPU' must be a number"),
    ({"resources": [1, 2]}, TypeError, "resources must be a dict"),
    ({"max_restarts": "3"}, ValueError, "max_restarts"),
    ({"name": 5}, TypeError, "name must be a string"),
    ({"lifetime": "forever"}, ValueError, "lifetime"),
])
def test_bad_create_actor_from_a_peer_is_refused_and_the_node_lives(
        options: dict[str, Any], error: type[Exception], words: str) -> None:
    client = api.client()
    failed_before = client.status()["statistics"]["requests_failed"]
    start = time.monotonic()
    with pytest.raises(error, match=words):
        client.create_actor(_raw_create(options), timeout=DEATH_WAIT)
    assert time.monotonic() - start < DEATH_WAIT
    # The node answered, still serves, and counted the refusal.
    actor = Counter.remote(1)
    try:
        assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 2
    finally:
        pmetal.kill(actor)
    assert client.status()["statistics"]["requests_failed"] == failed_before + 1


@pytest.mark.parametrize("resources, words", [
    ({"CPU": "lots"}, "'CPU' must be a number"),
    ({"GPU": -1}, "'GPU' must not be negative"),
    ({"GPU": float("nan")}, "'GPU' must be a number"),
    (["CPU"], "resources must be a dict"),
])
def test_init_with_bad_resources_fails_at_the_call(resources: Any, words: str) -> None:
    # Checked before anything starts (here a cluster runs already: the bad
    # argument is still the error reported).
    with pytest.raises(pmetal.PMetalError, match=words) as info:
        pmetal.init(resources=resources)
    assert isinstance(info.value, (TypeError, ValueError))   # misuse: the builtin type too


@pytest.mark.parametrize("options, words", [
    ({"resources": {"GPU": 1}}, "GPU"),
    ({"num_cpus": 10_000}, "CPU"),
    ({"node": "0123456789abcdef-no-such-node"}, "no-such-node"),
])
def test_resources_no_node_has_fail_at_the_call_site(cluster: dict[str, Any],
                                                     options: dict[str, Any],
                                                     words: str) -> None:
    start = time.monotonic()
    with pytest.raises(PlacementError, match=words):
        Counter.options(**options).remote()
    assert time.monotonic() - start < WAIT


def test_remote_function_needing_resources_no_node_has_fails(cluster: dict[str, Any]) -> None:
    with pytest.raises(PlacementError, match="GPU"):
        pmetal.get(square.options(resources={"GPU": 1}).remote(2), timeout=WAIT)


def test_resources_held_by_an_actor_are_returned_when_it_dies(cluster: dict[str, Any]) -> None:
    before = pmetal.available_resources()["CPU"]
    actor = Counter.options(num_cpus=1).remote()
    try:
        assert pmetal.available_resources()["CPU"] == before - 1
    finally:
        pmetal.kill(actor)
    wait_until(lambda: pmetal.available_resources()["CPU"] == before, WAIT,
               what="CPU returned after kill")


# ------------------------------------------------------------- pmetal.kill

def test_kill_fails_pending_and_later_calls(reap: list[Any]) -> None:
    actor = Counter.remote()
    reap.append(actor)
    assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 1
    pending = actor.block.remote(60)
    pmetal.kill(actor)
    start = time.monotonic()
    with pytest.raises(ActorDiedError):
        pmetal.get(pending, timeout=DEATH_WAIT)
    with pytest.raises(ActorDiedError, match="kill"):
        pmetal.get(actor.inc.remote(), timeout=DEATH_WAIT)
    assert time.monotonic() - start < DEATH_WAIT
    assert actor_state(actor)["state"] == "dead"


def test_kill_returns_once_the_actors_process_has_exited(reap: list[Any]) -> None:
    """What follows pmetal.kill sees the actor gone: its process (which may
    own objects others hold) no longer runs. (Before, the node answered
    while the worker gave its last report, and a get right after the kill
    could still fetch an object the killed actor owned.)"""
    actor = Counter.remote()
    reap.append(actor)
    pid = pmetal.get(actor.pid.remote(), timeout=WAIT)
    pmetal.kill(actor)
    assert not pid_alive(pid)


def test_many_pending_calls_all_fail_when_the_actor_dies(reap: list[Any]) -> None:
    actor = Counter.remote()
    reap.append(actor)
    refs = [actor.block.remote(60)] + [actor.inc.remote() for _ in range(20)]
    pmetal.kill(actor)
    ready, not_ready = pmetal.wait(refs, num_returns=len(refs), timeout=DEATH_WAIT)
    assert not not_ready
    for ref in ready:
        with pytest.raises(ActorDiedError):
            pmetal.get(ref, timeout=0)


def test_killed_named_actor_is_gone_and_its_name_free(reap: list[Any]) -> None:
    actor = Counter.options(name="failures-named").remote()
    pmetal.kill(actor)
    wait_until(lambda: actor_state(actor)["state"] == "dead", WAIT, what="actor dead")
    with pytest.raises(ValueError, match="failures-named"):
        pmetal.get_actor("failures-named")
    again = Counter.options(name="failures-named").remote(3)
    reap.append(again)
    assert pmetal.get(pmetal.get_actor("failures-named").value.remote(), timeout=WAIT) == 3


def test_kill_with_restart_allowed_restarts_the_actor(reap: list[Any]) -> None:
    actor = Counter.options(max_restarts=1).remote(10)
    reap.append(actor)
    assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 11
    pmetal.kill(actor, no_restart=False)
    await_restart(actor, 1, RESTART_WAIT)
    assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 11


def test_call_right_after_kill_with_restart_goes_to_the_new_incarnation(
        reap: list[Any]) -> None:
    # The docs promise the call goes to the restarted actor; the old client
    # sent it to the dying process and raised ActorDiedError (3 runs of 4).
    actor = Counter.options(max_restarts=1).remote(10)
    reap.append(actor)
    assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 11
    first_pid = worker_of(actor)["pid"]
    pmetal.kill(actor, no_restart=False)
    start = time.monotonic()
    assert pmetal.get(actor.inc.remote(), timeout=RESTART_WAIT) == 11   # a fresh instance
    assert time.monotonic() - start < RESTART_WAIT
    assert pmetal.get(actor.pid.remote(), timeout=WAIT) != first_pid
    assert actor_state(actor)["incarnation"] == 1


def test_kill_rejects_what_is_not_a_handle(cluster: dict[str, Any]) -> None:
    with pytest.raises(TypeError):
        pmetal.kill("not a handle")  # type: ignore[arg-type]


# ---------------------------------------------------------------- kill -9

def test_kill_9_of_a_worker_fails_its_calls_with_actor_died(reap: list[Any]) -> None:
    actor = Counter.remote()
    reap.append(actor)
    pid = pmetal.get(actor.pid.remote(), timeout=WAIT)
    assert worker_of(actor)["pid"] == pid
    pending = actor.block.remote(60)
    kill_9(pid)
    start = time.monotonic()
    with pytest.raises(ActorDiedError) as info:
        pmetal.get(pending, timeout=DEATH_WAIT)
    assert time.monotonic() - start < DEATH_WAIT
    assert "Counter" in str(info.value)
    # No restarts: the actor is dead for good, and says so at once.
    with pytest.raises(ActorDiedError):
        pmetal.get(actor.inc.remote(), timeout=DEATH_WAIT)
    wait_until(lambda: actor_state(actor)["state"] == "dead", WAIT, what="actor dead")


def test_kill_9_restarts_a_fresh_instance_up_to_max_restarts(reap: list[Any]) -> None:
    actor = Counter.options(max_restarts=1).remote(100)
    reap.append(actor)
    assert pmetal.get([actor.inc.remote() for _ in range(5)], timeout=WAIT)[-1] == 105
    first_pid = worker_of(actor)["pid"]
    pending = actor.block.remote(60)
    kill_9(first_pid)
    with pytest.raises(ActorDiedError):
        pmetal.get(pending, timeout=DEATH_WAIT)
    # The next call reaches a new instance: the constructor ran again with
    # the same arguments, so the state is reset.
    assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 101
    second_pid = pmetal.get(actor.pid.remote(), timeout=WAIT)
    assert second_pid != first_pid
    assert worker_of(actor)["pid"] == second_pid
    assert actor_state(actor)["incarnation"] == 1
    # No restarts left: the second death is final.
    pending = actor.block.remote(60)
    kill_9(second_pid)
    with pytest.raises(ActorDiedError):
        pmetal.get(pending, timeout=DEATH_WAIT)
    with pytest.raises(ActorDiedError):
        pmetal.get(actor.inc.remote(), timeout=DEATH_WAIT)
    assert actor_state(actor)["state"] == "dead"


def test_first_call_after_a_restart_reaches_the_new_instance(reap: list[Any]) -> None:
    # No call was pending when the worker died: the caller learns of the
    # death only now, and the call must still go to the restarted actor.
    actor = Counter.options(max_restarts=1).remote(20)
    reap.append(actor)
    assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 21
    kill_9(worker_of(actor)["pid"])
    await_restart(actor, 1, RESTART_WAIT)
    assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 21


def test_large_array_sent_to_an_actor_that_dies_leaves_no_shared_memory(
        reap: list[Any]) -> None:
    # On one machine large arrays travel as shared-memory objects that the
    # receiver unlinks; a receiver that dies first must not leak them.
    actor = Counter.remote()
    reap.append(actor)
    busy = actor.block.remote(60)
    queued = actor.echo.remote(np.ones(1 << 20))  # 8 MiB, never read
    kill_9(worker_of(actor)["pid"])
    for ref in (busy, queued):
        with pytest.raises(ActorDiedError):
            pmetal.get(ref, timeout=DEATH_WAIT)
    wait_until(lambda: not shared_memory_objects(os.getpid()), EXIT_WAIT,
               what="no shared-memory object left behind")


def test_actors_start_while_status_is_read(reap: list[Any]) -> None:
    """``pmetal status`` asks every worker, idle ones included, for its calls,
    so it races actor construction to open the node's channel to a fresh
    worker; whichever comes first, the actor starts."""
    stop = threading.Event()
    problems: list[BaseException] = []

    def read_status() -> None:
        while not stop.is_set():
            try:
                api.client().status()
            except PMetalError as exc:
                problems.append(exc)
                return

    reader = threading.Thread(target=read_status, daemon=True)
    reader.start()
    try:
        for i in range(8):
            actor = Counter.remote(i)
            reap.append(actor)
            assert pmetal.get(actor.inc.remote(), timeout=WAIT) == i + 1
            pmetal.kill(actor)
    finally:
        stop.set()
        reader.join(WAIT)
    assert not reader.is_alive(), "the status reader did not stop"
    assert not problems, f"status failed while actors started: {problems[0]!r}"


def test_a_link_serves_only_the_actor_it_was_opened_for(reap: list[Any]) -> None:
    """Worker ports are picked by the OS and reused after a worker exits. A
    link the client opened for actor A must not carry calls for another actor
    whose location names the same address: ZeroMQ would have reconnected it
    to the new worker, with A's worker's session. Here B's handle is pointed
    at A's worker (standing in for a reused port): the client opens a fresh
    link there, and A's next call does the same again. A handle from
    elsewhere (unpickled) is looked up at the node before anything is
    dialed, so the same stale address reaches B where it lives."""
    a, b = Counter.remote(), Counter.remote()
    reap.extend([a, b])
    assert pmetal.get(a.inc.remote(), timeout=WAIT) == 1
    client = api.client()
    first = client.links[a._address]
    location = ActorLocation(b._actor_id, "alive", a._address, b._node_id, 0, "", "",
                             "Counter", ("inc",), False)
    moved = ActorHandle(location, client)   # as if this client had made it there
    with pytest.raises(ActorDiedError, match="does not live in this worker"):
        pmetal.get(moved.inc.remote(), timeout=WAIT)
    assert client.links[a._address] is not first and first.dead
    assert pmetal.get(a.inc.remote(), timeout=WAIT) == 2
    assert client.links[a._address].owner == a._actor_id
    unpickled = ActorHandle(location)
    assert pmetal.get(unpickled.inc.remote(), timeout=WAIT) == 1
    assert unpickled._address == b._address


def test_named_actor_restarted_after_kill_9_is_found_by_name(reap: list[Any]) -> None:
    actor = Counter.options(name="failures-restarts", max_restarts=1).remote(1)
    reap.append(actor)
    kill_9(pmetal.get(actor.pid.remote(), timeout=WAIT))
    await_restart(actor, 1, RESTART_WAIT)
    found = pmetal.get_actor("failures-restarts")
    assert pmetal.get(found.inc.remote(), timeout=WAIT) == 2


def test_task_worker_killed_fails_its_task_and_is_replaced(cluster: dict[str, Any]) -> None:
    task_pids = {w["pid"] for w in api.client().status()["workers"] if w["role"] == "task"}
    assert task_pids
    # One long task per task worker (calls are spread round-robin); without
    # retries (tests/actors/test_retries.py has them), each fails.
    pending = [pause.options(max_retries=0).remote(60) for _ in task_pids]
    for pid in task_pids:
        kill_9(pid)
    for ref in pending:
        with pytest.raises(ActorDiedError):
            pmetal.get(ref, timeout=DEATH_WAIT)
    # The caller has seen those workers die: new calls go to their
    # replacements, at once and without error.
    start = time.monotonic()
    assert pmetal.get([square.remote(i) for i in range(4)], timeout=WAIT) == [0, 1, 4, 9]
    assert pmetal.get(worker_pid.remote(), timeout=WAIT) not in task_pids
    assert time.monotonic() - start < DEATH_WAIT


def test_node_leaves_out_task_workers_the_caller_saw_die(cluster: dict[str, Any]) -> None:
    """A caller can see a worker's connection drop before the node has reaped
    the process; the caller names it and the node answers without it."""
    workers = [w for w in api.client().status()["workers"] if w["role"] == "task"]
    victim = workers[0]
    kill_9(victim["pid"])
    reply = api.client().request_node(LeaseWorkers(0, (victim["address"],)), timeout=WAIT)
    assert isinstance(reply, WorkerList), reply
    assert reply.addresses and victim["address"] not in reply.addresses


# ------------------------------------------------------- shutdown, strays

MAIN_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import pmetal
    from pmetal import api

    pmetal.init(num_workers=1)

    @pmetal.remote
    class Greeter:                       # defined in __main__: shipped by value
        def __init__(self, name):
            self.name = name
        def greet(self):
            return "hello " + self.name

    @pmetal.remote
    def double(x):                       # so is this function
        return 2 * x

    greeter = Greeter.remote("main")
    out = {"greet": pmetal.get(greeter.greet.remote(), timeout=10),
           "double": pmetal.get(double.remote(21), timeout=10),
           "node_pid": api._node_proc.pid,
           "node_address": api.client().node_address,
           "worker_pids": [w["pid"] for w in api.client().status()["workers"]]}
    print(json.dumps(out), flush=True)
    sys.stdin.read()                     # the test kills this process
""")


@pytest.fixture(scope="module")
def main_driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A driver script whose classes live in ``__main__``; it prints what it
    saw and waits to be killed."""
    script = Path(tmp_path_factory.mktemp("driver")) / "driver.py"
    script.write_text(MAIN_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        out = json.loads(read_line(proc, 30, "the driver script"))
        yield {"proc": proc, **out}
    finally:
        stop_process(proc, signal.SIGKILL)


def test_main_module_classes_and_functions_are_shipped_by_value(
        main_driver: dict[str, Any]) -> None:
    assert main_driver["greet"] == "hello main"
    assert main_driver["double"] == 42


def test_killed_driver_leaves_no_stray_process(main_driver: dict[str, Any]) -> None:
    proc = main_driver["proc"]
    pids = {main_driver["node_pid"], *main_driver["worker_pids"],
            *descendants(main_driver["node_pid"])}
    assert all(pid_alive(p) for p in pids)
    proc.kill()  # no atexit, no shutdown: the node must notice by itself
    proc.wait(EXIT_WAIT)
    assert_all_exit(pids, what="the node and workers of a killed driver")


def test_shutdown_leaves_no_stray_process(cluster: dict[str, Any]) -> None:
    # Runs last in this module: it shuts the module's cluster down.
    status = api.client().status()
    node_proc = api._node_proc
    pids = {node_proc.pid, status["pid"], *(w["pid"] for w in status["workers"]),
            *descendants(node_proc.pid)}
    assert len(pids) >= 1 + NUM_WORKERS
    # A call still waiting for its ObjectRef argument is never sent: shutdown
    # fails it, and says why.
    waiting = square.remote(pause.remote(60))
    assert not waiting.done()
    start = time.monotonic()
    pmetal.shutdown()
    took = time.monotonic() - start
    with pytest.raises(PMetalError, match="shutdown came before its ObjectRef arguments"):
        pmetal.get(waiting)
    assert node_proc.returncode is not None
    assert_all_exit(pids, what="the node and its workers after shutdown")
    assert took < EXIT_WAIT, f"shutdown took {took:.1f} s"
    assert node_proc.returncode == 0, "the node did not exit by itself"
    # Afterwards the API says it is not initialised; shutdown again is harmless.
    # (.remote() would start a new node, as in Ray; get_actor does not.)
    assert not pmetal.is_initialized()
    with pytest.raises(NotInitializedError):
        pmetal.get_actor("anyone")
    pmetal.shutdown()
