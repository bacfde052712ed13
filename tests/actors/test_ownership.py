"""ObjectRefs inside values (Ray's ownership model), in real processes:
refs nested in arguments arrive as refs, borrowers fetch from the owner,
refs come back in return values, chains of borrowers, a pending ref passed
on, and an owner killed with SIGKILL."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pmetal
from pmetal.actors import context
from pmetal.actors.objects import BorrowedRef
from pmetal.errors import OwnerDiedError

from .cancel_classes import wait_for_file
from .conftest import WAIT, pid_alive, shared_memory_objects, wait_until
from .ownership_classes import AsyncHolder, Box, Holder, add_one, make_and_return

NUM_WORKERS = 2

pytestmark = pytest.mark.usefixtures("cluster")


def test_refs_nested_in_arguments_arrive_as_refs_and_get_works_there(reap: list) -> None:
    a = Holder.remote()
    reap.append(a)
    x, y = pmetal.put(1), pmetal.put("two")
    got = pmetal.get(a.describe.remote([x, {"y": y}], box=Box("b", x)), timeout=WAIT)
    assert got == {"args": [["ref", {"y": "ref"}]], "kwargs": {"box": {"label": "b", "ref": "ref"}}}
    got = pmetal.get(a.resolve.remote([x, {"y": y}, Box("b", x), (y,)]), timeout=WAIT)
    assert got == [1, {"y": "two"}, {"label": "b", "ref": 1}, ["two"]]


def test_top_level_refs_are_still_resolved_by_the_caller(reap: list) -> None:
    a = Holder.remote()
    reap.append(a)
    assert pmetal.get(a.describe.remote(pmetal.put(3)), timeout=WAIT) == {
        "args": [3], "kwargs": {}}


def test_a_ref_kept_in_actor_state_is_fetched_later(reap: list) -> None:
    a = Holder.remote()
    reap.append(a)
    ref = pmetal.put({"k": [1, 2]})
    assert pmetal.get(a.keep.remote([ref]), timeout=WAIT) == 1
    del ref   # the actor's borrow keeps the object at its owner
    assert pmetal.get(a.resolve_kept.remote(), timeout=WAIT) == [{"k": [1, 2]}]


def test_a_closure_capturing_a_ref() -> None:
    ref = pmetal.put(20)

    @pmetal.remote
    def plus(n: int) -> int:
        return pmetal.get(ref, timeout=WAIT) + n

    assert pmetal.get([plus.remote(1), plus.remote(2)], timeout=WAIT) == [21, 22]


def test_a_task_returns_a_ref_it_created_and_a_ref_it_received() -> None:
    mine = pmetal.put("driver's")
    created, received = pmetal.get(make_and_return.remote([mine]), timeout=WAIT)
    assert isinstance(created, BorrowedRef)   # owned by the task's worker
    assert pmetal.get(created, timeout=WAIT) == 7
    assert received is mine   # our own ref came back: the original object
    assert pmetal.get(add_one.remote([created]), timeout=WAIT) == 8


def test_a_chain_driver_to_actor_to_actor(reap: list) -> None:
    a, b = Holder.remote(), Holder.remote()
    reap.extend([a, b])
    refs = [pmetal.put(i) for i in range(5)]
    assert pmetal.get(a.relay.remote([refs], b), timeout=WAIT) == [[0, 1, 2, 3, 4]]
    # b keeps them (borrowed from us through a), a and the driver let go.
    assert pmetal.get(a.pass_on.remote(refs, b), timeout=WAIT) == 5
    del refs
    assert pmetal.get(b.resolve_kept.remote(), timeout=WAIT) == [0, 1, 2, 3, 4]
    # A ref owned by an actor, through the driver, to another actor.
    [theirs] = pmetal.get(a.make.remote("a's"), timeout=WAIT)
    assert pmetal.get(b.resolve.remote({"r": theirs}), timeout=WAIT) == {"r": "a's"}


def test_a_pending_ref_passed_nested_waits_at_the_borrower(reap: list, tmp_path: Path) -> None:
    a = Holder.remote()
    reap.append(a)
    gate = tmp_path / "gate"
    pending = wait_for_file.remote(str(gate), "late")
    assert not pending.done()
    assert pmetal.get(a.try_get.remote([pending], 0.2), timeout=WAIT) == "timeout"
    assert pmetal.get(a.wait_ready.remote([pending], 0.2), timeout=WAIT) == 0
    # Only the owner cancels the call (Ray forwards it there; pmetal says so).
    refused = pmetal.get(a.cancel.remote([pending]), timeout=WAIT)
    assert refused.startswith("PMetalValueError") and "owner" in refused, refused
    later = a.resolve.remote([pending])
    gate.write_text("open")
    assert pmetal.get(later, timeout=WAIT) == ["late"]


def test_a_get_of_many_borrowed_refs_from_two_owners(reap: list) -> None:
    # More than one prefetch window (1,000), owned by the driver and by
    # another actor, pending and ready ones mixed.
    a, b = Holder.remote(), Holder.remote()
    reap.extend([a, b])
    theirs = pmetal.get([b.make.remote(i) for i in range(3)], timeout=WAIT)
    refs = [pmetal.put(i) for i in range(2500)] + [r for [r] in theirs]
    assert pmetal.get(a.get_list.remote(refs), timeout=WAIT) == [*range(2500), 0, 1, 2]


def test_borrowed_refs_work_with_wait(reap: list) -> None:
    a = Holder.remote()
    reap.append(a)
    refs = [pmetal.put(i) for i in range(3)]
    assert pmetal.get(a.wait_ready.remote(refs, WAIT), timeout=WAIT) == 3


def test_an_async_actor_returns_a_ref_it_made_and_awaits_borrowed_ones(reap: list) -> None:
    a = AsyncHolder.remote()
    reap.append(a)
    [made] = pmetal.get(a.make.remote("async"), timeout=WAIT)
    assert isinstance(made, BorrowedRef) and pmetal.get(made, timeout=WAIT) == "async"
    assert pmetal.get(a.resolve.remote([pmetal.put(1), made]), timeout=WAIT) == [1, "async"]


def test_a_failed_objects_error_reaches_the_borrower(reap: list) -> None:
    a = Holder.remote()
    reap.append(a)
    failed = add_one.remote(["not a ref"])   # get of a str raises in the task
    with pytest.raises(pmetal.PMetalError):
        pmetal.get(failed, timeout=WAIT)
    with pytest.raises(pmetal.PMetalError):
        pmetal.get(a.resolve.remote([failed]), timeout=WAIT)


def test_a_large_array_owned_by_an_actor_is_fetched_intact(reap: list) -> None:
    a = Holder.remote()
    reap.append(a)
    pid = pmetal.get(a.pid.remote(), timeout=WAIT)
    n = 1 << 20   # 8 MiB: travels in shared memory on one machine
    [ref] = pmetal.get(a.make_array.remote(n), timeout=WAIT)
    got = pmetal.get(ref, timeout=WAIT)
    np.testing.assert_array_equal(got, np.arange(n, dtype=np.float64))
    assert shared_memory_objects(pid) == []


def test_an_owner_killed_with_sigkill_fails_gets_with_owner_died(reap: list) -> None:
    owner = Holder.remote()
    reap.append(owner)
    pid = pmetal.get(owner.pid.remote(), timeout=WAIT)
    [fetched] = pmetal.get(owner.make.remote("seen"), timeout=WAIT)
    [unseen] = pmetal.get(owner.make.remote("never seen"), timeout=WAIT)
    assert pmetal.get(fetched, timeout=WAIT) == "seen"
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), WAIT, what=f"exit of worker {pid}")
    with pytest.raises(OwnerDiedError) as err:
        pmetal.get(unseen, timeout=WAIT)   # a known-dead owner: raised, not timed out
    text = str(err.value)
    assert f"object {unseen._oid}" in text and unseen._owner.owner_id[:8] in text
    assert "died" in text
    assert isinstance(err.value, pmetal.exceptions.ObjectLostError)
    assert pmetal.get(fetched, timeout=WAIT) == "seen"   # fetched before: kept here
    # A borrower elsewhere learns it the same way.
    b = Holder.remote()
    reap.append(b)
    with pytest.raises(OwnerDiedError):
        pmetal.get(b.resolve.remote([unseen]), timeout=WAIT)


def test_put_of_a_ref_is_refused_but_a_value_holding_refs_is_not() -> None:
    ref = pmetal.put(1)
    with pytest.raises(TypeError, match="ObjectRef"):
        pmetal.put(ref)
    outer = pmetal.put([ref, {"r": ref}])
    inner = pmetal.get(outer, timeout=WAIT)
    assert inner[0] is ref and pmetal.get(inner[1]["r"]) == 1


def test_a_put_value_holding_refs_is_fetched_with_its_refs(reap: list) -> None:
    a = Holder.remote()
    reap.append(a)
    ref = pmetal.put(5)
    outer = pmetal.put([ref])
    # The actor gets outer's value, [ref] (a ref it borrows in turn), and
    # returns it: our own ref comes back.
    [[back]] = pmetal.get(a.resolve.remote([outer]), timeout=WAIT)
    assert back is ref


def test_objects_are_freed_when_the_last_borrower_lets_go(reap: list) -> None:
    a, b = Holder.remote(), Holder.remote()
    reap.extend([a, b])
    objects = context.current().objects
    refs = [pmetal.put(i) for i in range(100)]
    pmetal.get(a.pass_on.remote(refs, b), timeout=WAIT)
    assert pmetal.get(a.ownership.remote(), timeout=WAIT)["borrowed"] == 0
    assert objects.owned.held(refs) == 100   # b still holds them
    pmetal.get(b.drop.remote(), timeout=WAIT)
    assert pmetal.get(b.ownership.remote(), timeout=WAIT)["borrowed"] == 0
    assert objects.owned.wait_released(refs, WAIT), objects.statistics()


def test_a_borrower_whose_worker_is_killed_is_forgotten_within_a_second(reap: list) -> None:
    # The driver's link to the worker dies with it (pmetal.kill here; a
    # dropped connection the same way): no lease to wait for, only a grace
    # of half a second for the worker's last messages.
    a = Holder.remote()
    reap.append(a)
    objects = context.current().objects
    refs = [pmetal.put(i) for i in range(10)]
    assert pmetal.get(a.keep.remote(refs), timeout=WAIT) == 10
    assert objects.owned.held(refs) == 10
    pmetal.kill(a)
    assert objects.owned.wait_released(refs, WAIT), objects.statistics()


def test_item_refs_of_num_returns_travel_nested(reap: list) -> None:
    a = Holder.remote()
    reap.append(a)

    @pmetal.remote(num_returns=2)
    def pair() -> tuple[str, str]:
        return "left", "right"

    left, right = pair.remote()
    assert pmetal.get(a.resolve.remote({"r": right, "l": left}), timeout=WAIT) == {
        "r": "right", "l": "left"}


def test_refs_going_back_and_forth_are_counted_and_all_freed(reap: list) -> None:
    # driver -> a -> b -> a again (a already holds them: one instance, two
    # registrations) -> driver (its own refs, the originals); then everyone
    # lets go and the driver holds nothing for anybody.
    a, b = Holder.remote(), Holder.remote()
    reap.extend([a, b])
    objects = context.current().objects
    refs = [pmetal.put(i) for i in range(20)]
    assert pmetal.get(a.keep.remote(refs), timeout=WAIT) == 20
    assert pmetal.get(a.pass_kept.remote(b), timeout=WAIT) == 20
    assert pmetal.get(b.pass_kept.remote(a), timeout=WAIT) == 20
    back = pmetal.get(b.give_kept.remote(), timeout=WAIT)
    assert all(x is y for x, y in zip(back, refs))
    assert pmetal.get(a.resolve_kept.remote(), timeout=WAIT) == list(range(20))
    del back
    pmetal.get([a.drop.remote(), b.drop.remote()], timeout=WAIT)
    tables = pmetal.get([a.ownership.remote(), b.ownership.remote()], timeout=WAIT)
    assert [t["borrowed"] for t in tables] == [0, 0]
    assert objects.owned.wait_released(refs, WAIT), objects.statistics()


def test_a_generator_yields_refs_it_made_and_they_are_counted(reap: list) -> None:
    @pmetal.remote(num_returns="streaming")
    def make_refs(n: int) -> Any:
        for i in range(n):
            yield [pmetal.put(i)]

    items = [pmetal.get(r, timeout=WAIT) for r in make_refs.remote(3)]
    assert [pmetal.get(ref, timeout=WAIT) for [ref] in items] == [0, 1, 2]


def test_a_stream_with_refs_nested_in_its_arguments(reap: list) -> None:
    @pmetal.remote(num_returns="streaming")
    def each(values: list[Any]) -> Any:
        for ref in values:
            yield pmetal.get(ref, timeout=WAIT) * 10

    objects = context.current().objects
    refs = [pmetal.put(i) for i in range(3)]
    assert [pmetal.get(r, timeout=WAIT) for r in each.remote(refs)] == [0, 10, 20]
    assert objects.owned.wait_released(refs, WAIT), objects.statistics()
