"""The naive strategy: everything through the root.

Pure: builds :class:`~pmetal.collectives.plan.Plan` values, moves nothing.
Every non-root rank talks only to the root: it sends its data there and
gets its result back from there. Two steps at most, no forwarding, so it
is the easiest plan to reason about and the reference the others are
measured against; its cost is the root's link, which carries
``world - 1`` buffers each way (the root receives ``world - 1`` buffers
in an all_reduce).

What it guarantees: the root reduces every element, receiving from the
other ranks in rank order (a fixed reduction order), and every rank ends
with the root's bytes. all_gather and reduce_scatter move only blocks
(``chunk_bounds(n, world)``): each rank sends its own block up, and gets
back the blocks it lacks (all_gather) or its own reduced block
(reduce_scatter). barrier is an all_reduce of zero elements.
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

NAME = CollectiveStrategy.NAIVE
OPS = frozenset({"all_gather", "all_reduce", "barrier", "broadcast", "reduce",
                 "reduce_scatter"})


def plan(request: PlanRequest) -> Plan:
    w, root, op = request.world, request.root, request.op
    others = [r for r in range(w) if r != root]
    sched = Schedule(w)
    if op in ("all_gather", "reduce_scatter"):
        chunks, members = split_blocks(request.n_elements, w, request.pipeline_parts)
        everything = list(range(len(chunks)))
        for r in others:
            up = members[r] if op == "all_gather" else everything
            for c in up:
                sched.transfer(0, r, root, c, reduce=op == "reduce_scatter")
        for r in others:
            down = ([c for c in everything if c not in members[r]] if op == "all_gather"
                    else members[r])
            for c in down:
                sched.transfer(1, root, r, c, reduce=False)
        results = [everything] * w if op == "all_gather" else members
        return sched.build(request, NAME, chunks, results)

    chunks = split_whole(request.n_elements, request.pipeline_parts)
    everything = list(range(len(chunks)))
    gathers = op in ("all_reduce", "reduce", "barrier")
    if gathers:
        for r in others:
            for c in everything:
                sched.transfer(0, r, root, c, reduce=True)
    if op != "reduce":
        for r in others:
            for c in everything:
                sched.transfer(1 if gathers else 0, root, r, c, reduce=False)
    results = [everything if op != "reduce" or r == root else [] for r in range(w)]
    return sched.build(request, NAME, chunks, results)
