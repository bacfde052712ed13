"""``pmetal.cancel`` as Ray documents it, on real tasks and actors: a call
not sent yet never runs, a call already sent has its result discarded, and
``get`` of a cancelled ref raises TaskCancelledError at once."""

from __future__ import annotations

from pathlib import Path

import pytest

import pmetal
from pmetal import NotInitializedError, PMetalTypeError, PMetalValueError, TaskCancelledError
from pmetal.actors import context

from .cancel_classes import (
    AsyncSleeper,
    Recorder,
    Watcher,
    canceled_in_a_task,
    note_pid_and_block,
    pair,
    plus_one,
    touch,
    wait_for_file,
)
from .conftest import EXIT_WAIT, WAIT, pid_alive, wait_until

NUM_WORKERS = 2

pytestmark = pytest.mark.usefixtures("cluster")


def test_a_task_waiting_for_its_arguments_never_runs(tmp_path: Path) -> None:
    gate, marker = tmp_path / "gate", tmp_path / "ran"
    first = wait_for_file.remote(str(gate), 1)
    waiting = touch.remote(first, str(marker))
    pmetal.cancel(waiting)
    with pytest.raises(TaskCancelledError, match="cancelled by pmetal.cancel before it was sent"):
        pmetal.get(waiting, timeout=WAIT)
    # It left the queue of calls waiting for their arguments: nothing can send it.
    assert all(item.ref is not waiting for item in context.current()._deferrals._items)
    gate.touch()
    assert pmetal.get(first, timeout=WAIT) == 1
    # A task over the same argument, not cancelled, still runs.
    assert pmetal.get(touch.remote(first, str(tmp_path / "other")), timeout=WAIT)
    assert not marker.exists()


def test_a_queued_actor_call_is_dropped_and_later_calls_keep_their_order(
        tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    recorder = Recorder.remote()
    first = wait_for_file.remote(str(gate), 0)
    dropped = recorder.record.remote(first, "dropped")   # waits for first
    kept = recorder.record.remote(None, "kept")           # waits behind it (order)
    pmetal.cancel(dropped)
    with pytest.raises(TaskCancelledError, match="Recorder.*record"):
        pmetal.get(dropped, timeout=WAIT)
    gate.touch()
    assert pmetal.get(kept, timeout=WAIT) == "kept"
    assert pmetal.get(recorder.log.remote(), timeout=WAIT) == ["kept"]


def test_a_running_task_has_its_result_discarded(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    running = wait_for_file.remote(str(gate), "late")
    pmetal.cancel(running, force=False)
    with pytest.raises(TaskCancelledError, match="its result is discarded"):
        pmetal.get(running, timeout=WAIT)
    gate.touch()
    # Its late reply finds no ref and is dropped; the workers go on.
    assert pmetal.get([plus_one.remote(i) for i in range(4)], timeout=WAIT) == [1, 2, 3, 4]
    with pytest.raises(TaskCancelledError):
        pmetal.get(running, timeout=WAIT)


def test_force_on_an_actor_method_is_refused_and_leaves_the_call(tmp_path: Path) -> None:
    recorder = Recorder.remote()
    ref = recorder.record.remote(wait_for_file.remote(str(tmp_path / "gate")), "x")
    with pytest.raises(PMetalValueError, match="pmetal.kill"):
        pmetal.cancel(ref, force=True)
    (tmp_path / "gate").touch()
    assert pmetal.get(ref, timeout=WAIT) == "x"


def test_cancel_of_a_finished_ref_twice_and_of_items() -> None:
    ref = plus_one.remote(1)
    assert pmetal.get(ref, timeout=WAIT) == 2
    pmetal.cancel(ref)
    pmetal.cancel(ref)
    assert pmetal.get(ref, timeout=WAIT) == 2
    put = pmetal.put(5)
    pmetal.cancel(put)
    assert pmetal.get(put) == 5


def test_cancel_twice_raises_once_cancelled(tmp_path: Path) -> None:
    ref = wait_for_file.remote(str(tmp_path / "gate"))
    pmetal.cancel(ref)
    pmetal.cancel(ref, force=True)
    with pytest.raises(TaskCancelledError):
        pmetal.get(ref, timeout=WAIT)
    ready, _ = pmetal.wait([ref], timeout=WAIT)
    assert ready == [ref]
    (tmp_path / "gate").touch()


@pytest.mark.parametrize("call, match", [
    (lambda: pmetal.cancel(5), "ObjectRef .* not int"),
    (lambda: pmetal.cancel([pmetal.put(1)]), "not list"),
    (lambda: pmetal.cancel(pmetal.put(1), force="yes"), "force must be a bool"),
    (lambda: pmetal.cancel(pmetal.put(1), recursive=None), "recursive must be a bool"),
], ids=["int", "list", "force-str", "recursive-none"])
def test_misuse_is_a_type_error(call, match: str) -> None:
    with pytest.raises(PMetalTypeError, match=match):
        call()
    with pytest.raises(TypeError):
        call()


def test_a_running_async_method_is_cancelled_through_asyncio(tmp_path: Path) -> None:
    sleeper = AsyncSleeper.remote()
    started, gate = tmp_path / "started", tmp_path / "gate"
    running = sleeper.block.remote(str(started), str(gate))
    wait_until(started.exists, WAIT, what="the async method to start")
    pmetal.cancel(running)
    with pytest.raises(TaskCancelledError, match="async method is cancelled"):
        pmetal.get(running, timeout=WAIT)
    # The coroutine got CancelledError (no gate was ever created).
    wait_until(lambda: pmetal.get(sleeper.seen.remote(), timeout=WAIT) == [str(started)],
               WAIT, what="the coroutine to see CancelledError")
    # The actor goes on serving, its connection too.
    other = tmp_path / "other"
    gate.touch()
    assert pmetal.get(sleeper.block.remote(str(other), str(gate)), timeout=WAIT) == "finished"


def test_force_kills_the_worker_of_a_running_task(tmp_path: Path) -> None:
    started, gate = tmp_path / "started", tmp_path / "gate"
    running = note_pid_and_block.remote(str(started), str(gate))
    pid = int(wait_until(lambda: started.exists() and started.read_text(), WAIT,
                         what="the task to start"))
    pmetal.cancel(running, force=True)
    with pytest.raises(TaskCancelledError, match="force=True killed its worker"):
        pmetal.get(running, timeout=WAIT)
    wait_until(lambda: not pid_alive(pid), EXIT_WAIT, what=f"worker {pid} to exit")
    # The node replaces it; tasks go on (a retry covers one sent before
    # this process noticed the worker's connection close).
    again = plus_one.options(max_retries=3)
    assert pmetal.get([again.remote(i) for i in range(4)], timeout=WAIT) == [1, 2, 3, 4]
    assert not gate.exists()


def test_cancelling_one_item_ref_cancels_the_call(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    first = wait_for_file.remote(str(gate), 0)
    items = pair.options(num_returns=2).remote(first)
    pmetal.cancel(items[0])
    ready, _ = pmetal.wait(items, num_returns=2, timeout=WAIT)
    assert ready == items
    for item in items:
        with pytest.raises(TaskCancelledError, match="before it was sent"):
            pmetal.get(item, timeout=WAIT)
    gate.touch()
    assert pmetal.get(first, timeout=WAIT) == 0


def test_a_threaded_actors_method_sees_its_cancel_through_is_canceled(tmp_path: Path) -> None:
    """Ray's get_runtime_context().is_canceled(): a running sync method is
    not interrupted, it may look and return early (the checklist has a
    sync actor's; this is a threaded one's)."""
    actor = Watcher.remote()
    started = tmp_path / "started"
    ref = actor.until_cancelled.remote(str(started))
    wait_until(started.exists, WAIT, what="the method started")
    assert pmetal.get(actor.quick.remote(), timeout=WAIT) is False   # the other thread's
    pmetal.cancel(ref)
    with pytest.raises(TaskCancelledError):
        pmetal.get(ref, timeout=WAIT)
    assert wait_until(lambda: pmetal.get(actor.outcomes.remote(), timeout=WAIT), WAIT,
                      what="the method returned") == ["cancelled"]
    pmetal.kill(actor)


def test_is_canceled_is_false_in_a_task_and_refused_in_the_driver() -> None:
    assert pmetal.get(canceled_in_a_task.remote(), timeout=WAIT) is False
    with pytest.raises(NotInitializedError, match="answers in an actor's method"):
        pmetal.get_runtime_context().is_canceled()
