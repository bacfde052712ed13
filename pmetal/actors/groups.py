"""Placement groups, the driver's side: Ray's ``ray.util.placement_group`` API.

``placement_group(bundles, strategy)`` asks this process's node to reserve
``bundles`` (maps of resource name to amount) on the cluster's nodes by
``strategy`` (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD); the node holds the
group and reserves the bundles (see :mod:`pmetal.node.groups`). It returns
at once with a :class:`PlacementGroup`, created or still pending: as in Ray,
a group that does not fit now waits until it does, and ``pg.ready()`` (an
ObjectRef for ``get``/``wait``) resolves when it is created.
``pg.wait(timeout_seconds)`` says whether that happened in time.

Actors and tasks go into a bundle with
``.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i))``
(:mod:`pmetal.actors.strategies`). ``remove_placement_group(pg)`` releases
every bundle (their actors end) and returns once they are free. A group
ends with the driver that made it unless ``lifetime="detached"``.

``ready()`` is one request to our node on a session of its own that the
node answers when the group is created (with a Result holding the group,
so ``get(pg.ready())`` returns it, as in Ray) or removed (a Failure: get
raises PlacementError). ``ready()`` returns the same ref again unless it
failed, so polling does not pile up requests on the node. ``wait`` asks for
the group's state first: a group removed since it was ready says so.
"""

from __future__ import annotations

import difflib
import os
import secrets
from typing import Any

from pmetal.actors import context
from pmetal.actors.refs import ObjectRef, failure_error
from pmetal.actors.routing import NODE_SESSION, forget_group
from pmetal.actors.strategies import GROUP_STRATEGIES, bundle_error
from pmetal.errors import PeerError, PlacementError, PMetalTypeError, PMetalValueError
from pmetal.wire import CreatePlacementGroup, Failure, PlacementGroupQuery, PlacementGroups

__all__ = ["PlacementGroup", "PlacementGroupID", "get_current_placement_group",
           "get_placement_group", "placement_group", "placement_group_table",
           "remove_placement_group"]


class PlacementGroupID(str):
    """A group id (hex) that also answers ``.hex()``, as Ray's ids do."""

    def hex(self) -> str:
        return str(self)


class PlacementGroup:
    """A handle on a placement group; it can be passed to tasks and actors."""

    def __init__(self, id: str, bundles: list[dict[str, float]], strategy: str = "",
                 name: str = "") -> None:
        self.id = PlacementGroupID(id)
        self._bundles = [dict(b) for b in bundles]
        self.strategy = strategy
        self.name = name
        self._ready: tuple[Any, ObjectRef] | None = None   # (client, ref) of ready()

    @property
    def bundle_specs(self) -> list[dict[str, float]]:
        """The bundles, as given (copies)."""
        return [dict(b) for b in self._bundles]

    @property
    def bundle_count(self) -> int:
        return len(self._bundles)

    @property
    def is_empty(self) -> bool:
        return not self._bundles

    def ready(self) -> ObjectRef:
        """An ObjectRef that resolves (to this group) once the group is
        created; ``get`` of it raises PlacementError if the group is removed."""
        client = context.current()
        cached = self._ready
        if cached is not None and cached[0] is client and not (
                cached[1].done() and cached[1]._error is not None):
            return cached[1]   # pending (one wait on the node is enough), or ready
        with client.lock:
            link = client._own(client.link(client.node_address), NODE_SESSION)
            try:
                if link.dead:
                    raise PeerError(link.dead)
                corr = link.channel.submit(PlacementGroupQuery(self.id, wait=True),
                                           timeout=client.config.transport.send_timeout)
            except PeerError as exc:
                link.die(str(exc))
                return ObjectRef.of_error(exc)
            ref = ObjectRef(client, link, corr, f"placement group {self.id}: ready()")
        self._ready = (client, ref)
        return ref

    def wait(self, timeout_seconds: float = 30) -> bool:
        """Whether the group is created within ``timeout_seconds``
        (PlacementError if it was removed)."""
        if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) \
                or not timeout_seconds >= 0:
            raise PMetalValueError(f"PlacementGroup.wait: timeout_seconds must be a number >= 0, "
                                   f"not {timeout_seconds!r:.40}")
        client = context.current()
        entry = _one(client.request_node(PlacementGroupQuery(self.id)), "PlacementGroup.wait")
        if entry.get("state") == "CREATED":
            return True
        if entry.get("state") == "REMOVED":
            raise PlacementError(f"placement group {self.id} was removed "
                                 f"({entry.get('reason') or 'remove_placement_group'})")
        ref = self.ready()
        done, _ = client.wait([ref], 1, float(timeout_seconds))
        if not done:
            return False
        ref.result()
        return True

    def __reduce__(self) -> Any:
        return (PlacementGroup, (str(self.id), self._bundles, self.strategy, self.name))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlacementGroup) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"PlacementGroup({self.id}, {self.strategy}, {self._bundles})"


def placement_group(bundles: list[dict[str, float]], strategy: str = "PACK", name: str = "",
                    lifetime: str | None = None) -> PlacementGroup:
    """Reserve ``bundles`` on the cluster's nodes by ``strategy`` (see the
    module doc); returns at once, the group created or pending."""
    where = "placement_group"
    why = bundle_error(bundles)
    if why:
        raise PMetalValueError(f"{where}: {why}")
    if not isinstance(strategy, str) or strategy not in GROUP_STRATEGIES:
        close = difflib.get_close_matches(str(strategy).upper(), GROUP_STRATEGIES, n=1,
                                          cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PMetalValueError(f"{where}: unknown strategy {strategy!r:.40}{hint} (valid: "
                               f"{', '.join(map(repr, GROUP_STRATEGIES))})")
    if not isinstance(name, str):
        raise PMetalTypeError(f"{where}: name must be a str, not {type(name).__name__}")
    if lifetime not in (None, "detached", "non_detached"):
        raise PMetalValueError(f"{where}: lifetime must be 'detached', 'non_detached' or None, "
                               f"not {lifetime!r:.40}")
    clean = [{k: float(v) for k, v in b.items()} for b in bundles]
    client = context.current()
    group_id = client.node_id[:16] + secrets.token_hex(10)
    reply = client.request_node(CreatePlacementGroup(
        group_id, name, clean, strategy,
        {"lifetime": lifetime or "", "owner_pid": os.getpid()}))
    entry = _one(reply, f"{where}({strategy})")
    client._created = True   # our node is told when we shut down (Detach): the group ends
    lease = float(entry.get("owner_lease") or 0.0)
    if lease > 0 and not client.node_link.renew_every:
        # Our node cannot watch our process (another machine): keep our
        # lease on the group, as for an actor (the flush thread renews it).
        client.node_link.hold_lease(lease)
        client._start_flusher()
    return PlacementGroup(entry["group_id"], clean, strategy, name)


def remove_placement_group(placement_group: PlacementGroup) -> None:
    """Remove the group: its bundles are released on every node and the
    actors placed in them end (returns once that is done)."""
    if not isinstance(placement_group, PlacementGroup):
        raise PMetalTypeError(f"remove_placement_group: expected a PlacementGroup, not "
                              f"{type(placement_group).__name__}")
    client = context.current()
    _one(client.request_node(PlacementGroupQuery(placement_group.id, remove=True)),
         "remove_placement_group")
    forget_group(client, placement_group.id)


def get_current_placement_group() -> PlacementGroup | None:
    """The placement group the calling actor runs in; None in a driver, in
    a task, and in an actor outside any group."""
    from pmetal.actors.strategies import current_group
    group = current_group()
    return group if isinstance(group, PlacementGroup) else None


def get_placement_group(placement_group_name: str) -> PlacementGroup:
    """The live group named ``placement_group_name`` (PMetalValueError if none)."""
    if not isinstance(placement_group_name, str) or not placement_group_name:
        raise PMetalTypeError(f"get_placement_group: the name must be a non-empty str, not "
                              f"{placement_group_name!r:.40}")
    reply = context.current().request_node(PlacementGroupQuery(name=placement_group_name))
    entries = [e for e in _entries(reply, "get_placement_group")
               if e.get("name") == placement_group_name and e.get("state") != "REMOVED"]
    if not entries:
        raise PMetalValueError(f"no placement group named {placement_group_name!r} in this "
                               f"cluster (removed, never created, or its driver has left)")
    e = entries[0]
    return PlacementGroup(e["group_id"], e["bundles"], e.get("strategy") or "", e["name"])


def placement_group_table(placement_group: PlacementGroup | None = None) -> dict[str, Any]:
    """Ray's table: one group's entry, or every group's by id (hex), with
    ``placement_group_id``, ``name``, ``strategy``, ``state``, ``bundles``
    and ``bundles_to_node_id`` (index -> node id) and ``stats``."""
    query = PlacementGroupQuery(placement_group.id if placement_group is not None else "")
    table = {e["group_id"]: _ray_entry(e)
             for e in _entries(context.current().request_node(query), "placement_group_table")}
    if placement_group is None:
        return table
    return table.get(placement_group.id, {})


def _ray_entry(entry: dict[str, Any]) -> dict[str, Any]:
    bundles = entry.get("bundles") or []
    nodes = entry.get("bundle_nodes") or []
    return {"placement_group_id": entry["group_id"], "name": entry.get("name") or "",
            "strategy": entry.get("strategy"), "state": entry.get("state"),
            "bundles": {i: dict(b) for i, b in enumerate(bundles)},
            "bundles_to_node_id": {i: n for i, n in enumerate(nodes) if n},
            "lifetime": entry.get("lifetime"),
            "stats": {"scheduling_state": entry.get("reason") or entry.get("state")}}


def _entries(reply: Any, what: str) -> list[dict[str, Any]]:
    if isinstance(reply, Failure):
        raise failure_error(reply)
    if not isinstance(reply, PlacementGroups):
        raise PeerError(f"{what}: the node answered with {type(reply).__name__}")
    return [e for e in reply.groups if isinstance(e, dict) and isinstance(e.get("group_id"), str)]


def _one(reply: Any, what: str) -> dict[str, Any]:
    entries = _entries(reply, what)
    if not entries:
        raise PeerError(f"{what}: the node answered without the group")
    return entries[0]

