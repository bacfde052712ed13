"""Ray's older generator tasks: ``num_returns="dynamic"`` (a ref to a
DynamicObjectRefGenerator) and ``num_returns=N`` on a generator function
(N refs, one per item), on real workers of one embedded node."""

from __future__ import annotations

from typing import Any

import pytest

import pmetal
from pmetal import DynamicObjectRefGenerator, RemoteError
from pmetal.errors import PMetalTypeError, PMetalValueError

from .conftest import WAIT

NUM_WORKERS = 2


class Boom(Exception):
    pass


@pmetal.remote(num_returns="dynamic")
def split(items: list[int], size: int) -> Any:
    while items:
        yield items[:size]
        items = items[size:]


@pmetal.remote
def two_then_boom() -> Any:
    yield 0
    yield 1
    raise Boom("after two")


@pmetal.remote
def total(refs: DynamicObjectRefGenerator) -> int:
    return sum(len(pmetal.get(ref)) for ref in refs)


@pmetal.remote
def plain() -> int:
    return 1


def test_dynamic_gives_a_ref_to_the_refs_of_the_items(cluster: dict[str, Any]) -> None:
    ref = split.remote(list(range(10)), 3)
    refs = pmetal.get(ref, timeout=WAIT)
    assert isinstance(refs, DynamicObjectRefGenerator) and len(refs) == 4
    assert pmetal.get(list(refs), timeout=WAIT) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    # to another task: as the ref (resolved there) or as the generator itself
    assert pmetal.get(total.remote(ref), timeout=WAIT) == 10
    assert pmetal.get(total.remote(refs), timeout=WAIT) == 10
    assert len(pmetal.get(split.remote([], 3), timeout=WAIT)) == 0


def test_dynamic_keeps_the_error_in_the_last_ref(cluster: dict[str, Any]) -> None:
    first, second, last = pmetal.get(two_then_boom.options(num_returns="dynamic").remote(),
                                     timeout=WAIT)
    assert pmetal.get([first, second], timeout=WAIT) == [0, 1]
    with pytest.raises(Boom, match="after two") as info:
        pmetal.get(last, timeout=WAIT)
    assert isinstance(info.value, RemoteError)


def test_n_returns_on_a_generator_function_is_one_ref_per_item(cluster: dict[str, Any]) -> None:
    refs = two_then_boom.options(num_returns=4).remote()
    assert pmetal.get(refs[:2], timeout=WAIT) == [0, 1]
    for ref in refs[2:]:   # the items that did not come carry the error
        with pytest.raises(Boom, match="after two"):
            pmetal.get(ref, timeout=WAIT)
    # read up to N and closed: the error after them never happens (as in Ray)
    assert pmetal.get(two_then_boom.options(num_returns=2).remote(), timeout=WAIT) == [0, 1]
    short = split.options(num_returns=3).remote([1, 2], 1)
    assert pmetal.get(short[:2], timeout=WAIT) == [[1], [2]]
    with pytest.raises(PMetalValueError, match="num_returns=3 but yielded 2 items"):
        pmetal.get(short[2], timeout=WAIT)


def test_dynamic_on_what_is_not_a_generator_is_refused(cluster: dict[str, Any]) -> None:
    with pytest.raises(PMetalTypeError, match="applies to a generator function"):
        plain.options(num_returns="dynamic").remote()
