"""Scheduling strategies in Ray's form, for ``.options(scheduling_strategy=...)``.

``"DEFAULT"`` (or None) is the hybrid policy, ``"SPREAD"`` spreads the
actors over the nodes with room, :class:`NodeAffinitySchedulingStrategy`
pins one to a node, and :class:`PlacementGroupSchedulingStrategy` puts it
in a bundle of a placement group (see :mod:`pmetal.node.placement` and
:mod:`pmetal.node.groups` for the policies and ``docs/api.md`` for the
rules). Ray's older options ``placement_group=``,
``placement_group_bundle_index=`` and
``placement_group_capture_child_tasks=`` mean the same as the last.

:func:`placement_options` turns the options into what a creation carries;
:func:`task_strategy` into where a task runs (``None``: the caller's node,
today's fast path).
"""

from __future__ import annotations

import difflib
from typing import Any

from pmetal.errors import PMetalTypeError, PMetalValueError

__all__ = ["GROUP_STRATEGIES", "NodeAffinitySchedulingStrategy", "PG_OPTIONS",
           "PlacementGroupSchedulingStrategy", "bundle_error", "captured", "current_group",
           "placement_options", "set_current", "task_strategy"]

_NAMED = ("DEFAULT", "SPREAD")
GROUP_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""A placement group's strategies, as in Ray."""
PG_OPTIONS = ("placement_group", "placement_group_bundle_index",
              "placement_group_capture_child_tasks")
"""Ray's older options for a placement group (before scheduling_strategy)."""


class NodeAffinitySchedulingStrategy:
    """Place the actor on node ``node_id`` (a full id as ``pmetal.nodes()``
    lists it, or a unique prefix). ``soft=False``: fail with
    :class:`~pmetal.errors.PlacementError` when that node is not a live
    member (the creation waits in its queue when it is only full);
    ``soft=True``: fall back to the default policy when the node is
    unknown, dead or has no room now."""

    __slots__ = ("node_id", "soft")

    def __init__(self, node_id: str, soft: bool = False) -> None:
        if hasattr(node_id, "hex") and not isinstance(node_id, str):
            node_id = node_id.hex()   # an id object, as Ray's NodeID
        if not isinstance(node_id, str) or not node_id:
            raise PMetalTypeError(f"NodeAffinitySchedulingStrategy: node_id must be a non-empty "
                                  f"str (a NodeID from pmetal.nodes()), not {node_id!r:.40}")
        if type(soft) is not bool:
            raise PMetalTypeError(f"NodeAffinitySchedulingStrategy: soft must be True or False, "
                                  f"not {soft!r:.40}")
        self.node_id = str(node_id)   # (the runtime context's ids are a str subclass)
        self.soft = soft

    def __repr__(self) -> str:
        return f"NodeAffinitySchedulingStrategy({self.node_id!r}, soft={self.soft})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, NodeAffinitySchedulingStrategy)
                and (self.node_id, self.soft) == (other.node_id, other.soft))

    def __hash__(self) -> int:
        return hash((self.node_id, self.soft))


class PlacementGroupSchedulingStrategy:
    """Place the actor or task in bundle ``placement_group_bundle_index`` of
    ``placement_group`` (-1: any bundle with room): it runs on that
    bundle's node, and an actor holds its resources out of the bundle's.
    ``placement_group=None`` means no group, as ``"DEFAULT"`` (Ray's way
    to keep a capturing actor's child out of its group).
    With ``placement_group_capture_child_tasks=True`` on an actor, the
    tasks and actors its methods start without a strategy of their own go
    in the same group (any bundle); a task's children are not captured
    (see docs/ray-compat.md)."""

    __slots__ = ("placement_group", "placement_group_bundle_index",
                 "placement_group_capture_child_tasks")

    def __init__(self, placement_group: Any, placement_group_bundle_index: int = -1,
                 placement_group_capture_child_tasks: bool | None = None) -> None:
        where = "PlacementGroupSchedulingStrategy"
        if placement_group is not None:   # None: no group (Ray: opts out of a capture)
            _check_group(placement_group, where)
            _check_index(placement_group, placement_group_bundle_index, where)
        if placement_group_capture_child_tasks not in (None, True, False):
            raise PMetalTypeError(f"{where}: placement_group_capture_child_tasks must be True, "
                                  f"False or None, not {placement_group_capture_child_tasks!r:.40}")
        self.placement_group = placement_group
        self.placement_group_bundle_index = placement_group_bundle_index
        self.placement_group_capture_child_tasks = placement_group_capture_child_tasks

    def __repr__(self) -> str:
        return (f"PlacementGroupSchedulingStrategy({self.placement_group!r}, "
                f"placement_group_bundle_index={self.placement_group_bundle_index})")


def captured(options: dict[str, Any]) -> Any:
    """The strategy a task or actor started from an actor created with
    ``placement_group_capture_child_tasks=True`` gets when ``options``
    choose no node themselves (None: no capture)."""
    if _capture is None or options.get("scheduling_strategy") is not None or any(
            options.get(k) is not None for k in ("node", "placement_group")):
        return None
    return _capture


# Set in an actor's worker (set_current): the group it runs in, and the
# strategy its children get when it was created to capture them.
_current: Any = None
_capture: PlacementGroupSchedulingStrategy | None = None


def set_current(options: dict[str, Any]) -> None:
    """Called by an actor's worker with its creation options: the group it
    runs in (``current_group``), and whether its children go there too."""
    global _current, _capture
    group_id = options.get("placement_group")
    _current = _capture = None
    if group_id:
        from pmetal.actors.groups import PlacementGroup
        _current = PlacementGroup(group_id, options.get("group_bundles") or [],
                                  options.get("group_strategy") or "")
        if options.get("capture_child_tasks"):
            _capture = PlacementGroupSchedulingStrategy(_current, -1, True)


def current_group() -> Any:
    """The placement group this process's actor runs in (None: none)."""
    return _current


def _check_group(group: Any, where: str) -> None:
    if not (hasattr(group, "bundle_specs") and isinstance(getattr(group, "id", None), str)):
        raise PMetalTypeError(f"{where}: placement_group must be a PlacementGroup (from "
                              f"pmetal.util.placement_group(...)), not "
                              f"{type(group).__name__} {group!r:.40}")


def _check_index(group: Any, index: Any, where: str) -> None:
    if type(index) is not int:
        raise PMetalTypeError(f"{where}: placement_group_bundle_index must be an int, not "
                              f"{type(index).__name__} {index!r:.40}")
    count = len(group.bundle_specs)
    if not -1 <= index < count:
        raise PMetalValueError(f"{where}: placement_group_bundle_index={index} is out of range: "
                               f"placement group {group.id} has {count} bundle"
                               f"{'s' if count != 1 else ''} (use 0-{count - 1}, or -1 for any)")


def _legacy_group(options: dict[str, Any], where: str) -> Any:
    """Ray's older ``placement_group=`` options as a strategy (None: none given)."""
    group = options.get("placement_group")
    if group is None or group == "default":
        for key in PG_OPTIONS[1:]:
            if options.get(key) not in (None, -1, False):
                raise PMetalValueError(f"{where}: {key}={options[key]!r} needs "
                                       f"placement_group=... too")
        return None
    if options.get("scheduling_strategy") is not None:
        raise PMetalValueError(f"{where}: placement_group= and scheduling_strategy= both "
                               f"choose where it runs; give one (scheduling_strategy="
                               f"PlacementGroupSchedulingStrategy(...) is the newer form)")
    index = options.get("placement_group_bundle_index")
    return PlacementGroupSchedulingStrategy(
        group, -1 if index is None else index, options.get("placement_group_capture_child_tasks"))


def placement_options(options: dict[str, Any], where: str) -> dict[str, Any]:
    """The creation options (``node``, ``soft``, ``strategy``, and
    ``placement_group`` with ``bundle_index``) that ``options``' ``node``,
    ``scheduling_strategy`` and placement group options ask for; a specific
    error for a misspelt strategy, a wrong type, or two of them given."""
    strategy = _legacy_group(options, where) or options.get("scheduling_strategy")
    node = options.get("node") or ""
    if strategy is None:
        return {"node": node, "soft": False, "strategy": "DEFAULT"}
    if node:
        raise PMetalValueError(f"{where}: node={node!r} and scheduling_strategy={strategy!r} "
                               f"both choose the node; give one (node=X is "
                               f"NodeAffinitySchedulingStrategy(X, soft=False))")
    if isinstance(strategy, NodeAffinitySchedulingStrategy):
        return {"node": strategy.node_id, "soft": strategy.soft, "strategy": "DEFAULT"}
    if isinstance(strategy, PlacementGroupSchedulingStrategy) and strategy.placement_group is None:
        return {"node": "", "soft": False, "strategy": "DEFAULT"}
    if isinstance(strategy, PlacementGroupSchedulingStrategy):
        group = strategy.placement_group
        # The group's bundles and strategy ride along so that the actor's
        # worker knows its group (get_current_placement_group, capture).
        return {"node": "", "soft": False, "strategy": "DEFAULT",
                "placement_group": group.id,
                "bundle_index": strategy.placement_group_bundle_index,
                "group_bundles": group.bundle_specs, "group_strategy": group.strategy,
                "capture_child_tasks": bool(strategy.placement_group_capture_child_tasks)}
    if isinstance(strategy, str):
        if strategy in _NAMED:
            return {"node": "", "soft": False, "strategy": strategy}
        close = difflib.get_close_matches(strategy.upper(), _NAMED, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PMetalValueError(f"{where}: unknown scheduling_strategy {strategy!r:.40}{hint} "
                               f"(valid: 'DEFAULT', 'SPREAD', "
                               f"NodeAffinitySchedulingStrategy(node_id, soft=...) or "
                               f"PlacementGroupSchedulingStrategy(placement_group, ...))")
    raise PMetalTypeError(f"{where}: scheduling_strategy must be 'DEFAULT', 'SPREAD', None, "
                          f"a NodeAffinitySchedulingStrategy or a "
                          f"PlacementGroupSchedulingStrategy, not {type(strategy).__name__}")


def task_strategy(options: dict[str, Any], where: str) -> Any:
    """Where a remote function's tasks run: None for the caller's node
    (no strategy, or "DEFAULT": today's path, untouched), else "SPREAD", a
    NodeAffinitySchedulingStrategy or a PlacementGroupSchedulingStrategy."""
    placed = placement_options(options, where)
    if placed.get("placement_group"):
        return _legacy_group(options, where) or options["scheduling_strategy"]
    if placed["node"]:
        return NodeAffinitySchedulingStrategy(placed["node"], placed["soft"])
    return "SPREAD" if placed["strategy"] == "SPREAD" else None


def bundle_error(bundles: object) -> str:
    """Why ``bundles`` is not a list of resource maps, or "" (checked by
    the driver and again by the node, for any peer)."""
    if not isinstance(bundles, (list, tuple)) or not bundles:
        return f"bundles must be a non-empty list of resource maps, not {bundles!r:.60}"
    for i, bundle in enumerate(bundles):
        if not isinstance(bundle, dict) or not bundle:
            return (f"bundle {i} is {bundle!r:.60}; each bundle must be a non-empty map of "
                    f"resource name to amount, such as {{'CPU': 1}}")
        for name, amount in bundle.items():
            if not isinstance(name, str) or not name:
                return f"bundle {i}: resource names must be non-empty strings, not {name!r:.40}"
            if type(amount) not in (int, float) or not 0 <= amount < float("inf"):
                return (f"bundle {i}: resource {name!r} must be a finite number >= 0, not "
                        f"{amount!r:.40}")
        if not any(bundle.values()):
            return (f"bundle {i} is {bundle!r:.60}: every amount is 0; a bundle must reserve "
                    f"something")
    return ""
