"""The executor of collective plans, SPMD-style: every rank runs
:func:`execute` concurrently (one thread each) on in-memory links, and the tests assert on
every rank. Results must equal numpy's (exactly for integers), be
bit-identical across the ranks that share a result, and equal the bytes of
the in-memory reference executor. Failures (a rank killed or stalled mid
operation, a peer sending the wrong chunk) must raise
:class:`CollectiveError` on every survivor within the deadline, after which
a group re-formed over the survivors works."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pmetal.collectives import (
    CollectiveError,
    MemoryLinks,
    MemoryNetwork,
    ReduceOp,
    execute,
    make_plan,
)
from pmetal.collectives.plan import Plan, Recv, Send
from pmetal.collectives.planner import OPS, STRATEGIES
from pmetal.errors import PeerError, PMetalError, PMetalValueError
from tests.collectives import reference

WAIT = 20.0  # bound on any one scenario: a hang fails fast
SAME_RESULT_OPS = {"all_reduce", "all_gather", "broadcast", "barrier"}


def inputs_for(world: int, n: int, dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == "int64":
        return [rng.integers(-1000, 1000, n).astype(np.int64) for _ in range(world)]
    return [rng.standard_normal(n).astype(dtype) for _ in range(world)]


def at_once(calls: Sequence[Callable[[], object]]) -> list:
    """Run every call in its own thread at once; each one's result or the
    exception it raised, in order. Bounded: a hang fails within WAIT."""
    with ThreadPoolExecutor(max(1, len(calls))) as pool:
        futures = [pool.submit(call) for call in calls]
        outcomes: list = []
        for future in futures:
            try:
                outcomes.append(future.result(timeout=WAIT))
            except Exception as exc:  # noqa: BLE001 - the outcome under test
                outcomes.append(exc)
        return outcomes


def run_all(plan: Plan, inputs: Sequence[np.ndarray], network: MemoryNetwork, *,
            op: ReduceOp, op_id: int, timeout: float = 5.0,
            ranks: Sequence[int] | None = None) -> list[np.ndarray | BaseException]:
    """Every rank of ``ranks`` (default all) runs its program at once on a
    copy of its input; each gets its buffer back or the exception raised."""
    ranks = range(plan.world) if ranks is None else ranks
    buffers = {r: inputs[r].copy() for r in ranks}
    outcomes = at_once([
        (lambda r=r: execute(plan, r, buffers[r], network.links(r), op=op, op_id=op_id,
                             timeout=timeout)) for r in ranks])
    for r, outcome in zip(ranks, outcomes):
        if isinstance(outcome, np.ndarray):
            assert outcome is buffers[r], "numpy buffers are reduced in place"
    return list(outcomes)


def check_results(plan: Plan, op: ReduceOp, inputs: list[np.ndarray],
                  outcomes: list[np.ndarray | BaseException], where: str) -> None:
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            outcome.add_note(where)
            raise outcome
    buffers = [o for o in outcomes if isinstance(o, np.ndarray)]
    # The executor moves exactly the bytes the in-memory reference does ...
    ref = reference.run(plan, inputs, op)
    for rank in range(plan.world):
        assert np.array_equal(buffers[rank], ref[rank]), f"{where}: rank {rank}"
    # ... which are numpy's answer, exact for integers ...
    got = reference.results(plan, buffers)
    want = reference.expected(plan.op_name, op, inputs, plan.root)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"{where}: rank {rank}"
        if g is None or w is None:
            continue
        if g.dtype.kind == "i":
            assert np.array_equal(g, w), f"{where}: rank {rank}"
        else:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"{where}: {rank}")
    # ... and bit-identical on every rank that shares a result.
    if plan.op_name in SAME_RESULT_OPS:
        for rank in range(1, plan.world):
            assert got[rank] is not None and got[0] is not None
            assert got[rank].tobytes() == got[0].tobytes(), f"{where}: rank {rank}"


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_every_rank_gets_numpys_answer(world: int, op_name: str, strategy: str) -> None:
    """Every root, ReduceOp, dtype and size (0, 1, fewer than the ranks,
    not divisible by them, pipelined) on every rank."""
    sizes = [0] if op_name == "barrier" else sorted({0, 1, max(0, world - 1), 3 * world + 2})
    reduce_ops = [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX]

    def scenario() -> int:
        cases, op_id = 0, 0
        for root in range(world):
            for n in sizes:
                for parts in (1, 2):
                    plan = make_plan(op_name, strategy, world, root, n, pipeline_parts=parts)
                    for dtype in ("float32", "int64"):
                        for op in reduce_ops:
                            op_id += 1
                            inputs = inputs_for(world, n, dtype, seed=op_id)
                            outcomes = run_all(plan, inputs, MemoryNetwork(world),
                                                     op=op, op_id=op_id)
                            where = (f"{op_name}/{strategy} world {world} root {root} "
                                     f"n {n} parts {parts} {dtype} {op.name}")
                            check_results(plan, op, inputs, outcomes, where)
                            cases += 1
        return cases

    assert scenario() > 0


class GroupLinks:
    """A re-formed group's view of the old world's links: new rank i is old
    rank ``members[i]`` (what a group re-formed by the master looks like)."""

    def __init__(self, links: MemoryLinks, members: Sequence[int]) -> None:
        self.links, self.members = links, list(members)

    def send(self, to_rank: int, op_id: int, chunk: int, data: np.ndarray) -> None:
        self.links.send(self.members[to_rank], op_id, chunk, data)

    def detach(self, op_id: int, chunk: int) -> None:
        self.links.detach(op_id, chunk)

    def release(self, op_id: int) -> None:
        self.links.release(op_id)

    def recv(self, from_rank: int, op_id: int, deadline: float,
             out: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        return self.links.recv(self.members[from_rank], op_id, deadline, out)

    def dead(self) -> set[int]:
        return {self.members.index(r) for r in self.links.dead() if r in self.members}


def reformed_all_reduce(network: MemoryNetwork, survivors: list[int],
                              inputs: list[np.ndarray], op_id: int) -> None:
    """The next operation, over the survivors only, succeeds on each."""
    plan = make_plan("all_reduce", "ring", len(survivors), 0, inputs[0].size)
    buffers = [inputs[old].copy() for old in survivors]
    outcomes = at_once([
        (lambda new=new, old=old: execute(plan, new, buffers[new],
                                          GroupLinks(network.links(old), survivors),
                                          op=ReduceOp.SUM, op_id=op_id, timeout=5.0))
        for new, old in enumerate(survivors)])
    want = np.sum(np.stack(buffers_in := [inputs[old] for old in survivors]), axis=0,
                  dtype=np.int64)
    assert len(buffers_in) == len(survivors)
    for got in outcomes:
        assert np.array_equal(got, want)
        assert got.tobytes() == outcomes[0].tobytes()


@pytest.mark.parametrize("victim", [0, 2, 3])
def test_a_member_killed_mid_all_reduce_fails_every_survivor_then_a_reformed_group_works(
        victim: int) -> None:
    world, timeout = 4, 0.5   # the ranks that wait on one that gave up wait this out
    inputs = inputs_for(world, 1000, "int64", seed=victim)
    plan = make_plan("all_reduce", "ring", world, 0, 1000, pipeline_parts=2)
    survivors = [r for r in range(world) if r != victim]

    def scenario() -> None:
        network = MemoryNetwork(world, detection_delay=0.05)
        network.kill(victim, after_sends=1)  # dies after its first message
        started = time.monotonic()
        # The victim runs too (its sends vanish after the first); what it
        # ends with does not matter, as a killed process reports nothing.
        outcomes = run_all(plan, inputs, network, op=ReduceOp.SUM, op_id=1,
                                 timeout=timeout)
        elapsed = time.monotonic() - started
        assert elapsed < 3 * timeout, "the survivors hung past the deadline"
        assert network.dead() == {victim}
        for rank in survivors:
            outcome = outcomes[rank]
            assert isinstance(outcome, CollectiveError), (rank, outcome)
            text = str(outcome)
            assert f"rank {victim}" in text, text  # the dead rank, waited for or known dead
            assert "all_reduce (op_id 1" in text and "at step" in text, text
            assert "re-form the group" in text, text
        reformed_all_reduce(network, survivors, inputs, op_id=2)

    scenario()


def test_the_rank_waiting_on_the_dead_one_names_it_as_lost() -> None:
    world = 3
    plan = make_plan("all_reduce", "ring", world, 0, 30)
    inputs = inputs_for(world, 30, "float32", seed=7)

    def scenario() -> list[np.ndarray | BaseException]:
        network = MemoryNetwork(world, detection_delay=0.0)
        network.kill(1)
        return run_all(plan, inputs, network, op=ReduceOp.SUM, op_id=9, timeout=0.5,
                             ranks=[0, 2])

    outcomes = scenario()
    # Ring order 0 -> 1 -> 2 -> 0: rank 2 receives from rank 1 first.
    assert isinstance(outcomes[1], CollectiveError)
    assert "lost rank 1" in str(outcomes[1]) and "rank 1 is dead" in str(outcomes[1])
    # Rank 0 waits for rank 2, which gave up: the deadline ends it, naming the dead rank.
    assert isinstance(outcomes[0], CollectiveError)
    assert "waited for rank 2 past the deadline (rank 1 known dead)" in str(outcomes[0])


def test_a_stalled_member_fails_every_survivor_at_the_deadline_then_a_reformed_group_works(
        ) -> None:
    world, timeout, staller = 3, 0.5, 1
    inputs = inputs_for(world, 300, "int64", seed=3)
    plan = make_plan("all_reduce", "tree", world, 0, 300)
    survivors = [0, 2]

    def scenario() -> None:
        network = MemoryNetwork(world)
        network.stall(staller)
        started = time.monotonic()
        outcomes = run_all(plan, inputs, network, op=ReduceOp.SUM, op_id=1,
                                 timeout=timeout, ranks=survivors)
        assert time.monotonic() - started < 3 * timeout, "the survivors hung"
        assert network.dead() == set(), "a stall is never reported dead"
        for outcome in outcomes:
            assert isinstance(outcome, CollectiveError), outcome
            assert isinstance(outcome, PMetalError)
            assert "past the deadline" in str(outcome), outcome
            assert isinstance(outcome.__cause__, TimeoutError)
        reformed_all_reduce(network, survivors, inputs, op_id=2)

    scenario()


def impostor(plan: Plan, rank: int, links: MemoryLinks, op_id: int, *,
                   chunk_shift: int = 0, dtype: str | None = None) -> None:
    """A buggy or malicious peer: follows the plan's sends but names the
    wrong chunk (``chunk_shift``) or sends the wrong dtype."""
    for step in plan.steps[rank]:
        for a in step.actions:
            if isinstance(a, Send):
                start, end = plan.chunks[a.chunk]
                data = np.zeros(end - start, dtype=dtype or "float32")
                links.send(a.to_rank, op_id, (a.chunk + chunk_shift) % len(plan.chunks),
                                 data)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_peer_sending_the_wrong_chunk_raises(strategy: str) -> None:
    plan = make_plan("all_reduce", strategy, 2, 0, 8, pipeline_parts=2)
    assert len(plan.chunks) > 1
    expected_chunk = next(a.chunk for step in plan.steps[0] for a in step.actions
                          if isinstance(a, Recv))

    def scenario() -> None:
        network = MemoryNetwork(2)
        impostor(plan, 1, network.links(1), op_id=5, chunk_shift=1)
        with pytest.raises(CollectiveError) as info:
            execute(plan, 0, np.ones(8, np.float32), network.links(0),
                          op=ReduceOp.SUM, op_id=5, timeout=5.0)
        text = str(info.value)
        assert f"expected chunk {expected_chunk} from rank 1" in text, text
        assert f"sent chunk {(expected_chunk + 1) % len(plan.chunks)}" in text, text

    scenario()


def test_a_peer_sending_another_dtype_raises() -> None:
    plan = make_plan("broadcast", "naive", 2, 1, 8)

    def scenario() -> None:
        network = MemoryNetwork(2)
        impostor(plan, 1, network.links(1), op_id=5, dtype="float64")
        with pytest.raises(CollectiveError, match="same shape and dtype"):
            execute(plan, 0, np.ones(8, np.float32), network.links(0),
                          op=ReduceOp.SUM, op_id=5, timeout=5.0)

    scenario()


def test_operations_with_different_op_ids_never_mix() -> None:
    """Two all_reduces in flight at once on one network, each its own op_id."""
    world = 3
    plan = make_plan("all_reduce", "ring", world, 0, 10)
    a, b = inputs_for(world, 10, "int64", 1), inputs_for(world, 10, "int64", 2)

    def scenario() -> None:
        network = MemoryNetwork(world)
        first, second = at_once([
            lambda: run_all(plan, a, network, op=ReduceOp.SUM, op_id=1),
            lambda: run_all(plan, b, network, op=ReduceOp.SUM, op_id=2)])
        check_results(plan, ReduceOp.SUM, a, first, "op 1")
        check_results(plan, ReduceOp.SUM, b, second, "op 2")

    scenario()


def test_a_shaped_buffer_is_reduced_in_place() -> None:
    plan = make_plan("all_reduce", "ring", 2, 0, 6)
    inputs = [np.arange(6, dtype=np.int64).reshape(2, 3) * (r + 1) for r in range(2)]

    def scenario() -> list[np.ndarray | BaseException]:
        network = MemoryNetwork(2)
        return at_once([
            (lambda r=r: execute(plan, r, inputs[r], network.links(r), op=ReduceOp.SUM,
                                 op_id=1, timeout=5.0)) for r in range(2)])

    outcomes = scenario()
    for r, out in enumerate(outcomes):
        assert out is inputs[r] and out.shape == (2, 3)
        assert np.array_equal(out, np.arange(6).reshape(2, 3) * 3)


def test_arguments_that_do_not_fit_the_plan_are_refused() -> None:
    plan = make_plan("all_reduce", "ring", 2, 0, 6)
    links = MemoryNetwork(2).links(0)

    def call(buffer: np.ndarray, rank: int = 0, timeout: float = 1.0) -> np.ndarray:
        return execute(plan, rank, buffer, links, op=ReduceOp.SUM, op_id=1,
                             timeout=timeout)

    with pytest.raises(PMetalValueError, match="has 5 elements"):
        (call(np.zeros(5)))
    with pytest.raises(PMetalValueError, match="rank 2"):
        (call(np.zeros(6), rank=2))
    with pytest.raises(PMetalValueError, match="contiguous"):
        (call(np.zeros((3, 4))[:, :2]))
    with pytest.raises(PMetalValueError, match="timeout"):
        (call(np.zeros(6), timeout=0))


class BrokenSends(MemoryLinks):
    """Links whose connection to ``broken`` is reset (what a socket link
    raises when the peer's host went away)."""

    def __init__(self, network: MemoryNetwork, rank: int, broken: int) -> None:
        super().__init__(network, rank)
        self.broken = broken

    def send(self, to_rank: int, op_id: int, chunk: int, data: np.ndarray) -> None:
        if to_rank == self.broken:
            raise PeerError(f"connection to rank {to_rank} reset")
        super().send(to_rank, op_id, chunk, data)


def test_a_send_that_fails_raises_naming_the_step() -> None:
    plan = make_plan("broadcast", "naive", 3, 0, 6)
    first = plan.steps[0][0].actions
    assert sum(isinstance(a, Send) for a in first) == 2, "both sends in one step"

    def scenario() -> None:
        network = MemoryNetwork(3)
        with pytest.raises(CollectiveError, match="connection to rank 2 reset") as info:
            execute(plan, 0, np.ones(6), BrokenSends(network, 0, broken=2),
                          op=ReduceOp.SUM, op_id=1, timeout=5.0)
        assert "at step 0" in str(info.value) and "re-form the group" in str(info.value)
        assert isinstance(info.value.__cause__, PeerError)

    scenario()
