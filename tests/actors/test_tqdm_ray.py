"""``pmetal.experimental.tqdm_ray.tqdm`` (Ray's progress bar for tasks):
whole lines on the process's standard error, rate-limited."""

from __future__ import annotations

import io
from typing import Any

import pytest

import pmetal
from pmetal.errors import PMetalTypeError, PMetalValueError
from pmetal.experimental.tqdm_ray import tqdm

from .conftest import WAIT

NUM_WORKERS = 1


@pmetal.remote
def count(name: str) -> str:
    bar = tqdm(range(7), desc=name)
    for _ in bar:
        pass
    return bar.line()


def test_iterating_shows_the_first_and_the_last_line() -> None:
    out = io.StringIO()
    items = list(tqdm(range(5), desc="load", flush_interval_s=3600, file=out))
    assert items == [0, 1, 2, 3, 4]
    # The first update shows at once; then nothing within the hour; close shows the end.
    assert out.getvalue().splitlines() == ["load: 1/5 it [20%]", "load: 5/5 it [100%]"]


def test_update_describe_and_a_bar_without_total() -> None:
    out = io.StringIO()
    with tqdm(total=4, unit="files", flush_interval_s=0, file=out) as bar:
        bar.update(3)
        bar.set_description("copy")
    assert out.getvalue().splitlines() == ["3/4 files [75%]", "copy: 3/4 files [75%]",
                                           "copy: 3/4 files [75%]"]
    endless = tqdm(iter(int, 1), file=io.StringIO())   # no len: no total
    endless.update(2)
    assert endless.line() == "2 it"


def test_bad_arguments_are_named() -> None:
    with pytest.raises(PMetalValueError, match="total must be a non-negative int"):
        tqdm(total=-1)
    with pytest.raises(PMetalTypeError, match="flush_interval_s"):
        tqdm(range(2), flush_interval_s="1")
    with pytest.raises(PMetalTypeError, match="nothing to iterate"):
        list(tqdm(total=3))


def test_a_task_uses_it_in_its_worker(cluster: dict[str, Any]) -> None:
    assert pmetal.get(count.remote("task 1"), timeout=WAIT) == "task 1: 7/7 it [100%]"
