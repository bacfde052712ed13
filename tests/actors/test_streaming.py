"""``num_returns="streaming"`` as in Ray: a call returns an
ObjectRefGenerator that yields one ref per item as the worker produces it,
with backpressure, cancellation, and a worker's death failing the next ref.

Generators that must pause until the test lets them go wait for a file (a
gate) the test creates; progress is read from the generator's own records
(a file, or an actor's attribute)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import pmetal
from pmetal import (
    ActorDiedError,
    ObjectRefGenerator,
    PMetalTypeError,
    PMetalValueError,
    TaskCancelledError,
    WorkerCrashedError,
    api,
)

from .conftest import EXIT_WAIT, WAIT, read_line, stop_process, wait_until

NUM_WORKERS = 2

pytestmark = pytest.mark.usefixtures("cluster")


def _wait_for(path: str) -> None:
    """Block (in a worker) until the test creates ``path``."""
    deadline = time.monotonic() + WAIT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)


@pmetal.remote(num_returns="streaming")
def count(n: int) -> Any:
    yield from range(n)


@pmetal.remote(num_returns="streaming")
def gated(gate: str) -> Any:
    yield os.getpid()
    _wait_for(gate)
    yield "after the gate"


@pmetal.remote(num_returns="streaming")
def recorded(record: str, n: int) -> Any:
    """Writes how many items it produced (and "closed" when it is closed)."""
    try:
        for i in range(n):
            Path(record + ".new").write_text(str(i + 1))
            os.replace(record + ".new", record)   # whole, for a reader at any time
            yield i
    finally:
        with open(record + ".closed", "w") as f:
            f.write("closed")


@pmetal.remote(num_returns="streaming")
def fails_after(n: int) -> Any:
    yield from range(n)
    raise ValueError(f"failed after {n}")


@pmetal.remote(num_returns="streaming")
def not_a_generator() -> int:
    return 7


@pmetal.remote(num_returns="streaming")
async def async_count(n: int) -> Any:
    for i in range(n):
        await asyncio.sleep(0)
        yield i * 10


@pmetal.remote
def plain(x: int) -> int:
    return x


@pmetal.remote
def by_default(n: int) -> Any:   # a generator streams without num_returns (Ray 2.8 on)
    yield from range(n)


@pmetal.remote
class Producer:
    @pmetal.method(num_returns="streaming")
    def items(self, n: int) -> Any:
        for i in range(n):
            yield f"item {i}"

    def pid(self) -> int:
        return os.getpid()

    def gen(self, n: int) -> Any:   # streaming only through .options
        yield from range(n)

    @pmetal.method(num_returns="streaming")
    def gated(self, gate: str) -> Any:
        yield 1
        _wait_for(gate)
        yield 2


@pmetal.remote
class Ledger:
    """A sync actor: one call at a time, a stream included."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def items(self, n: int) -> Any:
        for i in range(n):
            self.log.append(f"item {i}")
            yield i

    def note(self, what: str) -> list[str]:
        self.log.append(what)
        return list(self.log)


@pmetal.remote
class AsyncProducer:
    def __init__(self) -> None:
        self.produced = 0
        self.closed = False

    @pmetal.method(num_returns="streaming")
    async def forever(self) -> Any:
        try:
            while True:
                self.produced += 1
                yield self.produced
        finally:
            self.closed = True

    @pmetal.method(num_returns="streaming")
    async def one_then_wait(self) -> Any:
        try:
            yield 1
            await asyncio.Event().wait()   # until cancelled
        finally:
            self.closed = True

    async def state(self) -> tuple[int, bool]:
        return self.produced, self.closed


def test_a_task_streams_its_items_as_refs() -> None:
    gen = count.remote(4)
    assert isinstance(gen, ObjectRefGenerator)
    refs = list(gen)
    assert all(isinstance(r, pmetal.ObjectRef) for r in refs)
    assert pmetal.get(refs, timeout=WAIT) == [0, 1, 2, 3]
    assert gen.is_finished()
    with pytest.raises(StopIteration):
        next(gen)
    assert pmetal.get(gen.completed(), timeout=WAIT) == 4
    assert list(count.remote(0)) == []
    # an item's ref is a ref like any other: an argument of another call
    assert pmetal.get(plain.remote(next(count.remote(2))), timeout=WAIT) == 0


def test_items_arrive_before_the_generator_finishes(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gen = gated.remote(str(gate))
    pid = pmetal.get(next(gen), timeout=WAIT)   # the generator is still blocked at the gate
    assert pid != os.getpid() and not gate.exists()
    with pytest.raises(pmetal.GetTimeoutError):
        gen._next_sync(timeout_s=0.05)
    gate.touch()
    assert pmetal.get(next(gen), timeout=WAIT) == "after the gate"
    with pytest.raises(StopIteration):
        next(gen)


def test_an_exception_is_raised_by_the_next_ref_then_the_iteration_ends() -> None:
    gen = fails_after.remote(2)
    first, second, third = next(gen), next(gen), next(gen)
    assert pmetal.get([first, second], timeout=WAIT) == [0, 1]
    with pytest.raises(ValueError, match="failed after 2"):
        pmetal.get(third, timeout=WAIT)
    with pytest.raises(StopIteration):
        next(gen)


def test_a_function_that_is_not_a_generator_fails_its_first_ref() -> None:
    refs = list(not_a_generator.remote())
    assert len(refs) == 1
    with pytest.raises(TypeError, match="not a generator"):
        pmetal.get(refs[0], timeout=WAIT)


def test_async_generator_tasks_and_async_iteration() -> None:
    async def main() -> list[int]:
        out = []
        async for ref in async_count.remote(3):
            out.append(await ref)
        gen = count.remote(1)
        out.append(await (await gen.__anext__()))
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        return out
    assert asyncio.run(main()) == [0, 10, 20, 0]


def test_actor_methods_stream_by_decorator_and_by_options(reap: list[Any]) -> None:
    actor = Producer.remote()
    reap.append(actor)
    assert pmetal.get(list(actor.items.remote(3)), timeout=WAIT) == [
        "item 0", "item 1", "item 2"]
    gen = actor.gen.options(num_returns="streaming").remote(2)
    assert pmetal.get(list(gen), timeout=WAIT) == [0, 1]
    # a call after a stream runs after it (calls to an actor keep their order)
    assert pmetal.get(actor.pid.remote(), timeout=WAIT) > 0
    # a handle found by name knows the method streams
    named = Producer.options(name="streaming-producer").remote()
    reap.append(named)
    found = pmetal.get_actor("streaming-producer")
    assert pmetal.get(list(found.items.remote(2)), timeout=WAIT) == ["item 0", "item 1"]


def test_async_actor_streams_an_async_generator(reap: list[Any]) -> None:
    actor = AsyncProducer.remote()
    reap.append(actor)
    gen = actor.forever.options(_generator_backpressure_num_objects=2).remote()
    assert [pmetal.get(next(gen), timeout=WAIT) for _ in range(5)] == [1, 2, 3, 4, 5]


def test_backpressure_stops_an_async_generator_until_the_caller_takes(reap: list[Any]) -> None:
    actor = AsyncProducer.remote()
    reap.append(actor)
    gen = actor.forever.options(_generator_backpressure_num_objects=3).remote()
    wait_until(lambda: pmetal.get(actor.state.remote(), timeout=WAIT)[0] >= 3, WAIT,
               what="three items produced")
    # The generator waits for the caller: whatever else the actor does, it
    # produces no fourth item.
    for _ in range(20):
        assert pmetal.get(actor.state.remote(), timeout=WAIT) == (3, False)
    assert pmetal.get(next(gen), timeout=WAIT) == 1   # taking one lets one more be made
    wait_until(lambda: pmetal.get(actor.state.remote(), timeout=WAIT)[0] >= 4, WAIT,
               what="a fourth item")
    for _ in range(20):
        assert pmetal.get(actor.state.remote(), timeout=WAIT) == (4, False)
    del gen   # dropped unread: the worker closes the generator
    wait_until(lambda: pmetal.get(actor.state.remote(), timeout=WAIT)[1], WAIT,
               what="the generator closed")


def test_backpressure_bounds_a_task_generator(tmp_path: Path) -> None:
    record = str(tmp_path / "record")
    gen = recorded.options(_generator_backpressure_num_objects=2).remote(record, 12)
    wait_until(lambda: Path(record).exists() and Path(record).read_text() == "2", WAIT,
               what="two items produced")
    taken = 0
    for ref in gen:
        taken += 1
        # never more than the items taken plus the window
        assert int(Path(record).read_text()) <= taken + 2
        assert pmetal.get(ref, timeout=WAIT) == taken - 1
    assert taken == 12


def test_dropping_a_generator_stops_its_task_and_frees_the_worker(tmp_path: Path) -> None:
    record = str(tmp_path / "record")
    gen = recorded.options(_generator_backpressure_num_objects=1).remote(record, 1_000_000)
    assert pmetal.get(next(gen), timeout=WAIT) == 0
    del gen
    wait_until(lambda: Path(record + ".closed").exists(), WAIT, what="the generator closed")
    assert int(Path(record).read_text()) <= 2
    # both task workers serve tasks again
    assert pmetal.get([plain.remote(i) for i in range(8)], timeout=WAIT) == list(range(8))


def test_cancel_stops_a_task_generator(tmp_path: Path) -> None:
    record = str(tmp_path / "record")
    gen = recorded.options(_generator_backpressure_num_objects=2).remote(record, 1_000_000)
    assert pmetal.get(next(gen), timeout=WAIT) == 0
    pmetal.cancel(gen)
    refs = list(gen)   # what had arrived, then one cancelled ref, then the end
    with pytest.raises(TaskCancelledError):
        pmetal.get(refs[-1], timeout=WAIT)
    assert len(refs) <= 3
    wait_until(lambda: Path(record + ".closed").exists(), WAIT, what="the generator closed")


def test_cancel_stops_an_async_generator_through_asyncio(reap: list[Any]) -> None:
    actor = AsyncProducer.remote()
    reap.append(actor)
    gen = actor.one_then_wait.remote()
    assert pmetal.get(next(gen), timeout=WAIT) == 1
    pmetal.cancel(gen)
    with pytest.raises(TaskCancelledError):
        pmetal.get(next(gen), timeout=WAIT)
    with pytest.raises(StopIteration):
        next(gen)
    assert pmetal.get(actor.state.remote(), timeout=WAIT)[1] is True
    with pytest.raises(PMetalValueError, match="cannot be force-cancelled"):
        pmetal.cancel(actor.forever.remote(), force=True)


def test_an_actor_dying_mid_stream_fails_the_next_ref(tmp_path: Path,
                                                      reap: list[Any]) -> None:
    actor = Producer.remote()
    reap.append(actor)
    gen = actor.gated.remote(str(tmp_path / "never"))
    assert pmetal.get(next(gen), timeout=WAIT) == 1
    os.kill(_pid_of(actor), signal.SIGKILL)   # the node's record: the actor is busy
    with pytest.raises(ActorDiedError):
        pmetal.get(next(gen), timeout=WAIT)
    with pytest.raises(StopIteration):
        next(gen)


def _pid_of(actor: Any) -> int:
    from .conftest import worker_of
    return int(worker_of(actor)["pid"])


def test_a_task_worker_dying_mid_stream_fails_the_next_ref(tmp_path: Path) -> None:
    gen = gated.remote(str(tmp_path / "never"))
    pid = pmetal.get(next(gen), timeout=WAIT)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerCrashedError):
        pmetal.get(next(gen), timeout=WAIT)
    with pytest.raises(StopIteration):
        next(gen)


def test_env_vars_reach_a_streaming_task() -> None:
    @pmetal.remote(num_returns="streaming",
                   runtime_env={"env_vars": {"PMETAL_STREAM_TEST": "on"}})
    def env() -> Any:
        yield os.environ.get("PMETAL_STREAM_TEST")
        yield os.environ.get("PMETAL_STREAM_TEST")
    assert pmetal.get(list(env.remote()), timeout=WAIT) == ["on", "on"]


def test_bad_streaming_options_are_refused() -> None:
    with pytest.raises(PMetalValueError, match="use num_returns='streaming'"):
        pmetal.method(num_returns="dynamic")   # (remote functions take it: "dynamic")
    with pytest.raises(PMetalValueError, match="at least 1"):
        count.options(_generator_backpressure_num_objects=0)
    with pytest.raises(PMetalTypeError, match="must be an int"):
        count.options(_generator_backpressure_num_objects=1.5)
    with pytest.raises(PMetalValueError, match="streaming' only"):
        pmetal.method(num_returns=2, _generator_backpressure_num_objects=3)
    with pytest.raises(PMetalTypeError, match="iterate it"):
        pmetal.get(count.remote(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot be sent to another process"):
        plain.remote(count.remote(1))


def test_force_cancel_of_a_task_generator_kills_its_worker(tmp_path: Path) -> None:
    gen = gated.remote(str(tmp_path / "never"))
    pid = pmetal.get(next(gen), timeout=WAIT)
    pmetal.cancel(gen, force=True)
    with pytest.raises(TaskCancelledError):
        pmetal.get(next(gen), timeout=WAIT)
    wait_until(lambda: not _alive(pid), EXIT_WAIT, what="the worker killed")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # a zombie is gone
        return f.read().split(")")[-1].split()[0] != "Z"


# A second driver that starts a stream and is then killed without a word:
# the worker must notice and close the generator (it waits for ids that
# will never come).
CALLER = r"""
import os, sys
from pathlib import Path
import pmetal
pmetal.init(address=sys.argv[1], psk=bytes.fromhex(sys.argv[2]), namespace=sys.argv[3])

@pmetal.remote(num_returns="streaming", _generator_backpressure_num_objects=1)
def endless(record):
    try:
        i = 0
        while True:
            i += 1
            yield i
    finally:
        Path(record).write_text("closed")

gen = endless.remote(sys.argv[4])
print(pmetal.get(next(gen), timeout=30), flush=True)
sys.stdin.read()
"""


def test_a_caller_dying_mid_stream_closes_the_generator(tmp_path: Path) -> None:
    client = api.client()
    record = tmp_path / "closed"
    proc = subprocess.Popen(
        [sys.executable, "-c", CALLER, client.node_address, client.namespace.psk.hex(),
         client.namespace.name, str(record)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert read_line(proc, WAIT, "the caller's first item").strip() == "1"
        proc.kill()
        proc.wait(EXIT_WAIT)
        wait_until(record.exists, WAIT, what="the generator closed after its caller died")
    finally:
        stop_process(proc, signal.SIGKILL)
    # the task workers serve on
    assert pmetal.get([plain.remote(i) for i in range(4)], timeout=WAIT) == list(range(4))


def test_a_generator_streams_without_num_returns(reap: list[Any]) -> None:
    gen = by_default.remote(3)
    assert isinstance(gen, ObjectRefGenerator)
    assert pmetal.get(list(gen), timeout=WAIT) == [0, 1, 2]
    actor = Producer.remote()
    reap.append(actor)
    assert pmetal.get(list(actor.gen.remote(2)), timeout=WAIT) == [0, 1]   # no decorator
    assert isinstance(by_default.options(num_returns=1).remote(1), pmetal.ObjectRef)


def test_wait_on_generators_and_refs(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    waiting = gated.remote(str(gate))
    pmetal.get(next(waiting), timeout=WAIT)   # the next item waits for the gate
    ready_gen = count.remote(1)   # to the other task worker: this one serves `waiting`
    ref = pmetal.put(5)
    ready, not_ready = pmetal.wait([waiting, ready_gen, ref], num_returns=2, timeout=WAIT)
    assert ready == [ready_gen, ref] and not_ready == [waiting]
    ready, not_ready = pmetal.wait([waiting], timeout=0.05)
    assert ready == [] and not_ready == [waiting]
    gate.touch()
    ready, _ = pmetal.wait([waiting], timeout=WAIT)
    assert ready == [waiting]
    assert pmetal.get(next(waiting), timeout=WAIT) == "after the gate"
    # an ended stream is ready: next() raises StopIteration at once
    assert pmetal.wait([waiting], timeout=WAIT)[0] == [waiting]
    with pytest.raises(StopIteration):
        next(waiting)


def test_tasks_avoid_a_task_worker_that_serves_a_stream(tmp_path: Path) -> None:
    """A task worker runs nothing else while its stream is open (here: held
    at a gate): tasks submitted meanwhile go to the other worker, however
    many there are, instead of queueing behind the stream."""
    gate = tmp_path / "gate"
    held = gated.remote(str(gate))
    pmetal.get(next(held), timeout=WAIT)
    refs = [plain.remote(i) for i in range(100)]
    assert pmetal.get(refs, timeout=WAIT) == list(range(100))
    gate.touch()
    assert pmetal.get(list(held), timeout=WAIT) == ["after the gate"]


@pmetal.remote(max_concurrency=3)
class Threaded:
    def items(self, n: int) -> Any:   # a sync generator, in the actor's threads
        for i in range(n):
            yield i * i


def test_a_threaded_actor_streams_a_sync_generator(reap: list[Any]) -> None:
    actor = Threaded.remote()
    reap.append(actor)
    gens = [actor.items.remote(4) for _ in range(3)]   # three at once
    assert [pmetal.get(list(g), timeout=WAIT) for g in gens] == [[0, 1, 4, 9]] * 3


def test_rays_wait_loop_over_generators_and_refs() -> None:
    """Ray's documented pattern (ray-generator.rst, "ray.wait"): wait on a
    mix of generators and refs, taking one item of each ready generator."""
    from pmetal._raylet import ObjectRefGenerator as RayletGenerator
    assert RayletGenerator is ObjectRefGenerator
    unready: list[Any] = [count.remote(3), plain.remote("done")]
    result = []
    while unready:
        ready, unready = pmetal.wait(unready, timeout=WAIT)
        for r in ready:
            if isinstance(r, RayletGenerator):
                try:
                    result.append(pmetal.get(next(r), timeout=WAIT))
                except StopIteration:
                    continue
                unready.append(r)
            else:
                result.append(pmetal.get(r, timeout=WAIT))
    assert sorted(result, key=str) == [0, 1, 2, "done"]


def test_a_streaming_task_goes_where_its_scheduling_strategy_says() -> None:
    from pmetal.util import placement_group, remove_placement_group
    from pmetal.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )
    node = pmetal.get_runtime_context().get_node_id()
    for strategy in ("SPREAD", NodeAffinitySchedulingStrategy(node, soft=False)):
        gen = count.options(scheduling_strategy=strategy).remote(3)
        assert pmetal.get(list(gen), timeout=WAIT) == [0, 1, 2]
    pg = placement_group([{"CPU": 0.5}])
    try:
        assert pg.wait(WAIT)
        gen = count.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg)).remote(2)
        assert pmetal.get(list(gen), timeout=WAIT) == [0, 1]
    finally:
        remove_placement_group(pg)
    # a group not created yet: a stream cannot wait for it
    pending = placement_group([{"CPU": 10_000}])
    try:
        with pytest.raises(pmetal.PlacementError, match="cannot wait for its placement group"):
            count.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pending)).remote(1)
    finally:
        remove_placement_group(pending)


def test_calls_made_during_a_sync_actors_stream_run_after_it_in_order(
        reap: list[Any]) -> None:
    """The stream holds the actor (one call at a time) while it waits for its
    caller; calls sent meanwhile wait in the worker and run after the stream's
    end, in the order they were made."""
    actor = Ledger.remote()
    reap.append(actor)
    gen = actor.items.options(_generator_backpressure_num_objects=1).remote(3)
    first = next(gen)
    notes = [actor.note.remote(f"call {i}") for i in range(3)]
    assert pmetal.wait(notes, num_returns=1, timeout=0.2)[0] == []   # held behind the stream
    assert pmetal.get([first, *gen], timeout=WAIT) == [0, 1, 2]
    assert pmetal.get(notes[-1], timeout=WAIT) == [
        "item 0", "item 1", "item 2", "call 0", "call 1", "call 2"]


def test_a_stream_with_pending_ref_arguments_returns_at_once(tmp_path: Path,
                                                            reap: list[Any]) -> None:
    """As any call: ``.remote()`` returns its generator while an argument is
    still being computed; the stream starts once it is there, and a later
    call to the same actor runs after the stream's call."""
    gate = tmp_path / "gate"

    @pmetal.remote
    def slow(n: int) -> int:
        _wait_for(str(gate))
        return n

    n = slow.remote(3)
    gen = count.remote(n)   # returns before the gate opens
    assert not gate.exists() and not n.done()
    actor = Ledger.remote()
    reap.append(actor)
    stream = actor.items.remote(n)
    after = actor.note.remote("after")
    ready, _ = pmetal.wait([gen], timeout=0.05)
    assert ready == []
    gate.touch()
    assert pmetal.get(list(gen), timeout=WAIT) == [0, 1, 2]
    assert pmetal.get(list(stream), timeout=WAIT) == [0, 1, 2]
    assert pmetal.get(after, timeout=WAIT)[-1] == "after"
    assert pmetal.get(after, timeout=WAIT)[:3] == ["item 0", "item 1", "item 2"]
    # a failed argument fails the first ref, then the iteration ends
    gate2 = tmp_path / "gate2"

    @pmetal.remote
    def boom() -> int:
        _wait_for(str(gate2))
        raise ValueError("no count")

    failed = count.remote(boom.remote())
    gate2.touch()
    refs = list(failed)
    assert len(refs) == 1
    with pytest.raises(ValueError, match="no count"):
        pmetal.get(refs[0], timeout=WAIT)


def test_cancel_of_a_stream_waiting_for_its_arguments(tmp_path: Path) -> None:
    gate = tmp_path / "gate"

    @pmetal.remote
    def slow() -> int:
        _wait_for(str(gate))
        return 2

    gen = count.remote(slow.remote())
    pmetal.cancel(gen)
    refs = list(gen)
    assert len(refs) == 1
    with pytest.raises(TaskCancelledError, match="before it was sent"):
        pmetal.get(refs[0], timeout=WAIT)
    gate.touch()


def test_a_stream_gets_refs_nested_in_its_arguments() -> None:
    """A ref inside a list argument of a streaming task arrives as a ref
    (as for any call) and the generator can get it from its owner."""
    inner = pmetal.put(21)

    @pmetal.remote(num_returns="streaming")
    def doubles(boxed: list) -> Any:
        (ref,) = boxed
        assert isinstance(ref, pmetal.ObjectRef)
        value = pmetal.get(ref, timeout=10)
        yield value
        yield 2 * value

    assert pmetal.get(list(doubles.remote([inner])), timeout=10) == [21, 42]
