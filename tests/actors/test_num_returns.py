"""``num_returns=N`` as in Ray: a remote function or actor method call
returns N refs, one per item of the returned tuple; a return value of the
wrong shape fails every one of them; Ray's older "dynamic" generators work
on remote functions only (test_dynamic_returns.py; test_streaming.py has
"streaming")."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import pmetal
from pmetal import PMetalTypeError, PMetalValueError

from .conftest import WAIT

NUM_WORKERS = 2

pytestmark = pytest.mark.usefixtures("cluster")


@pmetal.remote(num_returns=3)
def three(x: int) -> tuple[int, int, int]:
    return x, x + 1, x + 2


@pmetal.remote
def echo(value: Any) -> Any:
    return value


@pmetal.remote
def add(a: int, b: int) -> int:
    return a + b


@pmetal.remote
class Splitter:
    @pmetal.method(num_returns=2)
    def halves(self, items: list[int]) -> tuple[list[int], list[int]]:
        middle = len(items) // 2
        return items[:middle], items[middle:]

    def pair(self, a: Any, b: Any) -> list[Any]:
        return [a, b]

    @pmetal.method(num_returns=2)
    def wrong(self) -> int:
        return 7

    @pmetal.method(num_returns=2)
    async def later(self, x: int) -> tuple[int, int]:
        await asyncio.sleep(0)
        return x, -x


def test_a_function_returns_one_ref_per_item() -> None:
    refs = three.remote(10)
    assert isinstance(refs, list) and len(refs) == 3
    assert all(isinstance(r, pmetal.ObjectRef) for r in refs)
    assert pmetal.get(refs, timeout=WAIT) == [10, 11, 12]
    assert pmetal.get(refs[1], timeout=WAIT) == 11


def test_options_num_returns_on_a_function_and_one_is_a_single_ref() -> None:
    a, b = echo.options(num_returns=2).remote(("x", [1, 2]))
    assert pmetal.get(b, timeout=WAIT) == [1, 2]
    assert pmetal.get(a, timeout=WAIT) == "x"
    one = echo.options(num_returns=1).remote((1, 2))
    assert isinstance(one, pmetal.ObjectRef)
    assert pmetal.get(one, timeout=WAIT) == (1, 2)


def test_item_refs_work_with_wait_await_and_as_arguments() -> None:
    refs = three.remote(1)
    ready, not_ready = pmetal.wait(refs, num_returns=3, timeout=WAIT)
    assert ready == refs and not_ready == []
    # An item ref as a top-level argument of another task is resolved to its item.
    assert pmetal.get(add.remote(refs[0], refs[2]), timeout=WAIT) == 4
    pending = three.remote(5)
    assert pmetal.get(add.remote(pending[1], b=pending[2]), timeout=WAIT) == 13

    async def main() -> list[int]:
        return [await r for r in three.remote(7)]
    assert asyncio.run(asyncio.wait_for(main(), WAIT)) == [7, 8, 9]


def test_a_value_of_the_wrong_shape_fails_every_ref() -> None:
    for value, got in ((5, "a int"), ((1, 2, 3), "3 items"), ([1], "1 items")):
        refs = echo.options(num_returns=2).remote(value)
        for ref in refs:
            with pytest.raises(PMetalValueError, match=rf"remote function echo.*num_returns=2.*{got}"):
                pmetal.get(ref, timeout=WAIT)
    ready, _ = pmetal.wait(refs, num_returns=2, timeout=WAIT)
    assert len(ready) == 2   # failed refs are done


def test_a_task_error_reaches_every_ref() -> None:
    @pmetal.remote(num_returns=2, max_retries=0)
    def boom() -> tuple[int, int]:
        raise KeyError("nope")
    for ref in boom.remote():
        with pytest.raises(KeyError, match="nope"):
            pmetal.get(ref, timeout=WAIT)


def test_actor_methods_with_the_decorator_and_options() -> None:
    actor = Splitter.remote()
    low, high = actor.halves.remote([1, 2, 3, 4, 5])
    assert pmetal.get(high, timeout=WAIT) == [3, 4, 5]
    assert pmetal.get(low, timeout=WAIT) == [1, 2]
    a, b = actor.pair.options(num_returns=2).remote("a", "b")
    assert pmetal.get([a, b], timeout=WAIT) == ["a", "b"]
    # options override the decorator; 1 gives the whole value in one ref
    whole = actor.halves.options(num_returns=1).remote([1, 2])
    assert pmetal.get(whole, timeout=WAIT) == ([1], [2])
    assert pmetal.get(actor.later.remote(4), timeout=WAIT) == [4, -4]
    for ref in actor.wrong.remote():
        with pytest.raises(PMetalValueError, match=r"Splitter.*wrong.*num_returns=2.*a int"):
            pmetal.get(ref, timeout=WAIT)
    pmetal.kill(actor)


def test_a_handle_found_by_name_knows_the_method_num_returns() -> None:
    actor = Splitter.options(name="num-returns-splitter").remote()
    found = pmetal.get_actor("num-returns-splitter")
    low, high = found.halves.remote([1, 2])
    assert pmetal.get([low, high], timeout=WAIT) == [[1], [2]]
    # a handle passed to a task keeps it too
    @pmetal.remote
    def via(handle: Any) -> Any:
        refs = handle.halves.remote([5, 6, 7, 8])
        return pmetal.get(refs, timeout=WAIT)
    assert pmetal.get(via.remote(actor), timeout=WAIT) == [[5, 6], [7, 8]]
    pmetal.kill(actor)


def test_dynamic_is_for_remote_functions_only() -> None:
    with pytest.raises(PMetalValueError, match="works on remote functions, not here"):
        pmetal.method(num_returns="dynamic")
    actor = Splitter.remote()
    with pytest.raises(PMetalValueError, match="use num_returns='streaming'"):
        actor.pair.options(num_returns="dynamic")
    pmetal.kill(actor)


@pytest.mark.parametrize("value, error, match", [
    (0, PMetalValueError, "at least 1"),
    (2.0, PMetalTypeError, "must be an int"),
    (True, PMetalTypeError, "must be an int"),
])
def test_bad_num_returns_is_refused_at_once(value: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        echo.options(num_returns=value)
    with pytest.raises(error, match=match):
        pmetal.method(num_returns=value)
    actor = Splitter.remote()
    with pytest.raises(error, match=match):
        actor.pair.options(num_returns=value)
    with pytest.raises(PMetalTypeError, match="unknown option"):
        actor.pair.options(num_cpus=1)
    pmetal.kill(actor)


def test_num_returns_other_than_one_on_an_actor_class_is_refused() -> None:
    with pytest.raises(PMetalValueError, match="not to creating an actor"):
        Splitter.options(num_returns=2)
