"""Ray's ``ray.util.ActorPool`` and ``ray.util.queue`` on pmetal, with real
actors: results in order and as ready, waiting submissions, the pool's
bookkeeping, and a queue shared by the driver and a task."""

from __future__ import annotations

import asyncio

import pytest

import pmetal
import pmetal.util
from pmetal.util import ActorPool
from pmetal.util.queue import Empty, Full, Queue

from .conftest import WAIT
from .surface_classes import Doubler, Gate

NUM_WORKERS = 2

pytestmark = pytest.mark.usefixtures("cluster")


@pytest.fixture(scope="module")
def doublers() -> list:
    return [Doubler.remote() for _ in range(2)]


@pytest.fixture
def gate(reap: list) -> object:
    handle = Gate.remote()
    reap.append(handle)
    return handle


def test_ray_paths() -> None:
    assert pmetal.util.ActorPool is ActorPool
    assert pmetal.util.queue.Queue is Queue


# ---------------------------------------------------------------- ActorPool

def test_map_returns_results_in_order_with_more_values_than_actors(doublers: list) -> None:
    pool = ActorPool(doublers)
    out = list(pool.map(lambda a, v: a.double.remote(v), range(7)))
    assert out == [2 * v for v in range(7)]
    assert not pool.has_next() and pool.has_free()


def test_map_unordered_returns_each_result_once(doublers: list) -> None:
    pool = ActorPool(doublers)
    out = list(pool.map_unordered(lambda a, v: a.double.remote(v), range(7)))
    assert sorted(out) == [2 * v for v in range(7)]


def test_get_next_unordered_returns_the_ready_result_first(doublers: list, gate: object) -> None:
    pool = ActorPool(doublers)
    pool.submit(lambda a, v: a.double_after.remote(v, gate), "slow")
    pool.submit(lambda a, v: a.double.remote(v), 21)
    assert not pool.has_free()
    assert pool.get_next_unordered(timeout=WAIT) == 42
    with pytest.raises(TimeoutError):   # the slow one waits for the gate
        pool.get_next_unordered(timeout=0.05)
    pmetal.get(gate.open.remote("slow"), timeout=WAIT)
    assert pool.get_next_unordered(timeout=WAIT) == "slowslow"
    assert not pool.has_next()
    with pytest.raises(StopIteration):
        pool.get_next_unordered()


def test_get_next_keeps_submission_order_and_its_timeout(doublers: list, gate: object) -> None:
    pool = ActorPool(doublers)
    pool.submit(lambda a, v: a.double_after.remote(v, gate), 5)
    pool.submit(lambda a, v: a.double.remote(v), 6)
    with pytest.raises(pmetal.exceptions.GetTimeoutError):
        pool.get_next(timeout=0.05)
    assert pool.has_next()
    pmetal.get(gate.open.remote(5), timeout=WAIT)
    assert pool.get_next(timeout=WAIT) == 10
    assert pool.get_next(timeout=WAIT) == 12
    with pytest.raises(StopIteration):
        pool.get_next()


def test_submissions_wait_for_a_free_actor(doublers: list, gate: object) -> None:
    pool = ActorPool(doublers[:1])
    pool.submit(lambda a, v: a.double_after.remote(v, gate), 1)
    pool.submit(lambda a, v: a.double.remote(v), 2)   # no actor free: queued
    assert not pool.has_free()
    pmetal.get(gate.open.remote(1), timeout=WAIT)
    assert [pool.get_next(timeout=WAIT), pool.get_next(timeout=WAIT)] == [2, 4]


def test_get_next_after_get_next_unordered_is_refused(doublers: list) -> None:
    pool = ActorPool(doublers)
    for v in (1, 2):
        pool.submit(lambda a, v: a.double.remote(v), v)
    pool.get_next_unordered(timeout=WAIT)
    pool.get_next_unordered(timeout=WAIT)
    pool.submit(lambda a, v: a.double.remote(v), 3)
    assert pool.get_next(timeout=WAIT) == 6


def test_push_and_pop_idle(doublers: list) -> None:
    pool = ActorPool([])
    assert pool.pop_idle() is None and not pool.has_free()
    pool.push(doublers[0])
    with pytest.raises(ValueError, match="already belongs"):
        pool.push(doublers[0])
    assert pool.has_free()
    assert pool.pop_idle() == doublers[0]
    assert pool.pop_idle() is None
    pool.submit(lambda a, v: a.double.remote(v), 4)   # waits: the pool is empty
    assert not pool.has_next()
    pool.push(doublers[1])                            # the waiting one starts on it
    assert pool.has_next() and pool.get_next(timeout=WAIT) == 8


def test_a_call_that_raised_frees_its_actor(doublers: list) -> None:
    pool = ActorPool(doublers[:1])
    pool.submit(lambda a, v: a.double.remote(v), None)   # 2 * None raises TypeError
    pool.submit(lambda a, v: a.double.remote(v), 3)
    with pytest.raises(TypeError):
        pool.get_next(timeout=WAIT)
    assert pool.get_next(timeout=WAIT) == 6
    assert pool.has_free()


def test_misuse_is_refused(doublers: list) -> None:
    with pytest.raises(TypeError, match="actor handles"):
        ActorPool(["not an actor"])
    pool = ActorPool(doublers)
    with pytest.raises(TypeError, match="must return the ObjectRef"):
        pool.submit(lambda a, v: v, 1)
    assert pool.has_free()   # the actor went back


# -------------------------------------------------------------------- Queue

@pytest.fixture
def queue() -> object:
    q = Queue(maxsize=2)
    yield q
    q.shutdown()


def test_queue_put_get_in_order_and_its_size(queue: Queue) -> None:
    assert queue.empty() and not queue.full() and queue.qsize() == 0 and len(queue) == 0
    queue.put("a")
    queue.put_nowait("b")
    assert queue.full() and queue.qsize() == 2 and queue.maxsize == 2
    assert [queue.get(), queue.get_nowait()] == ["a", "b"]
    assert queue.empty()


def test_queue_raises_rays_empty_and_full(queue: Queue) -> None:
    with pytest.raises(Empty):
        queue.get_nowait()
    with pytest.raises(Empty):
        queue.get(block=False)
    with pytest.raises(Empty):
        queue.get(timeout=0.05)
    queue.put_nowait_batch([1, 2])
    with pytest.raises(Full):
        queue.put_nowait(3)
    with pytest.raises(Full):
        queue.put(3, timeout=0.05)
    with pytest.raises(Full):
        queue.put_nowait_batch([3])
    assert queue.get_nowait_batch(2) == [1, 2]
    with pytest.raises(Empty):
        queue.get_nowait_batch(1)


def test_a_task_blocked_in_get_returns_when_the_driver_puts(queue: Queue) -> None:
    waiting = get_from_a_task.remote(queue)
    ready, _ = pmetal.wait([waiting], timeout=0.1)
    assert not ready   # it waits in get: nothing was put yet
    queue.put("hello")
    assert pmetal.get(waiting, timeout=WAIT) == "hello"


def test_the_driver_blocked_in_get_returns_when_a_task_puts(queue: Queue) -> None:
    put_from_a_task.remote(queue, "from a task")
    assert queue.get(timeout=WAIT) == "from a task"


def test_queue_async_put_and_get(queue: Queue) -> None:
    async def main() -> list:
        await queue.put_async("x")
        await queue.put_async("y", block=False)
        with pytest.raises(Full):
            await queue.put_async("z", timeout=0.05)
        out = [await queue.get_async(), await queue.get_async(block=False)]
        with pytest.raises(Empty):
            await queue.get_async(timeout=0.05)
        return out
    assert asyncio.run(asyncio.wait_for(main(), WAIT)) == ["x", "y"]


def test_queue_misuse_is_refused(queue: Queue) -> None:
    with pytest.raises(ValueError, match="timeout=-1"):
        queue.get(timeout=-1)
    with pytest.raises(TypeError, match="maxsize must be an int"):
        Queue(maxsize="2")
    with pytest.raises(ValueError, match="num_items=-1"):
        queue.get_nowait_batch(-1)


def test_a_shut_down_queue_says_so() -> None:
    q = Queue()
    q.shutdown()
    with pytest.raises(ValueError, match="shut down"):
        q.put(1)


@pmetal.remote
def put_from_a_task(queue: Queue, item: object) -> None:
    queue.put(item, timeout=WAIT)


@pmetal.remote
def get_from_a_task(queue: Queue) -> object:
    return queue.get(timeout=WAIT)
