"""A checklist of Ray Core's documented semantics, run on pmetal.

Each test names the Ray documentation page it comes from (a path under
https://docs.ray.io/en/latest/) and says, in its docstring, the behaviour that
page documents; the test checks that pmetal does it, with real worker
processes on one embedded node (shared by the module: ``init`` once, as a Ray
script does).

Semantics that issue 20's other branches are building are here too, marked
``xfail(strict=True)`` with the branch that brings them: when a branch lands,
its tests start passing, the strict mark turns that into a failure, and the
mark is removed. Tests marked "no branch" are gaps nobody is closing yet.

``python tools/ray_examples.py`` runs Ray's own documentation examples the same
way; docs/ray-compat.md ("Measured compatibility") has both summaries.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import pmetal
import pmetal.exceptions
from pmetal.util import ActorPool
from pmetal.util.queue import Empty, Full, Queue

from .checklist_classes import (
    WAIT,
    AsyncBuilt,
    Canceller,
    Counter,
    Flaky,
    Gate,
    Meeting,
    Parent,
    Phoenix,
    Sleeper,
    ThreadedMeeting,
    add,
    call_counter,
    count_up,
    echo,
    env_var,
    exit_process,
    exit_the_first_time,
    fail,
    flaky_once,
    get_the_nested,
    is_a_ref,
    make_and_return_a_ref,
    meet,
    node_of_task,
    read_file,
    runtime_ids,
    signal_then_sleep,
    three,
    wait_for,
    yield_then_fail,
    yield_then_wait,
)
from .conftest import wait_until

PSK = secrets.token_hex(16)
NUM_CPUS = (os.cpu_count() or 1) + 2
"""More than the machine's cores, so that what ``num_cpus`` allows is seen."""
BOARDS = 2
GPUS = 2


def branch(item: int, name: str, what: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True,
                             reason=f"issue 20 item {item}: {what} ({name}) not merged yet")


def merged(test: Any) -> Any:
    """The mark of a branch that has landed: its tests must pass."""
    return test


# When a branch lands, its tests XPASS, which strict xfail turns into failures:
# set its mark to ``merged`` here (one line per branch).
OWN = branch(1, "branch own", "ObjectRefs in values and ownership")
STREAM = branch(2, "branch stream", "num_returns='streaming' generators")
WORKING_DIR = branch(4, "branch stream", "runtime_env working_dir")
PG = branch(3, "branch pg", "placement groups")
STRATEGY = branch(3, "branch pg", "scheduling_strategy for tasks")
STREAM = WORKING_DIR = PG = STRATEGY = OWN = merged   # landed on main


def gap(what: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=f"no branch of issue 20 does this yet: {what}")


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Any:
    if pmetal.is_initialized():
        pmetal.shutdown(timeout=3.0)
    info = pmetal.init(num_cpus=NUM_CPUS, num_gpus=GPUS, resources={"board": BOARDS},
                       num_workers=3, psk=PSK,
                       runtime_env={"env_vars": {"CHECKLIST_JOB_VAR": "job"}})
    yield info
    pmetal.shutdown(timeout=3.0)


@pytest.fixture
def reap() -> Any:
    """Actors a test creates; killed after it."""
    handles: list[Any] = []
    yield handles
    for handle in handles:
        try:
            pmetal.kill(handle)
        except pmetal.PMetalError:
            pass


@pytest.fixture
def gate(reap: list) -> Any:
    handle = Gate.remote()
    reap.append(handle)
    return handle


# ------------------------------------------------------------------ tasks

def test_remote_returns_a_ref_and_get_returns_the_value() -> None:
    """ray-core/tasks.html: ``.remote()`` "will immediately return an object
    ref (a future)"; "the result can be retrieved with ``ray.get``"."""
    ref = add.remote(1, 2)
    assert isinstance(ref, pmetal.ObjectRef)
    assert pmetal.get(ref, timeout=WAIT) == 3


def test_a_top_level_ref_argument_is_resolved_before_the_task_runs() -> None:
    """ray-core/objects.html (passing object arguments): "Ray will
    de-reference top-level arguments", so the task sees the value."""
    assert pmetal.get(add.remote(pmetal.put(40), add.remote(1, 1)), timeout=WAIT) == 42


def test_tasks_run_in_parallel(reap: list) -> None:
    """ray-core/tasks.html: "Ray tasks are executed in parallel". Two tasks
    that each wait for the other finish only if they run at the same time."""
    meeting = Meeting.remote()
    reap.append(meeting)
    assert pmetal.get([meet.remote(meeting, 2) for _ in range(2)], timeout=WAIT) == [True] * 2


def test_num_returns_gives_one_ref_per_returned_item() -> None:
    """ray-core/tasks.html (multiple returns): with ``num_returns=3`` the task
    returns three object refs, one per item of the returned tuple."""
    refs = three.remote()
    assert len(refs) == 3
    assert [pmetal.get(r, timeout=WAIT) for r in refs] == [0, 1, 2]


def test_a_task_error_is_raised_by_get_as_its_own_type_and_as_RayTaskError() -> None:
    """ray-core/fault_tolerance/tasks.html: an exception in a task is re-raised
    by ``ray.get`` wrapped in ``RayTaskError``, which is also an instance of
    the original exception's class, so ``except ValueError`` catches it."""
    with pytest.raises(ValueError, match="boom") as info:
        pmetal.get(fail.remote("boom"), timeout=WAIT)
    assert isinstance(info.value, pmetal.exceptions.RayTaskError)


def test_a_failed_argument_fails_the_task_that_needs_it() -> None:
    """ray-core/fault_tolerance/tasks.html (task_exceptions example): a task
    whose argument's task raised fails with that error ("at least one of the
    input arguments for this task could not be computed")."""
    with pytest.raises(ValueError, match="upstream"):
        pmetal.get(echo.remote(fail.remote("upstream")), timeout=WAIT)


def test_retry_exceptions_runs_the_task_again(tmp_path: Path) -> None:
    """ray-core/fault_tolerance/tasks.html: with ``retry_exceptions`` set to a
    list, an application exception of those types makes Ray retry the task
    (up to ``max_retries``)."""
    assert pmetal.get(flaky_once.remote(str(tmp_path / "m")), timeout=WAIT) == "retried"
    assert issubclass(Flaky, Exception)


def test_a_task_whose_worker_dies_is_retried(tmp_path: Path) -> None:
    """ray-core/fault_tolerance/tasks.html: when the worker executing a task
    dies, "Ray will rerun the task until either the task succeeds or the
    maximum number of retries is exceeded"."""
    assert pmetal.get(exit_the_first_time.remote(str(tmp_path / "m")),
                      timeout=WAIT) == "second run"



def test_a_task_whose_worker_dies_without_retries_raises_WorkerCrashedError() -> None:
    """ray-core/fault_tolerance/tasks.html (tasks_fault_tolerance example):
    with retries used up, ``ray.get`` raises ``WorkerCrashedError``."""
    with pytest.raises(pmetal.exceptions.WorkerCrashedError):
        pmetal.get(exit_process.remote(), timeout=WAIT)


def test_cancel_a_task_raises_TaskCancelledError_from_get(gate: Any) -> None:
    """ray-core/tasks.html (cancelling tasks): after ``ray.cancel(ref)``,
    ``ray.get(ref)`` raises ``TaskCancelledError``."""
    ref = echo.remote(wait_for.remote(gate, "never"))   # waits for its argument
    pmetal.cancel(ref)
    with pytest.raises(pmetal.exceptions.TaskCancelledError):
        pmetal.get(ref, timeout=WAIT)
    pmetal.get(gate.open.remote("never"), timeout=WAIT)


def test_cancel_force_stops_a_running_task(gate: Any) -> None:
    """ray-core/api/doc/ray.cancel.html: ``force=True`` force-exits the worker
    running the task; ``ray.get`` raises ``TaskCancelledError``."""
    ref = signal_then_sleep.remote(gate, "running", 60.0)
    pmetal.get(gate.wait.remote("running"), timeout=WAIT)
    pmetal.cancel(ref, force=True)
    with pytest.raises(pmetal.exceptions.TaskCancelledError):
        pmetal.get(ref, timeout=WAIT)


def test_cancel_a_running_async_actor_method_raises_CancelledError_in_it(reap: list) -> None:
    """ray-core/actors.html (cancelling actor tasks): for an async actor, Ray
    cancels the running method's asyncio task, so ``asyncio.CancelledError``
    is raised in the coroutine; ``ray.get`` raises ``TaskCancelledError``."""
    sleeper = Sleeper.remote()
    reap.append(sleeper)
    ref = sleeper.nap.remote()
    pmetal.get(sleeper.wait_started.remote(), timeout=WAIT)
    pmetal.cancel(ref)
    with pytest.raises(pmetal.exceptions.TaskCancelledError):
        pmetal.get(ref, timeout=WAIT)
    assert pmetal.get(sleeper.was_cancelled.remote(), timeout=WAIT)


# --------------------------------------------------------- get, wait, put

def test_get_of_a_list_keeps_its_order() -> None:
    """ray-core/api/doc/ray.get.html: "Ordering for an input list of object
    refs is preserved for each object returned"."""
    assert pmetal.get([echo.remote(i) for i in range(10)], timeout=WAIT) == list(range(10))


def test_get_timeout_raises_GetTimeoutError(gate: Any) -> None:
    """ray-core/api/doc/ray.get.html: "GetTimeoutError is raised if a timeout is
    set and the get takes longer than timeout" (Ray's is also a
    ``TimeoutError``)."""
    ref = wait_for.remote(gate, "late")
    with pytest.raises(pmetal.exceptions.GetTimeoutError) as info:
        pmetal.get(ref, timeout=0.05)
    assert isinstance(info.value, TimeoutError)
    pmetal.get(gate.open.remote("late"), timeout=WAIT)
    assert pmetal.get(ref, timeout=WAIT) == "late"


def test_wait_returns_ready_and_not_ready_in_input_order(gate: Any) -> None:
    """ray-core/api/doc/ray.wait.html: returns two lists, ready and not ready;
    "Ordering of the input list ... is preserved"; with a timeout it returns
    when that many are ready or the timeout is reached, whichever first."""
    slow = gate.wait.remote("slow")
    fast = [echo.remote(i) for i in range(3)]
    refs = [fast[0], slow, fast[1], fast[2]]
    ready, not_ready = pmetal.wait(refs, num_returns=3, timeout=WAIT)
    assert ready == fast and not_ready == [slow]
    ready, not_ready = pmetal.wait(refs, num_returns=4, timeout=0.05)
    assert ready == fast and not_ready == [slow]
    pmetal.get(gate.open.remote("slow"), timeout=WAIT)
    assert pmetal.wait(refs, num_returns=4, timeout=WAIT) == (refs, [])


def test_a_node_runs_as_many_tasks_at_once_as_its_num_cpus(reap: list) -> None:
    """ray-core/patterns/limit-running-tasks.html: a task uses 1 CPU by
    default, so a node of ``num_cpus=N`` runs N tasks at once ("this means 16
    tasks can run concurrently" on 16 CPUs). Here N is the machine's cores
    + 2, and N tasks wait for each other."""
    meeting = Meeting.remote()
    reap.append(meeting)
    refs = [meet.remote(meeting, NUM_CPUS, 1.0) for _ in range(NUM_CPUS)]
    assert pmetal.get(refs, timeout=WAIT) == [True] * NUM_CPUS


def test_a_put_ref_can_be_passed_to_many_tasks() -> None:
    """ray-core/objects.html: ``ray.put`` returns a ref that can be passed to
    tasks like any other."""
    ref = pmetal.put(list(range(100)))
    assert pmetal.get([echo.remote(ref) for _ in range(5)], timeout=WAIT) == [list(range(100))] * 5


def test_refs_can_be_awaited_in_asyncio_code() -> None:
    """ray-core/actors/async_api.html: "ObjectRefs can be translated to
    asyncio.Futures", so async code can ``await`` a ref (and gather many)."""
    async def main() -> list[int]:
        one = await add.remote(1, 1)
        more = await asyncio.gather(*(echo.remote(i) for i in range(3)))
        return [one, *more]
    assert asyncio.run(asyncio.wait_for(main(), WAIT)) == [2, 0, 1, 2]


# ----------------------------------------------------------------- actors

def test_calls_from_one_caller_run_in_submission_order(reap: list) -> None:
    """ray-core/actors/task-orders.html: "For tasks received from the same
    submitter, a synchronous, single-threaded actor executes them in the
    order they were submitted"."""
    counter = Counter.remote()
    reap.append(counter)
    assert pmetal.get([counter.increment.remote() for _ in range(50)],
                      timeout=WAIT) == list(range(1, 51))


def test_an_actor_handle_can_be_passed_to_a_task(reap: list) -> None:
    """ray-core/actors.html (passing around actor handles): tasks can call
    the methods of an actor whose handle they were given."""
    counter = Counter.remote(10)
    reap.append(counter)
    assert pmetal.get(call_counter.remote(counter, 3), timeout=WAIT) == [11, 12, 13]


def test_an_exception_in_a_method_leaves_the_actor_alive(reap: list) -> None:
    """ray-core/fault_tolerance/actors.html: an application error in an actor
    method is returned to the caller; the actor process is not affected
    and keeps its state."""
    counter = Counter.remote()
    reap.append(counter)
    pmetal.get(counter.increment.remote(), timeout=WAIT)
    with pytest.raises(KeyError):
        pmetal.get(counter.fail.remote(), timeout=WAIT)
    assert pmetal.get(counter.increment.remote(), timeout=WAIT) == 2


def test_method_num_returns(reap: list) -> None:
    """ray-core/api/doc/ray.method.html: ``@ray.method(num_returns=2)`` makes
    a method call return two refs."""
    counter = Counter.remote(5)
    reap.append(counter)
    first, second = counter.pair.remote()
    assert pmetal.get([first, second], timeout=WAIT) == [5, -5]


def test_named_actor_is_found_by_get_actor_and_unknown_names_raise(reap: list) -> None:
    """ray-core/actors/named-actors.html: an actor created with a name is
    retrieved with ``ray.get_actor(name)``; ray-core/api/doc/ray.get_actor.html:
    "ValueError – if the named actor does not exist"."""
    counter = Counter.options(name="checklist-named").remote()
    reap.append(counter)
    pmetal.get(counter.increment.remote(), timeout=WAIT)
    assert pmetal.get(pmetal.get_actor("checklist-named").increment.remote(),
                      timeout=WAIT) == 2
    with pytest.raises(ValueError):
        pmetal.get_actor("checklist-nobody")


def test_get_if_exists_returns_the_live_actor(reap: list) -> None:
    """ray-core/actors/named-actors.html (get-or-create): with
    ``get_if_exists=True`` the handle of the existing actor of that name is
    returned (new constructor arguments are ignored)."""
    first = Counter.options(name="checklist-goc", get_if_exists=True).remote(100)
    reap.append(first)
    again = Counter.options(name="checklist-goc", get_if_exists=True).remote(0)
    assert pmetal.get(again.increment.remote(), timeout=WAIT) == 101
    assert again == first


def test_kill_fails_later_calls_with_RayActorError(reap: list) -> None:
    """ray-core/actors/terminating-actors.html: ``ray.kill`` makes the actor
    exit at once, "causing any current, pending, and future tasks to fail with
    a RayActorError"."""
    counter = Counter.remote()
    pmetal.get(counter.increment.remote(), timeout=WAIT)
    pmetal.kill(counter)
    with pytest.raises(pmetal.exceptions.RayActorError):
        pmetal.get(counter.increment.remote(), timeout=WAIT)


def test_a_restarted_actor_reruns_its_constructor_and_retries_the_call(
        tmp_path: Path, reap: list) -> None:
    """ray-core/fault_tolerance/actors.html: with ``max_restarts`` "the actor
    will be restarted" and "its state will be recreated by rerunning its
    constructor"; with ``max_task_retries`` the call that failed because the
    actor died is retried on the restarted actor."""
    phoenix = Phoenix.remote(str(tmp_path / "boots"))
    reap.append(phoenix)
    assert pmetal.get(phoenix.count.remote(), timeout=WAIT) == 1
    assert pmetal.get(phoenix.die_once.remote(), timeout=WAIT) == 2   # retried after restart
    assert pmetal.get(phoenix.count.remote(), timeout=WAIT) == 1      # state is new


def test_async_actor_methods_run_concurrently(reap: list) -> None:
    """ray-core/actors/async_api.html: calls to an async actor's methods run
    concurrently on its event loop (three ``arrive`` calls that wait for each
    other all return)."""
    meeting = Meeting.remote()
    reap.append(meeting)
    assert pmetal.get([meeting.arrive.remote(3) for _ in range(3)], timeout=WAIT) == [True] * 3


def test_threaded_actor_runs_max_concurrency_calls_at_once(reap: list) -> None:
    """ray-core/actors/async_api.html (threaded actors): ``max_concurrency=N``
    runs up to N method calls at once in a thread pool."""
    meeting = ThreadedMeeting.remote()
    reap.append(meeting)
    assert sorted(pmetal.get([meeting.arrive.remote() for _ in range(3)],
                             timeout=WAIT)) == [0, 1, 2]


def test_an_actor_dies_with_the_actor_that_created_it(reap: list) -> None:
    """ray-core/fault_tolerance/actors.html (actor creator failure): "Actors
    can fail if ... the owner of the actor dies"; the owner is the worker
    that created it, and calls to the orphan raise ``RayActorError``."""
    parent = Parent.remote()
    child = pmetal.get(parent.child.remote(), timeout=WAIT)
    assert pmetal.get(child.increment.remote(), timeout=WAIT) == 1
    pmetal.kill(parent)

    def child_dead() -> bool:
        try:
            pmetal.get(child.increment.remote(), timeout=WAIT)
        except pmetal.exceptions.RayActorError:
            return True
        return False
    wait_until(child_dead, WAIT, "the child's death with its creator")


def test_detached_actor_outlives_its_driver_and_an_owned_one_does_not(
        cluster: dict[str, Any]) -> None:
    """ray-core/actors/named-actors.html (actor lifetimes) and
    ray-core/fault_tolerance/actors.html: a detached actor is not fate-shared
    with the driver that created it and stays reachable by name; a
    non-detached actor dies with its owner."""
    script = textwrap.dedent(f"""
        import pmetal
        from compat.checklist_classes import Counter
        pmetal.init(address={cluster["address"]!r}, psk={PSK!r})
        pmetal.get(Counter.options(name="checklist-detached", lifetime="detached").remote(7)
                   .increment.remote(), timeout=10)
        pmetal.get(Counter.options(name="checklist-owned").remote().increment.remote(),
                   timeout=10)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    detached = pmetal.get_actor("checklist-detached")
    try:
        assert pmetal.get(detached.increment.remote(), timeout=WAIT) == 9
        wait_until(lambda: _no_actor_named("checklist-owned"), WAIT,
                   "the owned actor's end with its driver")
    finally:
        pmetal.kill(detached)


def _no_actor_named(name: str) -> bool:
    try:
        pmetal.get_actor(name)
    except ValueError:
        return True
    return False


# ------------------------------------------------------- runtime context

def test_runtime_context_ids(reap: list) -> None:
    """ray-core/api/runtime-context.html: the job id is the driver's in its
    tasks and actors; each task has its own task id; ``get_actor_id`` is the
    actor's inside it and None in a task; ``current_actor`` is a handle to
    the actor the code runs in."""
    ctx = pmetal.get_runtime_context()
    counter = Counter.remote()
    reap.append(counter)
    first, second = pmetal.get([runtime_ids.remote(), runtime_ids.remote()], timeout=WAIT)
    in_actor = pmetal.get(counter.ids.remote(), timeout=WAIT)
    assert first["job"] == second["job"] == in_actor["job"] == str(ctx.get_job_id())
    assert first["task"] != second["task"]
    assert first["actor"] is None and in_actor["actor"] not in (None, "None")
    assert first["node"] == str(ctx.get_node_id())
    assert pmetal.get(counter.me.remote(), timeout=WAIT) == counter


# ------------------------------------------------------------ resources

def test_init_num_cpus_and_resources_size_the_node(reap: list) -> None:
    """ray-core/scheduling/resources.html: ``ray.init(num_cpus=...,
    resources={...})`` sets the node's logical resources; an actor holds the
    resources it asked for while it lives, and they are free again once it
    is gone."""
    assert pmetal.cluster_resources()["CPU"] == NUM_CPUS
    assert pmetal.cluster_resources()["board"] == BOARDS
    holder = Counter.options(resources={"board": 1}).remote()
    assert pmetal.available_resources().get("board", 0) == BOARDS - 1
    pmetal.kill(holder)
    wait_until(lambda: pmetal.available_resources().get("board", 0) == BOARDS, WAIT,
               "the killed actor's board back in available_resources()")


def test_memory_and_num_gpus_are_held_like_num_cpus(reap: list) -> None:
    """ray-core/scheduling/resources.html: ``memory`` and ``num_gpus`` are
    logical resources like ``num_cpus``: ``ray.init(num_gpus=...)`` sets the
    node's GPUs (none need exist), and an actor holds what it asked for."""
    assert pmetal.cluster_resources()["GPU"] == GPUS
    before = pmetal.available_resources()["memory"]
    holder = Counter.options(num_gpus=1, memory=2**20).remote()
    reap.append(holder)
    now = pmetal.available_resources()
    assert now["GPU"] == GPUS - 1 and now["memory"] == before - 2**20


def test_runtime_env_env_vars_reach_the_worker() -> None:
    """ray-core/handling-dependencies.html: ``runtime_env={"env_vars": ...}``
    given to ``ray.init`` applies to the job's tasks, and one given in
    ``.options`` adds to it for that task."""
    assert pmetal.get(env_var.remote("CHECKLIST_JOB_VAR"), timeout=WAIT) == "job"
    task = env_var.options(runtime_env={"env_vars": {"CHECKLIST_TASK_VAR": "task"}})
    assert pmetal.get(task.remote("CHECKLIST_TASK_VAR"), timeout=WAIT) == "task"


# --------------------------------------------------------------- ray.util

def test_actor_pool_map_returns_results_in_order(reap: list) -> None:
    """ray-core/actors/actor-utils.html: ``ActorPool.map`` schedules calls over a
    fixed pool of actors and yields the results in the order of the values."""
    actors = [Counter.remote(), Counter.remote()]
    reap.extend(actors)
    pool = ActorPool(actors)
    # whichever actor takes a value, the n-th pair of values finds both at n-1
    assert list(pool.map(lambda a, v: a.increment.remote(), range(6))) == [1, 1, 2, 2, 3, 3]


def test_queue_passes_items_between_driver_and_tasks() -> None:
    """ray-core/actors/actor-utils.html and ray-core/api/doc/ray.util.queue.Queue:
    a ``Queue`` can be passed to tasks; ``get(block=False)`` on an empty
    queue raises ``Empty``, ``put(block=False)`` on a full one ``Full``."""
    queue = Queue(maxsize=2)
    try:
        with pytest.raises(Empty):
            queue.get(block=False)
        queue.put(1)
        queue.put(2)
        with pytest.raises(Full):
            queue.put(3, block=False)

        @pmetal.remote
        def drain(q: Any) -> list[int]:
            return [q.get(timeout=WAIT) for _ in range(2)]
        assert pmetal.get(drain.remote(queue), timeout=WAIT) == [1, 2]
    finally:
        queue.shutdown()


def test_ray_exception_names() -> None:
    """ray-core/api/exceptions.html: ``RayActorError`` is the base of
    ``ActorDiedError``; ``GetTimeoutError`` is also a ``TimeoutError``; every
    Ray exception derives from ``RayError``."""
    ex = pmetal.exceptions
    assert issubclass(ex.ActorDiedError, ex.RayActorError)
    assert issubclass(ex.GetTimeoutError, TimeoutError)
    for name in ("RayTaskError", "RayActorError", "TaskCancelledError", "WorkerCrashedError",
                 "OwnerDiedError", "ObjectLostError", "GetTimeoutError"):
        assert issubclass(getattr(ex, name), ex.RayError), name



def test_a_cancelled_running_async_method_raises_a_RayTaskError(reap: list) -> None:
    """ray-core/actors.html (cancelling actor tasks; doc_code/actors.py): the
    documented way to catch the cancel of a running async actor method is
    ``except ray.exceptions.RayTaskError`` (Ray raises
    ``RayTaskError(TaskCancelledError)``, an instance of both)."""
    sleeper = Sleeper.remote()
    reap.append(sleeper)
    ref = sleeper.nap.remote()
    pmetal.get(sleeper.wait_started.remote(), timeout=WAIT)
    pmetal.cancel(ref)
    with pytest.raises(pmetal.exceptions.RayTaskError) as info:
        pmetal.get(ref, timeout=WAIT)
    assert isinstance(info.value, pmetal.exceptions.TaskCancelledError)


def test_an_async_actor_constructor_is_awaited(reap: list) -> None:
    """ray-core/actors/async_api.html, doc_code/actor-http-server.py: an async
    actor may define ``async def __init__``; Ray awaits it before the first
    call."""
    actor = AsyncBuilt.remote(5)
    reap.append(actor)
    assert pmetal.get(actor.get.remote(), timeout=WAIT) == 5



def test_wait_accepts_fetch_local() -> None:
    """ray-core/api/doc/ray.wait.html: ``ray.wait(refs, *, num_returns=1,
    timeout=None, fetch_local=True)``."""
    ref = pmetal.put(1)
    assert pmetal.wait([ref], timeout=WAIT, fetch_local=False) == ([ref], [])



def test_ray_actor_module_names_the_handle_type(reap: list) -> None:
    """ray-core/api/doc/ray.actor.ActorHandle.html: the handle type is
    ``ray.actor.ActorHandle`` (scripts annotate with it)."""
    import importlib
    actor_module = importlib.import_module("pmetal.actor")
    counter = Counter.remote()
    reap.append(counter)
    assert isinstance(counter, actor_module.ActorHandle)


def test_a_sync_actor_method_sees_its_cancel_through_is_canceled(reap: list) -> None:
    """ray-core/actors.html (cancelling actor tasks): a running sync actor
    method is not interrupted; it can check
    ``ray.get_runtime_context().is_canceled()`` and return early."""
    actor = Canceller.remote()
    reap.append(actor)
    ref = actor.until_cancelled.remote()
    pmetal.cancel(ref)
    with pytest.raises(pmetal.exceptions.TaskCancelledError):
        pmetal.get(ref, timeout=WAIT)
    # calls run in order: this one runs once the cancelled one returned
    assert pmetal.get(actor.last_outcome.remote(), timeout=2 * WAIT) == "saw it"


# ------------------------------- ownership: ObjectRefs inside values (own)

@OWN
def test_a_ref_nested_in_an_argument_arrives_as_a_ref() -> None:
    """ray-core/objects.html (passing object arguments): "Ray does not
    de-reference nested args": a ref inside a list arrives as a ref, and the
    task can ``ray.get`` it."""
    refs = [pmetal.put(1), pmetal.put(2)]
    assert pmetal.get(is_a_ref.remote(refs[0]), timeout=WAIT) is False
    assert pmetal.get(get_the_nested.remote(refs), timeout=WAIT) == [1, 2]


@OWN
def test_a_ref_captured_by_a_closure_can_be_got_in_the_task() -> None:
    """ray-core/objects.html (closure capture of objects): refs captured by a
    remote function's closure can be retrieved inside it."""
    captured = pmetal.put("captured")

    @pmetal.remote
    def read_capture() -> Any:
        return pmetal.get(captured, timeout=WAIT)
    assert pmetal.get(read_capture.remote(), timeout=WAIT) == "captured"


@OWN
def test_a_task_can_return_a_ref() -> None:
    """ray-core/tasks/nested-tasks.html and patterns (return ray.put): a task may
    return an object ref; the caller gets the ref and then its value."""
    inner = pmetal.get(make_and_return_a_ref.remote("inside"), timeout=WAIT)
    assert isinstance(inner, pmetal.ObjectRef)
    assert pmetal.get(inner, timeout=WAIT) == "inside"


@OWN
def test_an_actor_can_keep_refs_in_its_state(reap: list) -> None:
    """ray-core/objects.html: refs inside values (here, kept in an actor's
    state) stay valid while referenced and can be got later."""
    counter = Counter.remote()
    reap.append(counter)
    pmetal.get(counter.keep.remote([pmetal.put("kept")]), timeout=WAIT)
    assert pmetal.get(counter.read_kept.remote(), timeout=WAIT) == ["kept"]


@OWN
def test_get_of_an_object_whose_owner_died_raises_OwnerDiedError() -> None:
    """ray-core/fault_tolerance/objects.html: "If the owner of an object dies
    ... ray.get raises OwnerDiedError" (the worker that called ``ray.put``
    owns the object)."""
    owner = Counter.remote()
    [ref] = pmetal.get(owner.put_nested.remote("orphan"), timeout=WAIT)
    pmetal.kill(owner)
    with pytest.raises(pmetal.exceptions.OwnerDiedError):
        pmetal.get(ref, timeout=WAIT)


# ----------------------------------------------- generators (stream)

@STREAM
def test_a_generator_task_streams_refs_as_items_are_yielded(gate: Any) -> None:
    """ray-core/ray-generator.html: a remote generator returns an
    ``ObjectRefGenerator``; ``next(gen)`` gives the ref of the next yielded
    item as soon as it is produced, before the task ends."""
    gen = yield_then_wait.remote(gate)
    assert pmetal.get(next(gen), timeout=WAIT) == "first"   # the task still waits
    pmetal.get(gate.open.remote("rest"), timeout=WAIT)
    assert pmetal.get(next(gen), timeout=WAIT) == "second"
    with pytest.raises(StopIteration):
        next(gen)


@STREAM
def test_iterating_a_generator_task_and_an_actor_generator_method(reap: list) -> None:
    """ray-core/ray-generator.html: ``for ref in task.remote()`` yields a ref
    per item, for tasks and for actor methods alike."""
    assert [pmetal.get(r, timeout=WAIT) for r in count_up.remote(3)] == [0, 1, 2]
    counter = Counter.remote()
    reap.append(counter)
    assert [pmetal.get(r, timeout=WAIT) for r in counter.stream.remote(2)] == [0, 1]


@STREAM
def test_an_exception_in_a_generator_fails_the_item_it_stopped_at() -> None:
    """ray-core/ray-generator.html (exception handling): items yielded before
    the exception are returned; the next ``ray.get`` raises it."""
    gen = yield_then_fail.remote()
    assert pmetal.get(next(gen), timeout=WAIT) == 0
    with pytest.raises(ValueError, match="in the generator"):
        pmetal.get(next(gen), timeout=WAIT)


@STREAM
def test_num_returns_streaming_option() -> None:
    """ray-core/ray-generator.html: ``num_returns="streaming"`` may be given
    explicitly, in ``@ray.remote`` or ``.options``."""
    gen = count_up.options(num_returns="streaming").remote(2)
    assert [pmetal.get(r, timeout=WAIT) for r in gen] == [0, 1]


@STREAM
@pytest.mark.parametrize("drop", ["del gen", "pass"], ids=["dropped", "kept"])
def test_a_driver_left_holding_an_unfinished_generator_exits(drop: str) -> None:
    """ray-core/ray-generator.html (garbage collection; doc_code
    streaming_generator.py): a script may take one item of a generator and
    end, whether it dropped the generator or still holds it; the driver exits
    as any other (the task's remaining items are not waited for)."""
    script = textwrap.dedent(f"""
        import pmetal
        from compat.checklist_classes import slow_count
        gen = slow_count.remote(5, 3.0)
        assert pmetal.get(next(gen), timeout=10) == 0
        {drop}
    """)
    # the remaining items take 12 s: a driver that waits for them misses this
    subprocess.run([sys.executable, "-c", script], check=True, timeout=10)


@WORKING_DIR
def test_runtime_env_working_dir_is_the_tasks_working_folder(tmp_path: Path) -> None:
    """ray-core/handling-dependencies.html (runtime environments): with
    ``working_dir`` the folder is shipped to the cluster and tasks run with it
    as their working directory (relative paths find its files)."""
    (tmp_path / "data.txt").write_text("shipped")
    task = read_file.options(runtime_env={"working_dir": str(tmp_path)})
    assert pmetal.get(task.remote("data.txt"), timeout=WAIT) == "shipped"


# ------------------------------------------- placement groups (pg)

@PG
def test_placement_group_reserves_its_bundles_and_hosts_actors(reap: list) -> None:
    """ray-core/scheduling/placement-group.html: ``placement_group(bundles)``
    reserves the bundles' resources once ``ready()`` resolves; an actor
    scheduled with ``PlacementGroupSchedulingStrategy`` (and a bundle index)
    runs inside it; ``remove_placement_group`` frees the reservation."""
    from pmetal.util.placement_group import placement_group, remove_placement_group

    from pmetal.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    pmetal.get(pg.ready(), timeout=WAIT)
    assert pmetal.available_resources()["CPU"] == NUM_CPUS - 2
    actor = Counter.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=1)).remote()
    reap.append(actor)
    assert pmetal.get(actor.increment.remote(), timeout=WAIT) == 1
    remove_placement_group(pg)
    wait_until(lambda: pmetal.available_resources()["CPU"] == NUM_CPUS, WAIT,
               "the removed group's CPUs back in available_resources()")


@PG
def test_strict_spread_needs_as_many_nodes_as_bundles() -> None:
    """ray-core/scheduling/placement-group.html: STRICT_SPREAD puts each bundle
    on a different node, so two bundles on a one-node cluster stay pending
    (``ready()`` does not resolve)."""
    from pmetal.util.placement_group import placement_group, remove_placement_group
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    try:
        ready, not_ready = pmetal.wait([pg.ready()], timeout=0.5)
        assert ready == [] and len(not_ready) == 1
    finally:
        remove_placement_group(pg)


def test_scheduling_strategies_on_actors(reap: list) -> None:
    """ray-core/scheduling/index.html: an actor takes ``scheduling_strategy``
    "DEFAULT", "SPREAD" or ``NodeAffinitySchedulingStrategy(node_id,
    soft=False)``, which runs it on that node (the id from
    ``get_runtime_context().get_node_id()``)."""
    from pmetal.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    node = str(pmetal.get_runtime_context().get_node_id())
    actors = [Counter.options(scheduling_strategy=strategy).remote() for strategy in (
        "DEFAULT", "SPREAD", NodeAffinitySchedulingStrategy(node_id=node, soft=False))]
    reap.extend(actors)
    assert pmetal.get([a.node.remote() for a in actors], timeout=WAIT) == [node] * 3


@STRATEGY
def test_scheduling_strategy_spread_on_tasks() -> None:
    """ray-core/scheduling/index.html: ``scheduling_strategy="SPREAD"`` may be
    given to tasks ("spread tasks across the cluster")."""
    spread = echo.options(scheduling_strategy="SPREAD")
    assert pmetal.get([spread.remote(i) for i in range(4)], timeout=WAIT) == [0, 1, 2, 3]


@STRATEGY
def test_node_affinity_on_tasks() -> None:
    """ray-core/scheduling/index.html: a task with
    ``NodeAffinitySchedulingStrategy(node_id, soft=False)`` runs on that
    node."""
    from pmetal.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    node = str(pmetal.get_runtime_context().get_node_id())
    task = node_of_task.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
    assert pmetal.get(task.remote(), timeout=WAIT) == node
