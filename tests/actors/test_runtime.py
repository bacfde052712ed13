"""The Ray-style API working as it should, against a real embedded node.

Actors, remote functions, ordering, results and exceptions, timeouts,
``wait``, ``put``, ObjectRef arguments, handles passed around, async and
threaded actors, named actors, code shipped by value and by reference.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pmetal
from pmetal import GetTimeoutError, PMetalError, PMetalTimeoutError, RemoteError

from .actor_classes import (
    Counter,
    CustomError,
    Gate,
    Proxy,
    Threaded,
    call_actor,
    fail,
    nested,
    square,
    wait_at,
    worker_pid,
)
from .conftest import WAIT, shared_memory_objects, wait_until
from .semantics_classes import Holder, array_kind, echo_task

NUM_WORKERS = 2
# The node, its workers and the driver: a handshake is given up after 2 s,
# not the default 5 s, so a call held up past it takes 3 s, not 6
# (test_a_new_caller_of_a_busy_actor_waits_its_turn).
TRANSPORT = {"handshake_timeout": 2.0}

pytestmark = pytest.mark.usefixtures("cluster")


@pytest.fixture(scope="module")
def counter(cluster: dict[str, Any]) -> Any:
    """A shared actor for tests that do not depend on its state."""
    return Counter.remote()


@pytest.fixture(scope="module")
def gate(cluster: dict[str, Any]) -> Any:
    """A shared async actor; each test uses its own keys."""
    return Gate.remote()


# ------------------------------------------------------------------ actors

def test_actor_keeps_state_between_calls(reap: list[Any]) -> None:
    c = Counter.remote(5)
    reap.append(c)
    assert pmetal.get(c.inc.remote(), timeout=WAIT) == 6
    assert pmetal.get(c.inc.remote(k=2), timeout=WAIT) == 8
    assert pmetal.get(c.value.remote(), timeout=WAIT) == 8


def test_calls_from_one_caller_run_in_submission_order(reap: list[Any]) -> None:
    c = Counter.remote()
    reap.append(c)
    refs = [c.record.remote(i) for i in range(300)]
    assert pmetal.get(refs, timeout=WAIT) == list(range(1, 301))
    assert pmetal.get(c.history.remote(), timeout=WAIT) == list(range(300))


def test_get_of_a_single_ref_and_of_a_list(counter: Any) -> None:
    ref = counter.echo.remote("one")
    assert pmetal.get(ref, timeout=WAIT) == "one"
    assert pmetal.get([counter.echo.remote(i) for i in range(3)], timeout=WAIT) == [0, 1, 2]
    assert pmetal.get([], timeout=WAIT) == []
    # A result can be fetched again.
    assert pmetal.get(ref, timeout=WAIT) == "one"


def test_keyword_arguments(counter: Any) -> None:
    assert pmetal.get(counter.echo.remote(1, a=2, b="x"), timeout=WAIT) == (
        (1,), {"a": 2, "b": "x"})


def _same_shape(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (True is not 1)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_shape(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_shape(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


_scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
            | st.binary(max_size=20) | st.frozensets(st.integers(), max_size=3))
_values = st.recursive(
    _scalars,
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=4)),
    max_leaves=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_values)
def test_values_survive_a_round_trip_with_their_types(counter: Any, value: Any) -> None:
    back = pmetal.get(counter.echo.remote(value), timeout=WAIT)
    assert _same_shape(back, value), (value, back)


@pytest.mark.parametrize("make", [
    lambda: np.arange(12, dtype=np.float32).reshape(3, 4),
    lambda: np.arange(10, dtype=np.int64)[::3],               # not contiguous
    lambda: np.arange(12, dtype=">i4").reshape(4, 3),         # big-endian
    lambda: np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
    lambda: np.array(3.5),                                    # 0-d
    lambda: np.zeros((0, 4), dtype=np.uint8),                 # empty
    lambda: np.array([True, False, True]),
    lambda: np.array([1 + 2j, 3 - 4j], dtype=np.complex64),
    lambda: np.arange(5, dtype=np.float16),
    lambda: np.random.default_rng(0).random(375_000),         # 3 MB: several frames
    lambda: np.random.default_rng(1).random(700_000),         # 5.6 MB: shared memory
], ids=["f32", "strided", "big-endian", "fortran", "0-d", "empty", "bool", "c64", "f16",
        "chunked", "large"])
def test_numpy_arrays_round_trip(counter: Any, make: Any) -> None:
    arr = make()
    back = pmetal.get(counter.echo.remote(arr), timeout=WAIT)
    assert isinstance(back, np.ndarray)
    assert back.dtype.name == arr.dtype.name
    assert back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


def test_large_arrays_leave_no_shared_memory_behind(counter: Any) -> None:
    pids = (os.getpid(), pmetal.get(counter.pid.remote(), timeout=WAIT))
    arrays = [np.full(1 << 20, i, dtype=np.float64) for i in range(3)]  # 8 MiB each
    backs = pmetal.get([counter.echo.remote(a) for a in arrays], timeout=WAIT)
    for a, back in zip(arrays, backs):
        np.testing.assert_array_equal(back, a)
    del backs
    # What may remain are the driver channel's request slots, kept for reuse
    # (unlinked when the channel closes); nothing else, and nothing of the worker.
    pool = pmetal.api.client().links[counter._address].channel._pool
    kept = {name.lstrip("/") for name, _, _ in (pool._free if pool else [])}
    assert set(shared_memory_objects(*pids)) <= kept


# Every path that takes numpy arrays takes MLX arrays too: sizes that go
# in one frame, in several frames, and through shared memory.
ARRAY_SIZES = {"small": 12, "chunked": 750_000, "shared-memory": 1_400_000}


def make_array(lib: str, size: str) -> Any:
    host = np.arange(ARRAY_SIZES[size], dtype=np.float32) % 251
    return host if lib == "numpy" else mx.array(host)


def assert_same_array(got: Any, want: Any, lib: str) -> None:
    assert isinstance(got, np.ndarray if lib == "numpy" else mx.array), type(got)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("size", list(ARRAY_SIZES))
@pytest.mark.parametrize("lib", ["numpy", "mlx"])
def test_arrays_as_arguments_and_results_of_calls_and_tasks(counter: Any, lib: str,
                                                            size: str) -> None:
    arr = make_array(lib, size)
    assert_same_array(pmetal.get(counter.echo.remote(arr), timeout=WAIT), arr, lib)
    assert_same_array(pmetal.get(echo_task.remote(arr), timeout=WAIT), arr, lib)
    assert pmetal.get(array_kind.remote(arr), timeout=WAIT) == lib


@pytest.mark.parametrize("lib", ["numpy", "mlx"])
def test_arrays_through_put_refs_constructors_and_containers(lib: str,
                                                             reap: list[Any]) -> None:
    arr = make_array(lib, "shared-memory")
    ref = pmetal.put(arr)
    assert_same_array(pmetal.get(ref, timeout=WAIT), arr, lib)
    assert_same_array(pmetal.get(echo_task.remote(ref), timeout=WAIT), arr, lib)
    holder = Holder.remote({"w": arr, "steps": [make_array(lib, "small"), 7]})
    reap.append(holder)
    back = pmetal.get(holder.get.remote(), timeout=WAIT)
    assert_same_array(back["w"], arr, lib)
    assert_same_array(back["steps"][0], make_array(lib, "small"), lib)
    assert back["steps"][1] == 7


def test_mlx_bfloat16_arrays_keep_their_dtype(counter: Any) -> None:
    arr = mx.arange(1000).astype(mx.bfloat16).reshape(20, 50)
    back = pmetal.get(counter.echo.remote(arr), timeout=WAIT)
    assert isinstance(back, mx.array) and back.dtype == mx.bfloat16
    assert mx.array_equal(back, arr).item()


def test_arrays_inside_containers_round_trip(counter: Any) -> None:
    value = {"w": np.ones((2, 2), np.float32), "steps": [np.arange(3), 7]}
    back = pmetal.get(counter.echo.remote(value), timeout=WAIT)
    np.testing.assert_array_equal(back["w"], value["w"])
    np.testing.assert_array_equal(back["steps"][0], np.arange(3))
    assert back["steps"][1] == 7


# ------------------------------------------------------------ exceptions

def test_remote_exception_is_remote_error_and_the_original_type(counter: Any) -> None:
    with pytest.raises(ValueError) as info:
        pmetal.get(counter.boom.remote("bad value 42"), timeout=WAIT)
    err = info.value
    assert isinstance(err, RemoteError)
    assert isinstance(err, PMetalError)
    assert err.error_type == "ValueError"
    assert err.args == ("bad value 42",)
    assert "bad value 42" in str(err)
    # The remote traceback names the user frames that raised, and starts in
    # user code rather than in the worker's machinery.
    tb = err.remote_traceback
    assert "in boom" in tb and "in raise_value_error" in tb
    assert "raise ValueError(message)" in tb
    assert "pmetal/actors/worker.py" not in tb
    assert tb in str(err)


def test_remote_exception_keeps_its_class_and_attributes(counter: Any) -> None:
    with pytest.raises(CustomError) as info:
        pmetal.get(counter.fail_custom.remote(7), timeout=WAIT)
    assert isinstance(info.value, RemoteError)
    assert info.value.code == 7
    assert "custom failure 7" in str(info.value)


def test_actor_keeps_serving_after_an_exception(reap: list[Any]) -> None:
    c = Counter.remote()
    reap.append(c)
    refs = [c.inc.remote(), c.boom.remote(), c.inc.remote()]
    assert pmetal.get(refs[0], timeout=WAIT) == 1
    with pytest.raises(ValueError):
        pmetal.get(refs[1], timeout=WAIT)
    assert pmetal.get(refs[2], timeout=WAIT) == 2
    # get of a list raises the first error among them
    with pytest.raises(ValueError):
        pmetal.get([c.inc.remote(), c.boom.remote()], timeout=WAIT)


# ------------------------------------------------------------- timeouts

def test_get_timeout_raises_and_the_call_goes_on(gate: Any) -> None:
    ref = gate.wait.remote("timeout-1")
    start = time.monotonic()
    with pytest.raises(GetTimeoutError) as info:
        pmetal.get(ref, timeout=0.3)
    elapsed = time.monotonic() - start
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, PMetalTimeoutError)
    assert 0.25 <= elapsed < 3.0
    assert not ref.done()
    pmetal.get(gate.open.remote("timeout-1"), timeout=WAIT)
    assert pmetal.get(ref, timeout=WAIT) == "timeout-1"


def test_get_timeout_on_a_list_with_one_slow_ref(gate: Any, counter: Any) -> None:
    refs = [counter.echo.remote(1), gate.wait.remote("timeout-2")]
    with pytest.raises(TimeoutError):
        pmetal.get(refs, timeout=0.3)
    pmetal.get(gate.open.remote("timeout-2"), timeout=WAIT)
    assert pmetal.get(refs, timeout=WAIT) == [1, "timeout-2"]


def test_get_zero_timeout_on_a_ready_ref(counter: Any) -> None:
    ref = counter.echo.remote(5)
    assert pmetal.get(ref, timeout=WAIT) == 5
    assert pmetal.get(ref, timeout=0) == 5


# ------------------------------------------------------------------ wait

def test_wait_returns_ready_refs_in_input_order(gate: Any) -> None:
    refs = [gate.wait.remote(k) for k in ("w-a", "w-b", "w-c")]
    # Finish the last one first, then the first one.
    pmetal.get(gate.open.remote("w-c"), timeout=WAIT)
    pmetal.get(gate.open.remote("w-a"), timeout=WAIT)
    ready, not_ready = pmetal.wait(refs, num_returns=2, timeout=WAIT)
    assert ready == [refs[0], refs[2]]
    assert not_ready == [refs[1]]
    pmetal.get(gate.open.remote("w-b"), timeout=WAIT)
    assert pmetal.get(refs, timeout=WAIT) == ["w-a", "w-b", "w-c"]


def test_wait_default_is_the_first_ready_ref(gate: Any) -> None:
    refs = [gate.wait.remote("w-d"), gate.wait.remote("w-e")]
    pmetal.get(gate.open.remote("w-e"), timeout=WAIT)
    ready, not_ready = pmetal.wait(refs, timeout=WAIT)
    assert ready == [refs[1]]
    assert not_ready == [refs[0]]
    pmetal.get(gate.open.remote("w-d"), timeout=WAIT)
    pmetal.get(refs, timeout=WAIT)


def test_a_fast_result_is_not_held_back_by_a_slow_call_behind_it(reap: list[Any]) -> None:
    # Calls made while another is in flight may travel together; each
    # result must still be ready as soon as its own call is done.
    c = Counter.remote()
    reap.append(c)
    first = c.inc.remote()
    refs = [c.echo.remote("fast"), c.block.remote(3.0)]
    ready, not_ready = pmetal.wait(refs, num_returns=1, timeout=2.0)
    assert ready == [refs[0]]
    assert not_ready == [refs[1]]
    assert pmetal.get([first, *refs], timeout=WAIT) == [1, "fast", "unblocked"]


def test_wait_with_timeout_returns_what_is_ready(gate: Any) -> None:
    done = pmetal.put("ready")
    pending = gate.wait.remote("w-f")
    start = time.monotonic()
    ready, not_ready = pmetal.wait([pending, done], num_returns=2, timeout=0.3)
    assert 0.25 <= time.monotonic() - start < 3.0
    assert ready == [done]
    assert not_ready == [pending]
    pmetal.get(gate.open.remote("w-f"), timeout=WAIT)
    assert pmetal.get(pending, timeout=WAIT) == "w-f"


def test_wait_returns_at_most_num_returns(counter: Any) -> None:
    refs = [counter.echo.remote(i) for i in range(4)]
    pmetal.get(refs, timeout=WAIT)
    ready, not_ready = pmetal.wait(refs, num_returns=3, timeout=WAIT)
    assert ready == refs[:3]
    assert not_ready == refs[3:]
    assert pmetal.wait(refs, num_returns=0, timeout=WAIT) == ([], refs)


def test_wait_counts_failed_refs_as_ready(counter: Any, gate: Any) -> None:
    refs = [gate.wait.remote("w-g"), counter.boom.remote()]
    ready, not_ready = pmetal.wait(refs, num_returns=1, timeout=WAIT)
    assert ready == [refs[1]]
    assert not_ready == [refs[0]]
    with pytest.raises(ValueError):
        pmetal.get(ready[0], timeout=WAIT)
    pmetal.get(gate.open.remote("w-g"), timeout=WAIT)
    pmetal.get(refs[0], timeout=WAIT)


def test_wait_rejects_bad_arguments(counter: Any) -> None:
    ref = counter.echo.remote(1)
    with pytest.raises(ValueError):
        pmetal.wait([ref, ref], num_returns=1, timeout=WAIT)
    with pytest.raises(ValueError):
        pmetal.wait([ref], num_returns=2, timeout=WAIT)
    with pytest.raises(TypeError):
        pmetal.wait([ref, 3], timeout=WAIT)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        pmetal.get([ref, 3], timeout=WAIT)  # type: ignore[list-item]
    pmetal.get(ref, timeout=WAIT)


# -------------------------------------------------------- put and refs

def test_put_and_get() -> None:
    arr = np.arange(6).reshape(2, 3)
    ref = pmetal.put({"a": arr, "b": (1, 2)})
    assert ref.done()
    value = pmetal.get(ref, timeout=WAIT)
    np.testing.assert_array_equal(value["a"], arr)
    assert value["b"] == (1, 2)
    with pytest.raises(TypeError):
        pmetal.put(ref)


def test_object_refs_as_top_level_arguments_are_resolved(counter: Any,
                                                         reap: list[Any]) -> None:
    other = Counter.remote(10)
    reap.append(other)
    assert pmetal.get(counter.echo.remote(pmetal.put(5)), timeout=WAIT) == 5
    # A ref to another actor's result, positionally and by keyword.
    assert pmetal.get(counter.echo.remote(other.inc.remote()), timeout=WAIT) == 11
    assert pmetal.get(counter.echo.remote(0, x=other.inc.remote()),
                      timeout=WAIT) == ((0,), {"x": 12})
    # ... and to a remote function's result, and into a constructor.
    assert pmetal.get(counter.echo.remote(square.remote(3)), timeout=WAIT) == 9
    third = Counter.remote(square.remote(4))
    reap.append(third)
    assert pmetal.get(third.value.remote(), timeout=WAIT) == 16


def test_failed_ref_as_argument_raises_its_error(counter: Any) -> None:
    with pytest.raises(ValueError):
        pmetal.get(counter.echo.remote(counter.boom.remote()), timeout=WAIT)


def test_remote_with_a_pending_ref_argument_returns_at_once(counter: Any, gate: Any) -> None:
    pending = gate.wait.remote("defer-1", 7)
    ref = counter.echo.remote(pending)
    # Had .remote() waited for its argument, the gate would have to be open.
    assert not pending.done()
    assert pmetal.get(gate.waiters.remote("defer-1"), timeout=WAIT) == 1
    pmetal.get(gate.open.remote("defer-1"), timeout=WAIT)
    assert pmetal.get(ref, timeout=WAIT) == 7


def test_a_call_waiting_for_its_argument_keeps_its_place_in_order(gate: Any,
                                                                  reap: list[Any]) -> None:
    c = Counter.remote()
    reap.append(c)
    first = c.record.remote(gate.wait.remote("defer-2", "first"))
    later = [c.record.remote(i) for i in range(3)]   # ready arguments, but queued behind
    assert pmetal.wait(later, num_returns=1, timeout=0.2)[0] == []
    pmetal.get(gate.open.remote("defer-2"), timeout=WAIT)
    assert pmetal.get([first, *later], timeout=WAIT) == [1, 2, 3, 4]
    assert pmetal.get(c.history.remote(), timeout=WAIT) == ["first", 0, 1, 2]


def test_a_failed_argument_fails_the_call_without_running_it(reap: list[Any]) -> None:
    c = Counter.remote()
    reap.append(c)
    ref = c.record.remote(c.boom.remote("bad argument"))
    with pytest.raises(ValueError, match="bad argument"):
        pmetal.get(ref, timeout=WAIT)
    assert pmetal.get(c.history.remote(), timeout=WAIT) == []


def test_task_chains_are_submitted_without_waiting(gate: Any) -> None:
    firsts = [gate.wait.remote(f"defer-3-{i}", i) for i in range(3)]
    squares = [square.remote(f) for f in firsts]
    assert not any(f.done() for f in firsts)
    for i in reversed(range(3)):
        pmetal.get(gate.open.remote(f"defer-3-{i}"), timeout=WAIT)
    assert pmetal.get(squares, timeout=WAIT) == [0, 1, 4]


def test_wait_and_timeouts_with_calls_waiting_for_arguments(counter: Any, gate: Any) -> None:
    deferred = counter.echo.remote(gate.wait.remote("defer-4", "late"))
    quick = square.remote(3)
    ready, not_ready = pmetal.wait([deferred, quick], num_returns=1, timeout=WAIT)
    assert ready == [quick] and not_ready == [deferred]
    with pytest.raises(GetTimeoutError):
        pmetal.get(deferred, timeout=0.1)
    pmetal.get(gate.open.remote("defer-4"), timeout=WAIT)
    assert pmetal.get(deferred, timeout=WAIT) == "late"


def test_tasks_go_to_a_task_worker_that_is_free(gate: Any) -> None:
    task_workers = [w for w in pmetal.api.client().status()["workers"] if w["role"] == "task"]
    if len(task_workers) < 2:
        pytest.skip("the node has one task worker (one CPU): nothing to choose between")
    busy = wait_at.remote(gate, "free-1")
    wait_until(lambda: pmetal.get(gate.waiters.remote("free-1"), timeout=WAIT) == 1, WAIT,
               what="the first task to wait at the gate")
    # Each of these would wait for the gate if sent to the busy worker.
    pids = {pmetal.get(worker_pid.remote(), timeout=WAIT / 2) for _ in range(4)}
    pmetal.get(gate.open.remote("free-1"), timeout=WAIT)
    assert pmetal.get(busy, timeout=WAIT) not in pids


def test_status_counts_pool_workers_and_members() -> None:
    client = pmetal.api.client()
    before = client.status()["pool"]
    c = Counter.remote()
    assert pmetal.get(c.inc.remote(), timeout=WAIT) == 1
    pmetal.kill(c)
    # The killed worker is counted as exited; taking it from the idle pool
    # started a replacement.
    wait_until(lambda: client.status()["pool"]["exited"] > before["exited"], WAIT,
               what="the killed worker counted as exited")
    assert client.status()["pool"]["started"] > before["started"]
    membership = client.status()["membership"]
    # Alone, the node is the master of a one-node list (epoch 1 on).
    assert membership["members"] == 1 and membership["epoch"] >= 1, membership
    assert membership["joins_refused"] == 0 and membership["requests_failed"] == 0


def test_object_ref_inside_a_value_travels_as_a_ref(counter: Any) -> None:
    # As in Ray: not resolved; echoed back, it is our own ref again
    # (tests/actors/test_ownership.py has the rest).
    ref = pmetal.put(1)
    [back] = pmetal.get(counter.echo.remote([ref]), timeout=WAIT)
    assert back is ref


def _inside(thread: threading.Thread, module: str, function: str) -> bool:
    """Whether ``thread`` is running ``module.function`` right now."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        code = frame.f_code
        if code.co_name == function and frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False


def test_a_thread_waiting_in_get_does_not_block_other_threads(gate: Any) -> None:
    # One thread waits for a result that only another thread's call produces.
    results: list[Any] = []

    def waiter() -> None:
        try:
            results.append(pmetal.get(gate.wait.remote("thread-1"), timeout=5.0))
        except PMetalError as exc:  # reported by the assertion below
            results.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        # Open the gate only once the waiter is inside pmetal.get.
        wait_until(lambda: _inside(thread, "pmetal.api", "get"), WAIT,
                   what="the waiter thread inside pmetal.get")
        opened = gate.open.remote("thread-1")
        assert pmetal.get(opened, timeout=WAIT) is True
    finally:
        thread.join(WAIT)
    assert results == ["thread-1"]


def test_await_an_object_ref_in_asyncio(counter: Any) -> None:
    async def main() -> Any:
        return await asyncio.wait_for(counter.echo.remote("awaited"), WAIT)
    assert asyncio.run(main()) == "awaited"


# --------------------------------------------------------------- handles

def test_handles_passed_as_arguments(counter: Any, reap: list[Any]) -> None:
    target = Counter.remote()
    reap.append(target)
    assert pmetal.get(counter.call.remote(target, "inc", 3), timeout=WAIT) == 3
    assert pmetal.get(target.value.remote(), timeout=WAIT) == 3
    # Calls through a passed handle keep their order too.
    items = list(range(50))
    assert pmetal.get(counter.call_many.remote(target, "record", items),
                      timeout=WAIT) == list(range(1, 51))
    assert pmetal.get(target.history.remote(), timeout=WAIT) == items


def test_a_new_caller_of_a_busy_actor_waits_its_turn(counter: Any, reap: list[Any]) -> None:
    # The target is busy in a long method when another actor calls it for the
    # first time: that call queues behind the busy one instead of failing.
    target = Counter.remote()
    reap.append(target)
    busy = target.block.remote(TRANSPORT["handshake_timeout"] + 1.0)  # longer than a handshake may take
    assert pmetal.get(counter.call.remote(target, "inc", 1), timeout=WAIT) == 1
    assert pmetal.get(busy, timeout=WAIT) == "unblocked"


def test_handle_returned_from_an_actor_works(counter: Any, reap: list[Any]) -> None:
    target = Counter.remote(100)
    reap.append(target)
    back = pmetal.get(counter.echo.remote(target), timeout=WAIT)
    assert back == target
    assert pmetal.get(back.inc.remote(), timeout=WAIT) == 101


def test_handle_passed_to_a_remote_function(reap: list[Any]) -> None:
    target = Counter.remote()
    reap.append(target)
    assert pmetal.get(call_actor.remote(target, 4), timeout=WAIT) == 4
    assert pmetal.get(target.value.remote(), timeout=WAIT) == 4


# ------------------------------------------------------- remote functions

def test_remote_functions() -> None:
    assert pmetal.get(square.remote(7), timeout=WAIT) == 49
    refs = [square.remote(i) for i in range(20)]
    assert pmetal.get(refs, timeout=WAIT) == [i * i for i in range(20)]
    assert pmetal.get(square.remote(x=5), timeout=WAIT) == 25
    assert pmetal.get(square.remote(np.arange(3)), timeout=WAIT).tolist() == [0, 1, 4]


def test_remote_function_exception() -> None:
    with pytest.raises(ValueError) as info:
        pmetal.get(fail.remote("task failed"), timeout=WAIT)
    assert isinstance(info.value, RemoteError)
    assert "in raise_value_error" in info.value.remote_traceback
    assert pmetal.get(square.remote(2), timeout=WAIT) == 4


def test_local_function_and_closure_travel_by_value() -> None:
    offset = 1000

    @pmetal.remote
    def add_offset(x: int) -> int:
        return x + offset

    assert pmetal.get([add_offset.remote(i) for i in range(3)], timeout=WAIT) == [
        1000, 1001, 1002]


def test_remote_function_calls_a_remote_function() -> None:
    assert pmetal.get(nested.remote(3), timeout=WAIT) == 10


def test_remote_functions_calling_remote_functions_on_every_task_worker() -> None:
    # As many of them as there are task workers: every worker is busy in a
    # task that waits for another task. They must not wait for each other.
    # (A short inner timeout keeps a deadlock from stalling later tests.)
    workers = [w for w in pmetal.api.client().status()["workers"] if w["role"] == "task"]
    refs = [nested.remote(i, 3.0) for i in range(len(workers))]
    assert pmetal.get(refs, timeout=WAIT) == [i * i + 1 for i in range(len(workers))]


def test_actor_calls_a_remote_function(counter: Any) -> None:
    assert pmetal.get(counter.run_function.remote(6), timeout=WAIT) == 36


def test_remote_things_cannot_be_called_directly(counter: Any) -> None:
    with pytest.raises(TypeError, match="remote"):
        square(3)
    with pytest.raises(TypeError, match="remote"):
        Counter()
    with pytest.raises(TypeError, match="remote"):
        counter.inc()


def test_unknown_options_are_refused() -> None:
    with pytest.raises(TypeError, match="num_gpu"):
        Counter.options(num_gpu=1)
    with pytest.raises(TypeError, match="bogus"):
        pmetal.remote(bogus=1)(lambda: None)


# ---------------------------------------------------- async and threaded

def test_async_actor_runs_calls_concurrently(gate: Any) -> None:
    waiting = gate.wait.remote("async-1", result="released")
    assert pmetal.get(gate.open.remote("async-1"), timeout=WAIT) is True
    assert pmetal.get(waiting, timeout=WAIT) == "released"


def test_async_actor_exception_and_sync_method(gate: Any) -> None:
    with pytest.raises(KeyError) as info:
        pmetal.get(gate.boom.remote("missing"), timeout=WAIT)
    assert isinstance(info.value, RemoteError)
    assert "in boom" in info.value.remote_traceback
    assert pmetal.get(gate.sync_method.remote(1), timeout=WAIT) == 2


def test_async_actor_awaits_object_refs(counter: Any, reap: list[Any]) -> None:
    proxy = Proxy.remote()
    reap.append(proxy)
    assert pmetal.get(proxy.through.remote(counter, "echo", "via proxy"),
                      timeout=WAIT) == "via proxy"


def test_async_actor_keeps_serving_while_it_awaits_a_ref(gate: Any, reap: list[Any]) -> None:
    # The first call awaits a ref that only the second call can complete:
    # awaiting must not block the actor's event loop.
    proxy = Proxy.remote()
    reap.append(proxy)
    waiting = proxy.through.remote(gate, "wait", "proxy-1")
    opening = proxy.through.remote(gate, "open", "proxy-1")
    assert pmetal.get([waiting, opening], timeout=WAIT) == ["proxy-1", True]


def test_threaded_actor_runs_calls_in_parallel(reap: list[Any]) -> None:
    actor = Threaded.remote()
    reap.append(actor)
    # Each call waits at a two-party barrier: both must run at once.
    assert pmetal.get([actor.meet.remote(0), actor.meet.remote(1)], timeout=WAIT) == [0, 1]


# ---------------------------------------------------------- code shipping

def test_locally_defined_class_travels_by_value(reap: list[Any]) -> None:
    @pmetal.remote
    class Local:
        def __init__(self, base: int) -> None:
            self.base = base

        def plus(self, x: int) -> int:
            return self.base + x

    actor = Local.remote(40)
    reap.append(actor)
    assert pmetal.get(actor.plus.remote(2), timeout=WAIT) == 42


def test_importable_class_travels_by_reference(counter: Any) -> None:
    # DESIGN section 2: importable code travels by reference, so the worker
    # runs the very class its module defines (not an unpickled copy).
    origin = pmetal.get(counter.code_origin.remote(), timeout=WAIT)
    assert origin == {"module": Counter.__wrapped__.__module__, "same_class": True}


# ----------------------------------------------------------- named actors

def test_named_actor_and_get_actor(reap: list[Any]) -> None:
    actor = Counter.options(name="runtime-named").remote(1)
    reap.append(actor)
    found = pmetal.get_actor("runtime-named")
    assert found == actor
    assert pmetal.get(found.inc.remote(), timeout=WAIT) == 2
    assert pmetal.get(actor.value.remote(), timeout=WAIT) == 2
    with pytest.raises(ValueError, match="runtime-named"):
        Counter.options(name="runtime-named").remote()
    with pytest.raises(ValueError, match="no-such-actor"):
        pmetal.get_actor("no-such-actor")


# ---------------------------------------------------------------- cluster

def test_nodes_and_resources(cluster: dict[str, Any]) -> None:
    nodes = pmetal.nodes()
    assert [n["NodeID"] for n in nodes] == [cluster["node_id"]]
    assert nodes[0]["Alive"] is True
    total = pmetal.cluster_resources()
    assert total["CPU"] >= 1
    assert pmetal.available_resources()["CPU"] <= total["CPU"]


def test_is_initialized_and_reinit(cluster: dict[str, Any]) -> None:
    assert pmetal.is_initialized()
    with pytest.raises(PMetalError, match="already"):
        pmetal.init()
    assert pmetal.init(ignore_reinit_error=True)["node_id"] == cluster["node_id"]
