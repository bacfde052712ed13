"""Scheduling strategies in Ray's form, for ``.options(scheduling_strategy=...)``.

``"DEFAULT"`` (or None) is the hybrid policy, ``"SPREAD"`` spreads the
actors over the nodes with room, and :class:`NodeAffinitySchedulingStrategy`
pins one to a node (see :mod:`pmetal.node.placement` for the policy and
``docs/api.md`` for the rules).
"""

from __future__ import annotations

import difflib
from typing import Any

from pmetal.errors import PMetalTypeError, PMetalValueError

__all__ = ["NodeAffinitySchedulingStrategy", "placement_options"]

_NAMED = ("DEFAULT", "SPREAD")


class NodeAffinitySchedulingStrategy:
    """Place the actor on node ``node_id`` (a full id as ``pmetal.nodes()``
    lists it, or a unique prefix). ``soft=False``: fail with
    :class:`~pmetal.errors.PlacementError` when that node is not a live
    member (the creation waits in its queue when it is only full);
    ``soft=True``: fall back to the default policy when the node is
    unknown, dead or has no room now."""

    __slots__ = ("node_id", "soft")

    def __init__(self, node_id: str, soft: bool = False) -> None:
        if type(node_id) is not str or not node_id:
            raise PMetalTypeError(f"NodeAffinitySchedulingStrategy: node_id must be a non-empty "
                                  f"str (a NodeID from pmetal.nodes()), not {node_id!r:.40}")
        if type(soft) is not bool:
            raise PMetalTypeError(f"NodeAffinitySchedulingStrategy: soft must be True or False, "
                                  f"not {soft!r:.40}")
        self.node_id = node_id
        self.soft = soft

    def __repr__(self) -> str:
        return f"NodeAffinitySchedulingStrategy({self.node_id!r}, soft={self.soft})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, NodeAffinitySchedulingStrategy)
                and (self.node_id, self.soft) == (other.node_id, other.soft))

    def __hash__(self) -> int:
        return hash((self.node_id, self.soft))


def placement_options(options: dict[str, Any], where: str) -> dict[str, Any]:
    """The creation options (``node``, ``soft``, ``strategy``) that
    ``options``' ``node`` and ``scheduling_strategy`` ask for; a specific
    error for a misspelt strategy, a wrong type, or both given."""
    strategy = options.get("scheduling_strategy")
    node = options.get("node") or ""
    if strategy is None:
        return {"node": node, "soft": False, "strategy": "DEFAULT"}
    if node:
        raise PMetalValueError(f"{where}: node={node!r} and scheduling_strategy={strategy!r} "
                               f"both choose the node; give one (node=X is "
                               f"NodeAffinitySchedulingStrategy(X, soft=False))")
    if isinstance(strategy, NodeAffinitySchedulingStrategy):
        return {"node": strategy.node_id, "soft": strategy.soft, "strategy": "DEFAULT"}
    if isinstance(strategy, str):
        if strategy in _NAMED:
            return {"node": "", "soft": False, "strategy": strategy}
        close = difflib.get_close_matches(strategy.upper(), _NAMED, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PMetalValueError(f"{where}: unknown scheduling_strategy {strategy!r:.40}{hint} "
                               f"(valid: 'DEFAULT', 'SPREAD', or "
                               f"pmetal.NodeAffinitySchedulingStrategy(node_id, soft=...))")
    raise PMetalTypeError(f"{where}: scheduling_strategy must be 'DEFAULT', 'SPREAD', None or "
                          f"a NodeAffinitySchedulingStrategy, not {type(strategy).__name__}")
