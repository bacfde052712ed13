"""The plan vocabulary: who sends which chunk to whom, in what order.

A :class:`Plan` is what the master hands every member of a collective
operation: pure data (frozen dataclasses of ints and strings), the same on
every rank, produced by one strategy module (``ring``, ``tree``, ``naive``)
and stamped later with the master's term and membership epoch. This module
owns the vocabulary, the static check of a plan (:func:`check_plan`) and
the traffic figures the master's cost model reads; it moves no bytes.

Buffer and chunks. Every rank holds a flat buffer of ``n_elements``
elements of one dtype (the same on every rank). ``Plan.chunks`` is a table
of ``(start, end)`` element ranges; actions name a chunk by its index in
that table. What a rank's buffer means before and after depends on the
operation: all_reduce, reduce and reduce_scatter start from every rank's
whole buffer; broadcast from the root's; all_gather from each rank's own
block (``chunk_bounds(n_elements, world)[rank]``, the rest is ignored).
``Plan.results[rank]`` lists the chunks that hold the rank's result at the
end (all of them for all_reduce, broadcast and all_gather; the root's for
reduce, none elsewhere; the rank's own block for reduce_scatter).

Execution semantics. ``Plan.steps[rank]`` is the rank's program, a tuple
of :class:`Step`; a step lists its sends before its receives. A rank runs
its steps in order: it posts the step's sends (each takes a copy of the
chunk as it is at that moment; a send never waits for the receiver) and
then completes its receives, each of which waits for its message and
either overwrites the local chunk or reduces the incoming data into it
(``reduce_into(op, local, incoming)``, local on the left). Messages
between one ordered pair of ranks are matched first-in first-out: the
i-th :class:`Send` from a to b is the i-th :class:`Recv` at b from a, and
both name the same chunk. When the program ends, every rank holding a
result of a reducing operation applies ``finish`` to its result chunks
(MEAN divides there, once).

So within a step a rank sends, receives and reduces at the same time, and
the executor is free to pipeline further: it may run a rank's actions out
of program order as long as (1) two actions on the same chunk keep their
order, (2) sends to one peer keep their order and (3) receives from one
peer keep their order. Any such execution yields exactly the bytes of the
in-order one, because every chunk sees the same operations in the same
order and the FIFO matching does not change. Sub-chunks exist for this:
with ``pipeline_parts`` > 1 a rank forwards the first part of a block
while the next parts are still arriving.

Every plan is deadlock-free under in-order execution with buffered sends
(:func:`check_plan` proves it by simulation), and ``world == 1`` plans
have no actions at all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pmetal.collectives.ops import chunk_bounds
from pmetal.errors import PMetalValueError
from pmetal.values import CollectiveStrategy

__all__ = [
    "REDUCING_OPS",
    "Action",
    "Plan",
    "PlanRequest",
    "Recv",
    "Send",
    "Step",
    "Strategy",
    "check_plan",
]

# Operations whose result is a reduction (finish() applies to their results).
REDUCING_OPS = frozenset({"all_reduce", "reduce", "reduce_scatter", "barrier"})


@dataclass(frozen=True)
class Send:
    """Send a copy of chunk ``chunk`` of the local buffer to ``to_rank``."""
    to_rank: int
    chunk: int


@dataclass(frozen=True)
class Recv:
    """Receive chunk ``chunk`` from ``from_rank``; reduce it into the local
    chunk (``reduce``) or overwrite the local chunk with it."""
    from_rank: int
    chunk: int
    reduce: bool


Action = Send | Recv


@dataclass(frozen=True)
class Step:
    """One step of one rank: its sends, then its receives."""
    actions: tuple[Action, ...]


@dataclass(frozen=True)
class Plan:
    """A collective operation's schedule for every rank (see the module
    docstring for what executing it means)."""
    op_name: str
    strategy: CollectiveStrategy
    world: int
    root: int
    chunks: tuple[tuple[int, int], ...]
    steps: tuple[tuple[Step, ...], ...]
    results: tuple[tuple[int, ...], ...]
    order: tuple[int, ...] = ()
    term: int = 0
    epoch: int = 0

    @property
    def n_elements(self) -> int:
        return max((end for _, end in self.chunks), default=0)

    @property
    def max_chunk(self) -> int:
        """Elements in the largest chunk (the size of a receive's scratch)."""
        return max((end - start for start, end in self.chunks), default=0)

    @property
    def reduces(self) -> bool:
        """Whether ``finish`` applies to the results (a reducing op)."""
        return self.op_name in REDUCING_OPS

    def result_bounds(self, rank: int) -> list[tuple[int, int]]:
        """The element ranges holding ``rank``'s result, in order."""
        return [self.chunks[c] for c in self.results[rank]]

    def elements_sent(self) -> tuple[int, ...]:
        """Elements each rank sends in total (multiply by the item size for
        bytes): the figure the master's cost model compares."""
        return tuple(sum(self._size(a.chunk) for step in program for a in step.actions
                         if isinstance(a, Send)) for program in self.steps)

    def elements_received(self) -> tuple[int, ...]:
        return tuple(sum(self._size(a.chunk) for step in program for a in step.actions
                         if isinstance(a, Recv)) for program in self.steps)

    def messages(self) -> int:
        """Point-to-point messages in the whole plan (latency cost)."""
        return sum(isinstance(a, Send) for program in self.steps for step in program
                   for a in step.actions)

    def _size(self, chunk: int) -> int:
        start, end = self.chunks[chunk]
        return end - start


@dataclass(frozen=True)
class PlanRequest:
    """The validated arguments a strategy plans from (built by
    :func:`~pmetal.collectives.planner.make_plan`). ``order`` is a
    permutation of the ranks (the ring order); ``tree`` the children of
    every rank, rooted at ``root``, or empty for the strategy's default."""
    op: str
    world: int
    root: int
    n_elements: int
    order: tuple[int, ...]
    pipeline_parts: int = 1
    tree: tuple[tuple[int, ...], ...] = ()


class Strategy(Protocol):
    """What a strategy module provides (``ring``, ``tree`` and ``naive``
    are modules satisfying it)."""
    NAME: CollectiveStrategy
    OPS: frozenset[str]

    def plan(self, request: PlanRequest) -> Plan: ...


class Schedule:
    """A plan under construction, for the strategy modules: actions per
    rank and step index. Steps a rank has no action in are dropped when
    built; within a step, sends are put before receives (stable), as the
    semantics require."""

    def __init__(self, world: int) -> None:
        self._steps: list[dict[int, list[Action]]] = [{} for _ in range(world)]

    def send(self, rank: int, step: int, to_rank: int, chunk: int) -> None:
        self._steps[rank].setdefault(step, []).append(Send(to_rank, chunk))

    def recv(self, rank: int, step: int, from_rank: int, chunk: int, *, reduce: bool) -> None:
        self._steps[rank].setdefault(step, []).append(Recv(from_rank, chunk, reduce))

    def transfer(self, step: int, src: int, dst: int, chunk: int, *, reduce: bool) -> None:
        """``src`` sends ``chunk`` to ``dst`` in ``step``, received in the same step."""
        self.send(src, step, dst, chunk)
        self.recv(dst, step, src, chunk, reduce=reduce)

    def build(self, request: PlanRequest, strategy: CollectiveStrategy,
              chunks: Sequence[tuple[int, int]], results: Sequence[Sequence[int]]) -> Plan:
        programs = []
        for per_rank in self._steps:
            program = []
            for index in sorted(per_rank):
                actions = per_rank[index]
                ordered = ([a for a in actions if isinstance(a, Send)]
                           + [a for a in actions if isinstance(a, Recv)])
                program.append(Step(tuple(ordered)))
            programs.append(tuple(program))
        return Plan(op_name=request.op, strategy=strategy, world=request.world,
                    root=request.root, chunks=tuple(chunks), steps=tuple(programs),
                    results=tuple(tuple(r) for r in results), order=request.order)


def split_blocks(n_elements: int, world: int, parts: int
                 ) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """A chunk table of ``world`` blocks (``chunk_bounds(n, world)``) each
    split into up to ``parts`` sub-chunks (never more sub-chunks than
    elements, at least one), and the chunk indices of every block."""
    chunks: list[tuple[int, int]] = []
    members: list[list[int]] = []
    for start, end in chunk_bounds(n_elements, world):
        pieces = chunk_bounds(end - start, max(1, min(parts, end - start)))
        members.append(list(range(len(chunks), len(chunks) + len(pieces))))
        chunks.extend((start + a, start + b) for a, b in pieces)
    return chunks, members


def split_whole(n_elements: int, parts: int) -> list[tuple[int, int]]:
    """The whole buffer as up to ``parts`` chunks (at least one)."""
    return chunk_bounds(n_elements, max(1, min(parts, n_elements)))


def check_plan(plan: Plan) -> None:
    """Raise :class:`PMetalValueError` naming the first fault of a plan
    that cannot run: a rank or chunk index out of range, a rank sending to
    itself, a step with a receive before a send, a Send and its matching
    Recv naming different chunks, a Recv with no matching Send, a Send
    never received, or programs that deadlock. Proves deadlock freedom by
    running the programs in order (no data), so it costs one pass over the
    actions: cheap enough for a member to check every plan it is given."""
    w = plan.world
    if w < 1 or len(plan.steps) != w or len(plan.results) != w:
        raise PMetalValueError(
            f"malformed plan: world {w} but {len(plan.steps)} programs and "
            f"{len(plan.results)} result lists")
    if not 0 <= plan.root < w:
        raise PMetalValueError(f"malformed plan: root {plan.root} outside world {w}")
    n_chunks = len(plan.chunks)
    for start, end in plan.chunks:
        if not 0 <= start <= end:
            raise PMetalValueError(f"malformed plan: chunk ({start}, {end}) is not a range")
    for rank, res in enumerate(plan.results):
        for c in res:
            if not 0 <= c < n_chunks:
                raise PMetalValueError(
                    f"malformed plan: rank {rank}'s result chunk {c} is not in the "
                    f"table of {n_chunks}")
    for rank, program in enumerate(plan.steps):
        for s, step in enumerate(program):
            seen_recv = False
            for a in step.actions:
                peer = a.to_rank if isinstance(a, Send) else a.from_rank
                where = f"rank {rank} step {s}: {a}"
                if not 0 <= a.chunk < n_chunks:
                    raise PMetalValueError(
                        f"malformed plan: {where} names a chunk outside the table of {n_chunks}")
                if not 0 <= peer < w or peer == rank:
                    raise PMetalValueError(f"malformed plan: {where} names an invalid peer")
                if isinstance(a, Recv):
                    seen_recv = True
                elif seen_recv:
                    raise PMetalValueError(f"malformed plan: {where} is a send after a receive")
    _simulate(plan)


def _simulate(plan: Plan) -> None:
    """In-order execution with buffered sends, chunk indices only."""
    w = plan.world
    programs = [[a for step in program for a in step.actions] for program in plan.steps]
    pc = [0] * w
    queues: dict[tuple[int, int], deque[int]] = {}
    progressed = True
    while progressed:
        progressed = False
        for rank in range(w):
            program = programs[rank]
            while pc[rank] < len(program):
                a = program[pc[rank]]
                if isinstance(a, Send):
                    queues.setdefault((rank, a.to_rank), deque()).append(a.chunk)
                else:
                    q = queues.get((a.from_rank, rank))
                    if not q:
                        break
                    chunk = q.popleft()
                    if chunk != a.chunk:
                        raise PMetalValueError(
                            f"malformed plan: rank {rank} expects chunk {a.chunk} from "
                            f"rank {a.from_rank} but is sent chunk {chunk}")
                pc[rank] += 1
                progressed = True
    blocked = [r for r in range(w) if pc[r] < len(programs[r])]
    if blocked:
        r = blocked[0]
        a = programs[r][pc[r]]
        assert isinstance(a, Recv)
        if pc[a.from_rank] >= len(programs[a.from_rank]):
            raise PMetalValueError(
                f"malformed plan: rank {r} waits for chunk {a.chunk} from rank "
                f"{a.from_rank}, which never sends it (a Recv with no matching Send)")
        raise PMetalValueError(f"malformed plan: ranks {blocked} deadlock, each waiting "
                               "for a message another has not sent")
    for (src, dst), q in sorted(queues.items()):
        if q:
            raise PMetalValueError(
                f"malformed plan: rank {src} sends chunk {q[0]} to rank {dst}, "
                "which never receives it")
