"""The tree strategy: latency-optimal plans for small buffers.

Pure: builds :class:`~pmetal.collectives.plan.Plan` values, moves nothing.
The tree is a children map rooted at ``request.root``: the master's
(:meth:`ClusterTopology.best_tree`, translated to ranks by
:func:`tree_by_rank`) or, by default, the binomial tree over the ranks in
``request.order`` rotated to start at the root (:func:`binomial_tree`).
Each parent sends to its children in list order.

What it guarantees:

- A binomial tree reaches every rank in ceil(log2(world)) rounds when a
  rank sends one message per round (the fewest any broadcast can take),
  against ``world - 1`` for the ring's chain; for small buffers, where
  latency is the cost, that wins.
- broadcast sends the buffer down the tree; reduce folds it up (each
  parent reduces its children's partial results into its own, in the
  plan's order, then passes it on); all_reduce is reduce then broadcast
  over the same tree, so the root reduces every element exactly once and
  every rank ends with the root's bytes. Sub-chunks (``pipeline_parts``)
  pipeline both directions: a rank at depth ``d`` forwards sub-chunk ``j``
  in step ``d + j``.
- all_gather gathers every rank's block up to the root (a parent
  forwards its subtree's blocks) and sends each child only the blocks
  outside its subtree; reduce_scatter reduces to the root and sends each
  child only its subtree's blocks. barrier is an all_reduce of zero
  elements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pmetal.collectives.plan import (
    Plan,
    PlanRequest,
    Schedule,
    split_blocks,
    split_whole,
)
from pmetal.errors import PMetalValueError
from pmetal.values import CollectiveStrategy

__all__ = ["NAME", "OPS", "binomial_tree", "plan", "tree_by_rank", "tree_depth"]

NAME = CollectiveStrategy.TREE
OPS = frozenset({"all_gather", "all_reduce", "barrier", "broadcast", "reduce",
                 "reduce_scatter"})


def binomial_tree(ranks: Sequence[int]) -> dict[int, list[int]]:
    """The binomial tree over ``ranks``, rooted at ``ranks[0]``: in round
    ``k`` every holder at virtual rank ``v < 2**k`` sends to ``v + 2**k``.
    Children are listed in the order they are sent to."""
    n = len(ranks)
    children: dict[int, list[int]] = {r: [] for r in ranks}
    k = 1
    while k < n:
        for v in range(k):
            if v + k < n:
                children[ranks[v]].append(ranks[v + k])
        k *= 2
    return children


def tree_by_rank(children: Mapping[str, Sequence[str]],
                 rank_of: Mapping[str, int]) -> dict[int, list[int]]:
    """A children map of node ids (``ClusterTopology.best_tree``) as one of
    ranks, given each member's rank."""
    try:
        return {rank_of[node]: [rank_of[c] for c in kids] for node, kids in children.items()}
    except KeyError as exc:
        raise PMetalValueError(
            f"the tree names node {exc.args[0]!r}, which has no rank in this group") from exc


def validate_tree(tree: Mapping[int, Sequence[int]], world: int, root: int
                  ) -> tuple[tuple[int, ...], ...]:
    """The children map as a tuple indexed by rank, after checking that it
    is a tree over exactly ``range(world)`` rooted at ``root``."""
    parent: dict[int, int] = {}
    for node, kids in tree.items():
        for r in (node, *kids):
            if not isinstance(r, int) or not 0 <= r < world:
                raise PMetalValueError(f"the tree names rank {r!r}, outside range({world})")
        for kid in kids:
            if kid in parent or kid == root:
                raise PMetalValueError(
                    f"rank {kid} has two parents in the tree (or is the root {root} "
                    "and has one): a tree gives every other rank exactly one parent")
            parent[kid] = node
    seen, frontier = {root}, [root]
    while frontier:
        node = frontier.pop()
        for kid in tree.get(node, ()):
            seen.add(kid)
            frontier.append(kid)
    missing = sorted(set(range(world)) - seen)
    if missing:
        raise PMetalValueError(
            f"ranks {missing} are not reachable from the root {root} in the tree: "
            "it must span every rank of the group")
    return tuple(tuple(tree.get(r, ())) for r in range(world))


def tree_depth(children: Sequence[Sequence[int]], root: int) -> int:
    """Edges on the longest path from ``root`` to a leaf."""
    return max((1 + tree_depth(children, kid) for kid in children[root]), default=0)


def plan(request: PlanRequest) -> Plan:
    w, root = request.world, request.root
    if request.tree:
        children = request.tree
    else:
        start = request.order.index(root)
        seq = [request.order[(start + i) % w] for i in range(w)]
        built = binomial_tree(seq)
        children = tuple(tuple(built[r]) for r in range(w))
    depth = [0] * w
    preorder = [root]
    for node in preorder:  # grows as it goes: breadth first
        for kid in children[node]:
            depth[kid] = depth[node] + 1
            preorder.append(kid)
    height = [0] * w
    for node in reversed(preorder):
        height[node] = max((height[k] + 1 for k in children[node]), default=0)
    subtree = [set[int]() for _ in range(w)]
    for node in reversed(preorder):
        subtree[node] = {node}.union(*(subtree[k] for k in children[node]))
    sched = Schedule(w)
    op = request.op

    def down(first: int, chunks_for: dict[tuple[int, int], list[int]] | None,
             all_chunks: list[int]) -> None:
        # A rank at depth d sends chunk j (its index in the table) in step
        # first + d + j: one step after its parent sent it.
        for node in preorder:
            for kid in children[node]:
                wanted = all_chunks if chunks_for is None else chunks_for[(node, kid)]
                for c in wanted:
                    sched.transfer(first + depth[node] + c, node, kid, c, reduce=False)

    def up(chunks_of: list[list[int]], reduce: bool) -> None:
        # A rank of height h sends chunk j to its parent in step h + j, after
        # every child (height <= h - 1) has sent it chunk j.
        for node in preorder:
            for kid in children[node]:
                for c in chunks_of[kid]:
                    sched.transfer(height[kid] + c, kid, node, c, reduce=reduce)

    if op in ("broadcast", "reduce", "all_reduce", "barrier"):
        chunks = split_whole(request.n_elements, request.pipeline_parts)
        everything = list(range(len(chunks)))
        if op in ("reduce", "all_reduce", "barrier"):
            up([everything] * w, reduce=True)
        if op != "reduce":
            down(height[root] + 1 if op != "broadcast" else 0, None, everything)
        results = [everything if op != "reduce" or r == root else [] for r in range(w)]
        return sched.build(request, NAME, chunks, results)

    chunks, members = split_blocks(request.n_elements, w, request.pipeline_parts)
    everything = list(range(len(chunks)))
    below = [sorted(c for r in subtree[node] for c in members[r]) for node in range(w)]
    if op == "all_gather":
        up(below, reduce=False)
        outside = {(node, kid): sorted(set(everything) - set(below[kid]))
                   for node in range(w) for kid in children[node]}
        down(height[root] + 1, outside, everything)
        results = [everything] * w
    elif op == "reduce_scatter":
        up([everything] * w, reduce=True)
        inside = {(node, kid): below[kid] for node in range(w) for kid in children[node]}
        down(height[root] + 1, inside, everything)
        results = [members[r] for r in range(w)]
    else:  # pragma: no cover - make_plan checks the op against OPS
        raise AssertionError(op)
    return sched.build(request, NAME, chunks, results)
