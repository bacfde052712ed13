"""Every strategy's plans, run by the reference executor, against numpy.

Tables over world sizes 1 to 8, every root, every operation and strategy,
every reduce operator and dtype, and sizes 0, 1, smaller than the world,
not divisible by it and larger: every rank's result equals numpy's
reduction (exactly for integers, and for floats whose sums are exact;
within float tolerance for random floats), and all ranks that get a
result get the same bytes. Loops run inside the tests, not as separate
test cases, to keep the whole table within a few seconds.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pmetal.cluster.topology import ClusterTopology, NodeProfile
from pmetal.collectives.ops import ReduceOp
from pmetal.collectives.plan import Plan, Send, check_plan
from pmetal.collectives.planner import OPS, STRATEGIES, make_plan
from pmetal.collectives.tree import tree_by_rank
from tests.collectives.reference import expected, results, run

DTYPES = (np.float16, np.float32, np.float64, np.int32, np.int64)
WORLDS = range(1, 9)


def sizes(op: str, world: int) -> list[int]:
    """0, 1, smaller than the world, not divisible by it, and larger."""
    if op == "barrier":
        return [0]
    return sorted({0, 1, max(world - 1, 0), world + 1, 3 * world, 5 * world + 3, 61})


def small_ints(rng: np.random.Generator, world: int, n: int, dtype: type) -> list[np.ndarray]:
    """Values whose sums and products are exact in every dtype here (even
    float16 over 8 ranks), so float results can be compared exactly."""
    return [rng.choice(np.array([-2, -1, 1, 2]), n).astype(dtype) for _ in range(world)]


def assert_plan_result(plan: Plan, op: ReduceOp, inputs: list[np.ndarray],
                       exact: bool = True, context: str = "") -> list[np.ndarray | None]:
    out = results(plan, run(plan, inputs, op))
    want = expected(plan.op_name, op, inputs, plan.root)
    for rank, (got, exp) in enumerate(zip(out, want)):
        where = f"{context} rank {rank}"
        assert (got is None) == (exp is None), where
        if exp is None:
            continue
        assert got is not None and got.dtype == exp.dtype, where
        if exact:
            np.testing.assert_array_equal(got, exp, err_msg=where)
        else:
            tol = {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 1e-5}.get(
                got.dtype, 1e-12)
            np.testing.assert_allclose(got, exp, rtol=tol, atol=tol * 10, err_msg=where)
    if plan.op_name != "reduce_scatter":
        given = [o for o in out if o is not None]
        assert all(o.tobytes() == given[0].tobytes() for o in given), \
            f"{context}: ranks differ"
    return out


@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_world_size_root_and_size(strategy: str, op_name: str) -> None:
    rng = np.random.default_rng(1)
    for world in WORLDS:
        for root in range(world):
            for n in sizes(op_name, world):
                for parts in (1, 3):
                    plan = make_plan(op_name, strategy, world, root, n, pipeline_parts=parts)
                    check_plan(plan)
                    inputs = [rng.integers(-1000, 1000, n).astype(np.int64)
                              for _ in range(world)]
                    assert_plan_result(plan, ReduceOp.SUM, inputs,
                                       context=f"w={world} root={root} n={n} parts={parts}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_dtype_and_reduce_op(strategy: str, dtype: type) -> None:
    rng = np.random.default_rng(2)
    for op in ReduceOp:
        for op_name in OPS:
            for world, root in ((1, 0), (2, 1), (3, 2), (5, 0), (8, 5)):
                for n in sizes(op_name, world)[::2]:
                    plan = make_plan(op_name, strategy, world, root, n, pipeline_parts=2)
                    assert_plan_result(plan, op, small_ints(rng, world, n, dtype),
                                       context=f"{op} {op_name} w={world} n={n}")


@pytest.mark.parametrize("dtype", (np.float16, np.float32, np.float64),
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_random_floats_agree_with_numpy_up_to_associativity(strategy: str,
                                                            dtype: type) -> None:
    rng = np.random.default_rng(3)
    for op in (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.PRODUCT):
        for op_name in ("all_reduce", "reduce", "reduce_scatter"):
            for world in (2, 3, 5, 7):
                n = 1000 + world
                inputs = [rng.uniform(0.5, 1.5, n).astype(dtype) for _ in range(world)]
                plan = make_plan(op_name, strategy, world, world - 1, n, pipeline_parts=4)
                assert_plan_result(plan, op, inputs, exact=False,
                                   context=f"{op} {op_name} w={world}")


@pytest.mark.parametrize("dtype", (np.int32, np.int64), ids=lambda d: np.dtype(d).name)
def test_integer_overflow_wraps_exactly_like_numpy(dtype: type) -> None:
    big = np.iinfo(dtype).max
    inputs = [np.array([big, big // 2 + 7, -big], dtype=dtype) for _ in range(5)]
    for strategy in STRATEGIES:
        for op in ReduceOp:
            plan = make_plan("all_reduce", strategy, 5, 2, 3)
            out = assert_plan_result(plan, op, inputs, context=f"{strategy} {op}")
            if op is ReduceOp.SUM:
                assert out[0] is not None
                assert out[0][0] == np.array([big] * 5, dtype=dtype).sum(dtype=dtype)


def test_integer_mean_is_floor_division_on_every_rank() -> None:
    inputs = [np.array([r, -r, 1], dtype=np.int32) for r in range(4)]   # sums 6, -6, 4
    plan = make_plan("all_reduce", "ring", 4, 0, 3)
    out = results(plan, run(plan, inputs, ReduceOp.MEAN))
    for got in out:
        assert got is not None and got.tolist() == [1, -2, 1]


@pytest.mark.parametrize("strategy", ("ring", "tree"))
def test_any_ring_order_gives_the_same_results(strategy: str) -> None:
    rng = np.random.default_rng(4)
    for world in (3, 4, 6, 8):
        for trial in range(4):
            order = [int(r) for r in rng.permutation(world)]
            root = int(rng.integers(world))
            for op_name in OPS:
                n = 0 if op_name == "barrier" else 4 * world + 1
                plan = make_plan(op_name, strategy, world, root, n, order=order,
                                 pipeline_parts=2)
                assert plan.order == tuple(order)
                check_plan(plan)
                inputs = [rng.integers(-50, 50, n).astype(np.int64) for _ in range(world)]
                assert_plan_result(plan, ReduceOp.SUM, inputs,
                                   context=f"order={order} root={root} {op_name}")


def test_ring_plans_follow_the_given_order() -> None:
    order = [2, 0, 3, 1]
    plan = make_plan("all_reduce", "ring", 4, 0, 8, order=order)
    successor = {order[i]: order[(i + 1) % 4] for i in range(4)}
    for rank, program in enumerate(plan.steps):
        for step in program:
            for a in step.actions:
                if isinstance(a, Send):
                    assert a.to_rank == successor[rank]
                else:
                    assert a.from_rank == order[order.index(rank) - 1]


def chain(world: int, root: int) -> dict[int, list[int]]:
    ranks = [root] + [r for r in range(world) if r != root]
    return {a: [b] for a, b in itertools.pairwise(ranks)}


def star(world: int, root: int) -> dict[int, list[int]]:
    return {root: [r for r in range(world) if r != root]}


def assert_only_tree_edges(plan: Plan, tree: dict[int, list[int]]) -> None:
    edges = {(p, c) for p, kids in tree.items() for c in kids}
    for rank, program in enumerate(plan.steps):
        for step in program:
            for a in step.actions:
                peer = a.to_rank if isinstance(a, Send) else a.from_rank
                assert (rank, peer) in edges or (peer, rank) in edges, (rank, a)


@pytest.mark.parametrize("shape", (chain, star), ids=("chain", "star"))
def test_tree_strategy_follows_any_given_tree(shape) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(5)
    for world in (1, 2, 5, 8):
        for root in range(world):
            for op_name in OPS:
                n = 0 if op_name == "barrier" else 2 * world + 1
                tree = shape(world, root)
                plan = make_plan(op_name, "tree", world, root, n, tree=tree, pipeline_parts=2)
                check_plan(plan)
                assert_only_tree_edges(plan, tree)
                inputs = [rng.integers(-50, 50, n).astype(np.int64) for _ in range(world)]
                assert_plan_result(plan, ReduceOp.SUM, inputs,
                                   context=f"{shape.__name__} w={world} root={root} {op_name}")


def test_tree_from_the_topology_by_node_id() -> None:
    topology = ClusterTopology()
    ids = ["n-a", "n-b", "n-c", "n-d", "n-e"]
    for node in ids:
        topology.add_node(NodeProfile(node))
    topology.update_link("n-a", "n-e", latency=0.0001, bandwidth=1e9, now=0.0)
    rank_of = {node: r for r, node in enumerate(ids)}
    tree = tree_by_rank(topology.best_tree("n-c"), rank_of)
    assert tree[0] == [4] or tree[4] == [0]      # the one fast link is a tree edge
    plan = make_plan("all_reduce", "tree", 5, 2, 11, tree=tree)
    assert_only_tree_edges(plan, tree)
    inputs = [np.arange(11, dtype=np.int64) * (r + 1) for r in range(5)]
    assert_plan_result(plan, ReduceOp.SUM, inputs)
