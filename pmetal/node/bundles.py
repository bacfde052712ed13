"""Where the bundles of a placement group go: a pure plan, no I/O.

:func:`plan` maps each bundle (a map of resource name to amount) to a node,
given what each node has free now, by one of Ray's four strategies:

* ``STRICT_PACK``: every bundle on one node;
* ``PACK``: on as few nodes as it can (one if the group fits one node);
* ``STRICT_SPREAD``: every bundle on a different node;
* ``SPREAD``: on different nodes as far as they have room, then on the
  nodes with the fewest of the group's bundles.

No plan (None) means the bundles do not fit now: the group stays pending
and the plan is tried again when resources may have freed (Ray's
behaviour: a placement group is never refused for lack of room).
:func:`why_pending` says whether the group would fit the cluster when
empty (it waits for resources) or never could (too big, or more
STRICT_SPREAD bundles than nodes): the text a pending group's entry shows.

The group's own node comes first among equals, so a group that fits there
stays on the node of the driver that made it, as Ray's do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pmetal.actors.strategies import GROUP_STRATEGIES as STRATEGIES
from pmetal.actors.strategies import bundle_error
from pmetal.node.placement import fits, resources_text

__all__ = ["STRATEGIES", "bundle_error", "plan", "why_pending"]

Bundle = Mapping[str, float]
Pools = Mapping[str, Mapping[str, float]]


def _total(bundles: Sequence[Bundle]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for k, v in bundle.items():
            total[k] = total.get(k, 0.0) + float(v)
    return total


def _size(resources: Bundle) -> float:
    """A rough size to order by (memory counted in GiB, so bytes do not swamp CPUs)."""
    return sum(v / (1 << 30) if k == "memory" else v for k, v in resources.items())


def _take(pool: dict[str, float], bundle: Bundle) -> None:
    for k, v in bundle.items():
        pool[k] = pool.get(k, 0.0) - float(v)


def _order(free: Pools, home: str) -> list[str]:
    """The nodes, the group's own first, then by id (a stable plan)."""
    return sorted(free, key=lambda n: (n != home, n))


def plan(bundles: Sequence[Bundle], free: Pools, strategy: str,
         home: str = "") -> list[str] | None:
    """The node of each bundle, or None when they do not fit ``free`` now
    (see the module doc). ``home``: the group's own node."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; use one of {STRATEGIES}")
    nodes = _order(free, home)
    pools = {n: dict(free[n]) for n in nodes}
    if strategy in ("STRICT_PACK", "PACK"):
        need = _total(bundles)
        for node in nodes:
            if fits(need, pools[node]):
                return [node] * len(bundles)
        if strategy == "STRICT_PACK":
            return None
        return _pack(bundles, pools, nodes)
    if strategy == "STRICT_SPREAD":
        if len(bundles) > len(nodes):
            return None
        return _distinct(bundles, pools, nodes)
    return _spread(bundles, pools, nodes)


def _pack(bundles: Sequence[Bundle], pools: dict[str, dict[str, float]],
          nodes: list[str]) -> list[str] | None:
    """First fit, the largest bundles first, onto the nodes used already
    before a new one (a new one: the one with the most of what the bundle
    needs free)."""
    order = sorted(range(len(bundles)), key=lambda i: -_size(bundles[i]))
    used: list[str] = []
    out = [""] * len(bundles)
    for i in order:
        node = next((n for n in used if fits(bundles[i], pools[n])), "")
        if not node:
            room = [n for n in nodes if n not in used and fits(bundles[i], pools[n])]
            if not room:
                return None
            node = max(room, key=lambda n: (_size({k: pools[n].get(k, 0.0) for k in bundles[i]}),
                                            -nodes.index(n)))
            used.append(node)
        _take(pools[node], bundles[i])
        out[i] = node
    return out


def _distinct(bundles: Sequence[Bundle], pools: dict[str, dict[str, float]],
              nodes: list[str]) -> list[str] | None:
    """One node per bundle, each a different one: a search over the
    assignments (a home cluster has a handful of nodes), the bundles that
    fit the fewest nodes first."""
    candidates = [[n for n in nodes if fits(b, pools[n])] for b in bundles]
    order = sorted(range(len(bundles)), key=lambda i: len(candidates[i]))
    out = [""] * len(bundles)
    taken: set[str] = set()

    def assign(k: int) -> bool:
        if k == len(order):
            return True
        i = order[k]
        for node in candidates[i]:
            if node not in taken:
                taken.add(node)
                out[i] = node
                if assign(k + 1):
                    return True
                taken.discard(node)
        return False

    return out if assign(0) else None


def _spread(bundles: Sequence[Bundle], pools: dict[str, dict[str, float]],
            nodes: list[str]) -> list[str] | None:
    """Each bundle on the node with room holding the fewest of the group's
    bundles so far (the first in order among equals)."""
    count = dict.fromkeys(nodes, 0)
    out = []
    for bundle in bundles:
        room = [n for n in nodes if fits(bundle, pools[n])]
        if not room:
            return None
        node = min(room, key=lambda n: count[n])
        count[node] += 1
        _take(pools[node], bundle)
        out.append(node)
    return out


def why_pending(bundles: Sequence[Bundle], free: Pools, total: Pools, strategy: str) -> str:
    """Why a group gets no plan now: it waits for resources, or it could
    never be placed on these nodes (the words a pending group's entry shows)."""
    if plan(bundles, total, strategy) is None:
        if strategy == "STRICT_SPREAD" and len(bundles) > len(total):
            return (f"infeasible: STRICT_SPREAD needs {len(bundles)} nodes, one per bundle; "
                    f"the cluster has {len(total)}")
        sizes = ", ".join(f"{n[:8]}: {resources_text(dict(t))}" for n, t in sorted(total.items()))
        return (f"infeasible: the nodes could not hold these bundles ({strategy}) even when "
                f"empty ({sizes}); it waits for a node that can")
    sizes = ", ".join(f"{n[:8]}: {resources_text(dict(f))}" for n, f in sorted(free.items()))
    return f"waiting for resources: free now {sizes}"
