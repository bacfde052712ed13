"""An in-memory executor of collective plans, for the tests only.

It runs a :class:`~pmetal.collectives.plan.Plan` over one numpy buffer per
rank exactly as the plan's semantics say: sends are buffered copies of the
chunk at the moment they are posted, receives take the oldest message from
their peer, check it names the chunk they expect, and overwrite or reduce.
It trusts nothing in the plan: a chunk or rank out of range, a receive
whose message never comes (no matching Send), a message nobody receives,
a mismatched chunk, or programs that stop with every rank waiting
(deadlock) raise :class:`PlanFault` naming the fault.

Two schedules: in order (each rank runs its program top to bottom, the
ranks taking turns until they block: the reading of the plan a simple
executor has), or ``relaxed`` with a seed: any action the pipelining rules
of the plan module allow (same chunk, sends to one peer, receives from one
peer keep their order; nothing else) may run next, picked at random. Both
must give the same bytes.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from pmetal.collectives.ops import ReduceOp, chunk_bounds, finish, reduce_into
from pmetal.collectives.plan import Action, Plan, Recv, Send


class PlanFault(AssertionError):
    """The plan cannot run as written."""


def run(plan: Plan, inputs: Sequence[np.ndarray], op: ReduceOp = ReduceOp.SUM, *,
        relaxed_seed: int | None = None,
        trace: list[tuple[int, Action]] | None = None) -> list[np.ndarray]:
    """Every rank's buffer after running ``plan`` on copies of ``inputs``,
    with ``finish`` applied to each rank's result chunks of a reducing
    operation. ``trace``, if given, receives every (rank, action) run, in
    the order run."""
    w = plan.world
    if len(inputs) != w:
        raise PlanFault(f"{len(inputs)} inputs for a world of {w}")
    buffers = [np.array(x, copy=True).reshape(-1) for x in inputs]
    n_chunks = len(plan.chunks)
    for start, end in plan.chunks:
        if not 0 <= start <= end <= (buffers[0].size if w else 0):
            raise PlanFault(f"chunk ({start}, {end}) lies outside a buffer of "
                            f"{buffers[0].size} elements")
    programs: list[list[Action]] = [[a for step in prog for a in step.actions]
                                    for prog in plan.steps]
    if len(programs) != w:
        raise PlanFault(f"{len(programs)} programs for a world of {w}")
    for rank, program in enumerate(programs):
        for a in program:
            peer = a.to_rank if isinstance(a, Send) else a.from_rank
            if not 0 <= a.chunk < n_chunks:
                raise PlanFault(f"rank {rank}: {a} names chunk {a.chunk}, outside the "
                                f"table of {n_chunks}")
            if not 0 <= peer < w or peer == rank:
                raise PlanFault(f"rank {rank}: {a} names peer {peer}")
    sends: dict[tuple[int, int], int] = {}
    recvs: dict[tuple[int, int], int] = {}
    for rank, program in enumerate(programs):
        for a in program:
            if isinstance(a, Send):
                sends[(rank, a.to_rank)] = sends.get((rank, a.to_rank), 0) + 1
            else:
                recvs[(a.from_rank, rank)] = recvs.get((a.from_rank, rank), 0) + 1
    for pair in sorted(set(sends) | set(recvs)):
        sent, received = sends.get(pair, 0), recvs.get(pair, 0)
        if received > sent:
            raise PlanFault(f"rank {pair[1]} receives {received} messages from rank "
                            f"{pair[0]}, which sends it {sent} (a Recv with no matching Send)")
        if sent > received:
            raise PlanFault(f"rank {pair[0]} sends {sent} messages to rank {pair[1]}, "
                            f"which receives {received} (a Send never received)")
    queues: dict[tuple[int, int], deque[tuple[int, np.ndarray]]] = {}

    def execute(rank: int, a: Action) -> None:
        if trace is not None:
            trace.append((rank, a))
        start, end = plan.chunks[a.chunk]
        if isinstance(a, Send):
            queues.setdefault((rank, a.to_rank), deque()).append(
                (a.chunk, buffers[rank][start:end].copy()))
            return
        chunk, data = queues[(a.from_rank, rank)].popleft()
        if chunk != a.chunk:
            raise PlanFault(f"rank {rank} expects chunk {a.chunk} from rank "
                            f"{a.from_rank} but is sent chunk {chunk}")
        if a.reduce:
            reduce_into(op, buffers[rank][start:end], data)
        else:
            buffers[rank][start:end] = data

    def can_run(rank: int, a: Action) -> bool:
        if isinstance(a, Send):
            return True
        return bool(queues.get((a.from_rank, rank)))

    if relaxed_seed is None:
        _in_order(programs, can_run, execute)
    else:
        _relaxed(programs, can_run, execute, random.Random(relaxed_seed))
    for (src, dst), q in sorted(queues.items()):
        if q:
            raise PlanFault(f"rank {src} sends chunk {q[0][0]} to rank {dst}, which "
                            "never receives it")
    if plan.reduces:
        for rank in range(w):
            for start, end in plan.result_bounds(rank):
                finish(op, buffers[rank][start:end], w)
    return buffers


def _in_order(programs: list[list[Action]], can_run: Callable[[int, Action], bool],
              execute: Callable[[int, Action], None]) -> None:
    pc = [0] * len(programs)
    progressed = True
    while progressed:
        progressed = False
        for rank, program in enumerate(programs):
            while pc[rank] < len(program) and can_run(rank, program[pc[rank]]):
                execute(rank, program[pc[rank]])
                pc[rank] += 1
                progressed = True
    _stuck(programs, [list(range(pc[r], len(p))) for r, p in enumerate(programs)])


def _conflict(a: Action, b: Action) -> bool:
    """Whether ``b`` (later in program order) must wait for ``a``."""
    if a.chunk == b.chunk:
        return True
    if isinstance(a, Send) and isinstance(b, Send):
        return a.to_rank == b.to_rank
    if isinstance(a, Recv) and isinstance(b, Recv):
        return a.from_rank == b.from_rank
    return False


def _relaxed(programs: list[list[Action]], can_run: Callable[[int, Action], bool],
             execute: Callable[[int, Action], None], rng: random.Random) -> None:
    pending = [list(range(len(p))) for p in programs]
    while True:
        enabled = []
        for rank, todo in enumerate(pending):
            for k, i in enumerate(todo):
                a = programs[rank][i]
                if all(not _conflict(programs[rank][j], a) for j in todo[:k]) \
                        and can_run(rank, a):
                    enabled.append((rank, k))
        if not enabled:
            break
        rank, k = rng.choice(enabled)
        execute(rank, programs[rank][pending[rank].pop(k)])
    _stuck(programs, pending)


def _stuck(programs: list[list[Action]], pending: list[list[int]]) -> None:
    blocked = [r for r, todo in enumerate(pending) if todo]
    if not blocked:
        return
    r = blocked[0]
    a = programs[r][pending[r][0]]
    assert isinstance(a, Recv), "a send can always run"
    if not pending[a.from_rank]:
        raise PlanFault(f"rank {r} waits for chunk {a.chunk} from rank {a.from_rank}, "
                        "which has finished without sending it (a Recv with no matching "
                        "Send)")
    raise PlanFault(f"deadlock: ranks {blocked} are each waiting for a message no rank "
                    "can send")


def results(plan: Plan, buffers: Sequence[np.ndarray]) -> list[np.ndarray | None]:
    """Each rank's result (its result chunks, concatenated), or None for a
    rank the operation gives nothing (a non-root rank of reduce)."""
    out: list[np.ndarray | None] = []
    for rank, buf in enumerate(buffers):
        bounds = plan.result_bounds(rank)
        out.append(np.concatenate([buf[a:b] for a, b in bounds]) if bounds else None)
    return out


def expected(op_name: str, op: ReduceOp, inputs: Sequence[np.ndarray],
             root: int) -> list[np.ndarray | None]:
    """What numpy says each rank should end with."""
    w = len(inputs)
    stacked = np.stack(inputs)
    dtype = stacked.dtype
    with np.errstate(over="ignore", invalid="ignore"):
        if op in (ReduceOp.SUM, ReduceOp.MEAN):
            reduced = np.sum(stacked, axis=0, dtype=dtype)
            if op is ReduceOp.MEAN and w > 1:
                reduced = (reduced // dtype.type(w) if np.issubdtype(dtype, np.integer)
                           else reduced / dtype.type(w))
        elif op is ReduceOp.PRODUCT:
            reduced = np.prod(stacked, axis=0, dtype=dtype)
        elif op is ReduceOp.MAX:
            reduced = np.max(stacked, axis=0)
        else:
            reduced = np.min(stacked, axis=0)
    blocks = chunk_bounds(stacked.shape[1], w)
    if op_name in ("all_reduce", "barrier"):
        return [reduced] * w
    if op_name == "reduce":
        return [reduced if r == root else None for r in range(w)]
    if op_name == "broadcast":
        return [inputs[root]] * w
    if op_name == "all_gather":
        gathered = np.concatenate([inputs[r][a:b] for r, (a, b) in enumerate(blocks)])
        return [gathered] * w
    if op_name == "reduce_scatter":
        return [reduced[a:b] for a, b in blocks]
    raise AssertionError(op_name)
