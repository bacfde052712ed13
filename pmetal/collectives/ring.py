"""The ring strategy: bandwidth-optimal plans for large buffers.

Pure: builds :class:`~pmetal.collectives.plan.Plan` values, moves nothing.
The ranks stand in a ring in ``request.order`` (the master's choice, from
the topology's link figures); position ``p`` sends only to position
``p + 1`` and receives only from ``p - 1``, so every link of the ring
carries the same load and no rank's link is a hot spot.

What it guarantees:

- all_reduce is reduce-scatter then all-gather over ``world`` blocks
  (``chunk_bounds(n, world)``, block ``b`` belonging to rank ``b``), each
  split into ``pipeline_parts`` sub-chunks. Each rank sends
  ``2 (world - 1)`` blocks, ``2 (world - 1) / world`` of the buffer when
  ``world`` divides it: the lower bound for any all_reduce. Each block is
  reduced once, at one rank, and then copied, so every rank ends with the
  same bytes. The reduction order of a block is the ring order starting
  after its owner, fixed by the plan.
- reduce_scatter is the first half (rank ``r`` ends with block ``r``);
  all_gather the second half; reduce is reduce-scatter followed by every
  rank sending its reduced block to the root.
- broadcast is a chain from the root around the ring, pipelined: position
  ``i`` of the chain forwards sub-chunk ``j`` in step ``i + j``, so with
  ``pipeline_parts`` parts it takes ``world - 2 + parts`` steps and each
  rank sends the buffer at most once.
- barrier is an all_reduce of zero elements: ``2 (world - 1)`` empty
  messages per rank, and no rank's program ends before it has heard,
  transitively, from every other rank.
"""

from __future__ import annotations

from pmetal.collectives.plan import (
    Plan,
    PlanRequest,
    Schedule,
    split_blocks,
    split_whole,
)
from pmetal.values import CollectiveStrategy

__all__ = ["NAME", "OPS", "plan"]

NAME = CollectiveStrategy.RING
OPS = frozenset({"all_gather", "all_reduce", "barrier", "broadcast", "reduce",
                 "reduce_scatter"})


def plan(request: PlanRequest) -> Plan:
    w, order = request.world, request.order
    if request.op == "broadcast":
        return _broadcast(request)
    chunks, members = split_blocks(request.n_elements, w, request.pipeline_parts)
    sched = Schedule(w)

    def block(position: int) -> list[int]:
        """Chunks of the block owned, after reduce-scatter, by ``position``."""
        return members[order[position % w]]

    def reduce_scatter() -> None:
        # Step s: position p passes its partial sum of block (p - s - 1) on,
        # and folds in block (p - s - 2) from p - 1: after world - 1 steps,
        # position p holds block p reduced over every rank.
        for s in range(w - 1):
            for p in range(w):
                for c in block(p - s - 1):
                    sched.transfer(s, order[p], order[(p + 1) % w], c, reduce=True)

    def all_gather(first: int) -> None:
        # Step s: position p passes block (p - s) on, starting with its own.
        for s in range(w - 1):
            for p in range(w):
                for c in block(p - s):
                    sched.transfer(first + s, order[p], order[(p + 1) % w], c, reduce=False)

    everything = list(range(len(chunks)))
    if request.op in ("all_reduce", "barrier"):
        reduce_scatter()
        all_gather(w - 1)
        results = [everything] * w
    elif request.op == "reduce_scatter":
        reduce_scatter()
        results = [members[r] for r in range(w)]
    elif request.op == "all_gather":
        all_gather(0)
        results = [everything] * w
    elif request.op == "reduce":
        reduce_scatter()
        for r in range(w):
            if r != request.root:
                for c in members[r]:
                    sched.transfer(w - 1, r, request.root, c, reduce=False)
        results = [everything if r == request.root else [] for r in range(w)]
    else:  # pragma: no cover - make_plan checks the op against OPS
        raise AssertionError(request.op)
    return sched.build(request, NAME, chunks, results)


def _broadcast(request: PlanRequest) -> Plan:
    w, order = request.world, request.order
    chunks = split_whole(request.n_elements, request.pipeline_parts)
    start = order.index(request.root)
    chain = [order[(start + i) % w] for i in range(w)]
    sched = Schedule(w)
    for i in range(w - 1):
        for j in range(len(chunks)):
            sched.transfer(i + j, chain[i], chain[i + 1], j, reduce=False)
    return sched.build(request, NAME, chunks, [list(range(len(chunks)))] * w)
