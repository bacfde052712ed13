"""Ray's DAG API (``pmetal.dag``, Ray's ``ray.dag``): ``.bind()`` builds
calls, ``.execute()`` runs them, on real workers of one embedded node."""

from __future__ import annotations

from typing import Any

import pytest

import pmetal
from pmetal.dag import ClassNode, FunctionNode
from pmetal.dag.input_node import InputNode
from pmetal.dag.output_node import MultiOutputNode
from pmetal.errors import PMetalTypeError, PMetalValueError

from .conftest import WAIT

NUM_WORKERS = 2


@pmetal.remote
def add(x: int, inc: int = 1) -> int:
    return x + inc


@pmetal.remote
class Tally:
    def __init__(self, start: int) -> None:
        self.total = start

    def inc(self, x: int) -> int:
        self.total += x
        return self.total

    def get(self) -> int:
        return self.total


def test_function_nodes_pass_their_results_on(cluster: dict[str, Any]) -> None:
    a = add.bind(1, inc=2)
    assert isinstance(a, FunctionNode)
    b = add.bind(a, inc=3)
    c = add.bind(b, inc=a)   # a node in a keyword: its result, computed once
    assert pmetal.get(c.execute(), timeout=WAIT) == 9
    assert pmetal.get([a.execute(), b.execute()], timeout=WAIT) == [3, 6]


def test_a_class_node_makes_a_new_actor_per_execute_and_runs_its_calls_in_bind_order(
        cluster: dict[str, Any]) -> None:
    actor = Tally.bind(10)
    assert isinstance(actor, ClassNode)
    first = actor.get.bind()
    assert pmetal.get(first.execute(), timeout=WAIT) == 10
    actor.inc.bind(2)   # named by no node of the DAG below, and still run before get
    actor.inc.bind(4)
    total = add.bind(actor.get.bind(), inc=Tally.bind(1).get.bind())
    assert pmetal.get(total.execute(), timeout=WAIT) == 17   # (10 + 2 + 4) + 1
    assert pmetal.get(total.execute(), timeout=WAIT) == 17   # new actors again
    handle = actor.execute()
    assert pmetal.get(handle.get.remote(), timeout=WAIT) == 10
    pmetal.kill(handle)


def test_the_input_node_stands_for_what_execute_gets(cluster: dict[str, Any]) -> None:
    with InputNode() as inp:
        dag = add.bind(add.bind(inp), inc=inp)
    assert pmetal.get(dag.execute(2), timeout=WAIT) == 5
    assert pmetal.get(dag.execute(3), timeout=WAIT) == 7
    with InputNode() as inp:
        both = MultiOutputNode([add.bind(inp["x"]), add.bind(inp.y)])
    assert pmetal.get(both.execute(_Both(x=1, y=5)), timeout=WAIT) == [2, 6]
    with InputNode() as inp:   # several arguments: by position and by keyword
        many = MultiOutputNode([add.bind(inp[0]), add.bind(inp[1], inc=inp.step)])
    assert pmetal.get(many.execute(10, 20, step=5), timeout=WAIT) == [11, 25]


class _Both(dict):
    """An input with items and attributes."""

    def __getattr__(self, name: str) -> Any:
        return self[name]


def test_methods_bound_on_a_live_handle_reuse_that_actor(cluster: dict[str, Any],
                                                         reap: list[Any]) -> None:
    tally = Tally.remote(0)
    reap.append(tally)
    with InputNode() as inp:
        dag = MultiOutputNode([tally.inc.bind(inp)])
    assert [pmetal.get(dag.execute(n), timeout=WAIT) for n in (1, 2, 3)] == [[1], [3], [6]]
    assert pmetal.get(tally.get.remote(), timeout=WAIT) == 6


def test_misuse_is_a_clear_error(cluster: dict[str, Any]) -> None:
    with pytest.raises(PMetalTypeError, match="list of DAG nodes"):
        MultiOutputNode([1, 2])
    with pytest.raises(AttributeError, match="Tally has no method 'nope'"):
        Tally.bind(1).nope.bind()
    with InputNode() as inp:
        dag = add.bind(inp)
        item = add.bind(inp["missing"])
    with pytest.raises(PMetalValueError, match=r"give execute\(\) its input"):
        dag.execute()
    with pytest.raises(PMetalValueError, match="the DAG's input has no 'missing'"):
        item.execute({"x": 1})
