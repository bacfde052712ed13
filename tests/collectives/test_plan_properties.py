"""Properties of the plans themselves, read from the plan without running
it (every Send has its Recv, the ring's bandwidth, the tree's rounds, the
naive root's load), that any schedule the pipelining rules allow gives the
in-order bytes, that malformed plans are caught by both the static check
and the reference executor, and that make_plan refuses bad arguments by
name."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pmetal.collectives.ops import ReduceOp
from pmetal.collectives.plan import Plan, Recv, Send, Step, check_plan
from pmetal.collectives.planner import OPS, STRATEGIES, make_plan, pipeline_parts_for
from pmetal.errors import PMetalValueError
from tests.collectives.reference import PlanFault, run

FAST = settings(max_examples=200, deadline=None)


@st.composite
def plan_args(draw: st.DrawFn, max_world: int = 8) -> tuple[str, str, int, int, int, int]:
    op = draw(st.sampled_from(OPS))
    strategy = draw(st.sampled_from(sorted(STRATEGIES)))
    world = draw(st.integers(1, max_world))
    root = draw(st.integers(0, world - 1))
    n = 0 if op == "barrier" else draw(st.integers(0, 40))
    parts = draw(st.integers(1, 4))
    return op, strategy, world, root, n, parts


def messages(plan: Plan) -> tuple[dict, dict]:
    """Per ordered pair, the chunks sent and the chunks received, in order."""
    sent, received = defaultdict(list), defaultdict(list)
    for rank, program in enumerate(plan.steps):
        for step in program:
            for a in step.actions:
                if isinstance(a, Send):
                    sent[(rank, a.to_rank)].append(a.chunk)
                else:
                    received[(a.from_rank, rank)].append(a.chunk)
    return sent, received


@FAST
@given(plan_args())
def test_every_send_has_exactly_one_matching_recv(args: tuple) -> None:
    op, strategy, world, root, n, parts = args
    plan = make_plan(op, strategy, world, root, n, pipeline_parts=parts)
    sent, received = messages(plan)
    assert sent == received
    check_plan(plan)
    for program in plan.steps:
        for step in program:
            kinds = [isinstance(a, Recv) for a in step.actions]
            assert kinds == sorted(kinds), "a step lists its sends before its receives"
    if world == 1:
        assert plan.steps == ((),)


@FAST
@given(plan_args(max_world=5), st.integers(0, 2**32 - 1))
def test_any_schedule_the_pipelining_rules_allow_gives_the_same_bytes(args: tuple,
                                                                      seed: int) -> None:
    op, strategy, world, root, n, parts = args
    plan = make_plan(op, strategy, world, root, n, pipeline_parts=parts)
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    in_order = run(plan, inputs, ReduceOp.SUM)
    relaxed = run(plan, inputs, ReduceOp.SUM, relaxed_seed=seed)
    assert [b.tobytes() for b in in_order] == [b.tobytes() for b in relaxed]


def test_the_relaxed_schedule_really_runs_actions_out_of_program_order() -> None:
    plan = make_plan("all_reduce", "ring", 4, 0, 40, pipeline_parts=3)
    inputs = [np.full(40, r, dtype=np.int64) for r in range(4)]
    in_order: list = []
    run(plan, inputs, trace=in_order)
    programs = [[a for step in prog for a in step.actions] for prog in plan.steps]
    assert [[a for r, a in in_order if r == rank] for rank in range(4)] == programs
    reordered = 0
    for seed in range(5):
        relaxed: list = []
        run(plan, inputs, relaxed_seed=seed, trace=relaxed)
        assert sorted(map(repr, relaxed)) == sorted(map(repr, in_order))
        reordered += any([a for r, a in relaxed if r == rank] != programs[rank]
                         for rank in range(4))
    assert reordered >= 4


@FAST
@given(st.integers(1, 8), st.integers(0, 12), st.integers(1, 4), st.integers(0, 5))
def test_ring_all_reduce_sends_the_bandwidth_optimal_share(world: int, per_rank: int,
                                                           parts: int, extra: int) -> None:
    n = world * per_rank
    plan = make_plan("all_reduce", "ring", world, 0, n, pipeline_parts=parts)
    assert plan.elements_sent() == (2 * (world - 1) * n // world,) * world
    assert plan.elements_received() == plan.elements_sent()
    # Not divisible: each rank sends 2 (world - 1) blocks of floor or ceil(n / world).
    m = n + extra
    uneven = make_plan("all_reduce", "ring", world, 0, m, pipeline_parts=parts)
    for sent in uneven.elements_sent():
        assert 2 * (world - 1) * (m // world) <= sent <= 2 * (world - 1) * -(-m // world)


def broadcast_rounds(plan: Plan) -> int:
    """Rounds a broadcast takes when each rank sends one message per round
    and forwards as soon as it has the data (one chunk: pipeline_parts=1)."""
    got = {plan.root: 0}
    frontier = [plan.root]
    while frontier:
        rank = frontier.pop()
        sends = [a for step in plan.steps[rank] for a in step.actions if isinstance(a, Send)]
        for i, a in enumerate(sends):
            got[a.to_rank] = got[rank] + i + 1
            frontier.append(a.to_rank)
    assert len(got) == plan.world
    return max(got.values())


@pytest.mark.parametrize("world", range(1, 9))
def test_binomial_tree_reaches_everyone_in_ceil_log2_rounds(world: int) -> None:
    from pmetal.collectives.tree import binomial_tree, tree_depth
    for root in range(world):
        plan = make_plan("broadcast", "tree", world, root, 10)
        assert broadcast_rounds(plan) == math.ceil(math.log2(world))
        children = binomial_tree([root] + [r for r in range(world) if r != root])
        depth = tree_depth([children[r] for r in range(world)], root)
        assert depth <= math.ceil(math.log2(world))
        # The ring's chain takes world - 1 rounds: the reason the tree exists.
        assert broadcast_rounds(make_plan("broadcast", "ring", world, root, 10)) == world - 1


@pytest.mark.parametrize("op", ("all_reduce", "reduce"))
def test_naive_root_receives_world_minus_one_buffers(op: str) -> None:
    for world in range(1, 9):
        for root in range(world):
            plan = make_plan(op, "naive", world, root, 37, pipeline_parts=2)
            received = plan.elements_received()
            assert received[root] == (world - 1) * 37
            senders = Counter(a.from_rank for step in plan.steps[root] for a in step.actions
                              if isinstance(a, Recv))
            assert set(senders) == set(range(world)) - {root}
            for rank in set(range(world)) - {root}:
                assert plan.elements_sent()[rank] == 37


def heard_from(plan: Plan) -> list[set[int]]:
    """The ranks each rank has heard from, directly or through others, when
    its program ends (in-order execution; a message carries what its sender
    has heard so far)."""
    programs = [[a for step in prog for a in step.actions] for prog in plan.steps]
    heard = [{r} for r in range(plan.world)]
    queues: dict[tuple[int, int], list[set[int]]] = defaultdict(list)
    pc = [0] * plan.world
    while any(pc[r] < len(programs[r]) for r in range(plan.world)):
        progressed = False
        for r in range(plan.world):
            while pc[r] < len(programs[r]):
                a = programs[r][pc[r]]
                if isinstance(a, Send):
                    queues[(r, a.to_rank)].append(set(heard[r]))
                elif queues[(a.from_rank, r)]:
                    heard[r] |= queues[(a.from_rank, r)].pop(0)
                else:
                    break
                pc[r] += 1
                progressed = True
        assert progressed
    return heard


def test_barrier_plans_carry_no_data_but_every_rank_hears_from_every_rank() -> None:
    for strategy in STRATEGIES:
        for world in range(1, 9):
            plan = make_plan("barrier", strategy, world, world // 2, 0)
            assert plan.n_elements == 0 and sum(plan.elements_sent()) == 0
            # Nobody's program ends before every rank has arrived.
            assert heard_from(plan) == [set(range(world))] * world


def test_term_and_epoch_are_stamped_later() -> None:
    plan = make_plan("all_reduce", "ring", 3, 0, 9)
    assert (plan.term, plan.epoch, plan.order) == (0, 0, (0, 1, 2))
    stamped = dataclasses.replace(plan, term=7, epoch=3)
    assert stamped.steps == plan.steps and (stamped.term, stamped.epoch) == (7, 3)
    assert hash(stamped) != hash(plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.term = 1  # type: ignore[misc]


def test_pipeline_parts_from_chunk_bytes() -> None:
    assert pipeline_parts_for(1 << 20, 4, 4, 256 << 10) == 4
    assert pipeline_parts_for(0, 4, 4, 1024) == 1
    assert pipeline_parts_for(10, 8, 3, 1 << 20) == 1
    with pytest.raises(PMetalValueError, match="chunk_bytes"):
        pipeline_parts_for(10, 4, 2, 0)


# --------------------------------------------------------------- malformed plans

def two_ranks(prog0: tuple[Step, ...], prog1: tuple[Step, ...], n_chunks: int = 1) -> Plan:
    return Plan("all_reduce", "hand", 2, 0, tuple((i, i + 1) for i in range(n_chunks)),
                (prog0, prog1), ((), ()))


def steps(*actions: Send | Recv) -> tuple[Step, ...]:
    return (Step(tuple(actions)),) if actions else ()


MALFORMED = {
    "recv without send": (two_ranks(steps(), steps(Recv(0, 0, True))),
                          "no matching Send"),
    "send never received": (two_ranks(steps(Send(1, 0)), steps()), "never receive"),
    "deadlock": (two_ranks((Step((Recv(1, 0, True),)), Step((Send(1, 0),))),
                           (Step((Recv(0, 0, True),)), Step((Send(0, 0),))),),
                 "deadlock"),
    "chunk out of range": (two_ranks(steps(Send(1, 3)), steps(Recv(0, 3, False))),
                           "chunk"),
    "chunk mismatch": (two_ranks(steps(Send(1, 0)), steps(Recv(0, 1, False)), n_chunks=2),
                       "expects chunk 1"),
    "peer out of range": (two_ranks(steps(Send(5, 0)), steps()), "peer"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_plans_are_caught_by_the_executor_and_the_check(name: str) -> None:
    plan, message = MALFORMED[name]
    with pytest.raises(PlanFault, match=message):
        run(plan, [np.zeros(4), np.zeros(4)])
    with pytest.raises(PMetalValueError, match="malformed plan"):
        check_plan(plan)


def test_check_plan_refuses_a_receive_before_a_send_in_one_step() -> None:
    plan = two_ranks((Step((Recv(1, 0, True), Send(1, 0))),),
                     (Step((Send(0, 0), Recv(0, 0, True))),))
    with pytest.raises(PMetalValueError, match="send after a receive"):
        check_plan(plan)


# ------------------------------------------------------------ argument checks

@pytest.mark.parametrize("kwargs, message", [
    ({"world": 0}, "world must be at least 1"),
    ({"root": 3}, "root 3 is not a rank of a world of 3"),
    ({"root": -1}, "root -1"),
    ({"op": "allreduce"}, "unknown collective operation 'allreduce'.*all_reduce"),
    ({"strategy": "butterfly"}, "unknown collective strategy 'butterfly'.*naive, ring, tree"),
    ({"n_elements": -1}, "n_elements must be at least 0"),
    ({"op": "barrier", "n_elements": 4}, "barrier carries no data"),
    ({"pipeline_parts": 0}, "pipeline_parts must be at least 1"),
    ({"order": [0, 1, 1]}, "not a permutation"),
    ({"order": [0, 1]}, "not a permutation"),
    ({"world": 2.0}, "world must be an int"),
    ({"tree": {0: [1, 2]}, "strategy": "ring"}, "only to the 'tree' strategy"),
    ({"tree": {0: [1]}, "strategy": "tree"}, r"ranks \[2\] are not reachable"),
    ({"tree": {0: [1, 2], 1: [2]}, "strategy": "tree"}, "two parents"),
    ({"tree": {0: [1, 2], 2: [0]}, "strategy": "tree"}, "two parents"),
    ({"tree": {0: [1, 5]}, "strategy": "tree"}, "outside range"),
])
def test_make_plan_refuses_bad_arguments_by_name(kwargs: dict, message: str) -> None:
    args = {"op": "all_reduce", "strategy": "ring", "world": 3, "root": 0, "n_elements": 6}
    args.update(kwargs)
    with pytest.raises(PMetalValueError, match=message):
        make_plan(args.pop("op"), args.pop("strategy"), args.pop("world"), args.pop("root"),
                  args.pop("n_elements"), **args)
