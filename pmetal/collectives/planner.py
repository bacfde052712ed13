"""The one entry to the strategies: :func:`make_plan`.

Pure. What it owns: the names of the operations and strategies, and the
validation of a plan's arguments, so that a strategy module plans only
from a checked :class:`~pmetal.collectives.plan.PlanRequest` (ranks in
range, ``order`` a permutation, ``tree`` a spanning tree rooted at the
root). What a caller gets: a :class:`~pmetal.collectives.plan.Plan` with
``term`` and ``epoch`` 0 (the master stamps them with
``dataclasses.replace``), or a :class:`~pmetal.errors.PMetalValueError`
that names the argument and the values it may take.

Choosing the strategy, the ring order, the tree and ``pipeline_parts``
(from the chunk size in bytes: :func:`pipeline_parts_for`) is the
master's job, not this module's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pmetal.collectives import naive, ring
from pmetal.collectives import tree as tree_strategy
from pmetal.collectives.plan import Plan, PlanRequest, Strategy
from pmetal.errors import PMetalValueError

__all__ = ["OPS", "STRATEGIES", "make_plan", "pipeline_parts_for"]

STRATEGIES: dict[str, Strategy] = {
    naive.NAME: naive, ring.NAME: ring, tree_strategy.NAME: tree_strategy}
OPS = ("all_gather", "all_reduce", "barrier", "broadcast", "reduce", "reduce_scatter")


def make_plan(op: str, strategy: str, world: int, root: int, n_elements: int, *,
              order: Sequence[int] | None = None, pipeline_parts: int = 1,
              tree: Mapping[int, Sequence[int]] | None = None) -> Plan:
    """The plan of ``op`` over ``world`` ranks of a buffer of
    ``n_elements`` elements, by ``strategy``.

    ``root`` matters for reduce and broadcast (and is the centre of the
    naive and tree plans of the other operations); pass 0 when there is
    none. ``order`` is the ring order (a permutation of ``range(world)``;
    the tree strategy roots its default binomial tree at ``root`` and
    lays the other ranks out in this order). ``pipeline_parts`` splits
    every block into that many sub-chunks so that forwarding pipelines.
    ``tree`` (tree strategy only) is a children map of ranks rooted at
    ``root``. A barrier has no data: ``n_elements`` must be 0.
    """
    for name, value in (("world", world), ("root", root), ("n_elements", n_elements),
                        ("pipeline_parts", pipeline_parts)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise PMetalValueError(f"{name} must be an int, not {value!r}")
    if op not in OPS:
        raise PMetalValueError(f"unknown collective operation {op!r}; the operations "
                               f"are {', '.join(OPS)}")
    if strategy not in STRATEGIES:
        raise PMetalValueError(f"unknown collective strategy {strategy!r}; the strategies "
                               f"are {', '.join(sorted(STRATEGIES))}")
    if world < 1:
        raise PMetalValueError(f"world must be at least 1, not {world}")
    if not 0 <= root < world:
        raise PMetalValueError(f"root {root} is not a rank of a world of {world} "
                               f"(ranks 0 to {world - 1})")
    if n_elements < 0:
        raise PMetalValueError(f"n_elements must be at least 0, not {n_elements}")
    if op == "barrier" and n_elements != 0:
        raise PMetalValueError(f"a barrier carries no data: n_elements must be 0, "
                               f"not {n_elements}")
    if pipeline_parts < 1:
        raise PMetalValueError(f"pipeline_parts must be at least 1, not {pipeline_parts}")
    ring_order = tuple(range(world)) if order is None else tuple(order)
    if sorted(ring_order) != list(range(world)):
        raise PMetalValueError(f"order {list(ring_order)} is not a permutation of the "
                               f"ranks 0 to {world - 1}")
    children: tuple[tuple[int, ...], ...] = ()
    if tree is not None:
        if strategy != tree_strategy.NAME:
            raise PMetalValueError(f"a tree applies only to the {str(tree_strategy.NAME)!r} "
                                   f"strategy, not {str(strategy)!r}")
        children = tree_strategy.validate_tree(tree, world, root)
    request = PlanRequest(op=op, world=world, root=root, n_elements=n_elements,
                          order=ring_order, pipeline_parts=pipeline_parts, tree=children)
    return STRATEGIES[strategy].plan(request)


def pipeline_parts_for(n_elements: int, itemsize: int, world: int, chunk_bytes: int) -> int:
    """Sub-chunks per block so that no message exceeds ``chunk_bytes``
    (blocks are ``n_elements / world`` elements; at least one part)."""
    if chunk_bytes < 1 or itemsize < 1 or world < 1:
        raise PMetalValueError("chunk_bytes, itemsize and world must be at least 1, not "
                               f"{chunk_bytes}, {itemsize}, {world}")
    block_bytes = -(-n_elements // world) * itemsize
    return max(1, -(-block_bytes // chunk_bytes))

