"""Placement groups: bundles of resources reserved across the cluster's nodes.

Two roles, both in every node:

* **the group's node** (the node of the driver that made it) holds the
  group: its bundles, strategy, state (PENDING, CREATED, RESCHEDULING,
  REMOVED) and owner.
  It plans where the bundles go (:func:`pmetal.node.bundles.plan`, from what
  every member has free now) and asks each chosen node to hold its share
  (:class:`~pmetal.wire.ReserveBundles`). All or nothing: when one node
  refuses (its resources went meanwhile) or does not answer, every node
  asked is told to release that attempt, and the group stays PENDING. A
  pending group is tried again, sooner after a change of the member list,
  at most :data:`RETRY_MAX` s apart: as in Ray, a group is never refused
  for lack of room, it waits (``ready()`` does not resolve) until it fits
  or is removed.
* **a host** holds bundles (:mod:`pmetal.node.hosted`): each one's
  resources leave the node's free pool (``pmetal.available_resources()``
  drops) and become a pool of their own, from which the actors placed in
  that bundle take theirs (waiting in the bundle's queue when it is full).
  A release gives them back and ends the actors placed in the bundle, as
  Ray does.

Consistency comes from each node being the only authority over its own
resources: the group's node only proposes, and each host takes or refuses
its share at once in its own event loop, so two groups (or a group and an
actor) planned from the same stale view can never both hold the same CPU.
Reserves and releases carry the attempt number, so a release that
overtakes its reserve leaves nothing held (see the host's module).

The group ends with its owner (the driver process, or a remote driver's
session) unless ``lifetime="detached"``, through the same path as actors
(:mod:`pmetal.node.owners`). A host whose group's node is declared dead
releases that group's bundles. When a host dies (this node's detector
declares it dead), the group's node places the bundles it held again, as
Ray does: the group is RESCHEDULING (actors in its other bundles go on; new
ones for a lost bundle wait) until they are placed (the strategy holds:
STRICT_SPREAD avoids the nodes of the other bundles). A fenced host gives
its bundles back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pmetal.node.bundles import STRATEGIES, bundle_error, plan, why_pending
from pmetal.node.hosted import HostedBundles
from pmetal.node.placement import check_resources, fits, resources_text
from pmetal.values import FailureKind
from pmetal.wire import (Ack, CreatePlacementGroup, Failure, Message, PlacementGroupQuery,
                         PlacementGroups, ReserveBundles, Resources, ResourcesRequest, Result)

if TYPE_CHECKING:
    from pmetal.node.lifecycle import ActorLifecycle
    from pmetal.node.membership import Membership

__all__ = ["GroupRecord", "GroupStatistics", "PlacementGroupService", "RETRY_MAX"]

log = logging.getLogger(__name__)

RETRY_MAX = 1.0     # s at most between two tries of a pending group
_ASK = 2.0          # s a member may take to answer a question about resources or groups
_RESERVE_ASK = 5.0  # s a host may take to hold its bundles before the attempt is rolled back
_TAIL = 100         # removed groups kept for the table
_WAITING = ("PENDING", "RESCHEDULING")   # states in which a group is (re)placed

Spawn = Callable[[Coroutine[Any, Any, Any]], None]


@dataclass(eq=False)
class GroupRecord:
    """A group this node holds (it was created through this node)."""

    group_id: str
    name: str
    bundles: list[dict[str, float]]
    strategy: str
    lifetime: str
    owner: tuple[str, int]        # (node id, pid) of the driver that made it (pid 0: remote)
    owner_client: str
    state: str = "PENDING"
    bundle_nodes: list[str] = field(default_factory=list)
    attempt: int = 0
    reason: str = ""
    asked: set[str] = field(default_factory=set)   # nodes ever asked to hold bundles
    settled: asyncio.Event = field(default_factory=asyncio.Event)   # created or removed
    kick: asyncio.Event = field(default_factory=asyncio.Event)      # try again now
    trying: bool = False          # a _keep_trying loop runs for it

    @property
    def detached(self) -> bool:
        return self.lifetime == "detached"

    def entry(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "name": self.name, "strategy": self.strategy,
                "state": self.state, "bundles": self.bundles,
                "bundle_nodes": self.bundle_nodes or [""] * len(self.bundles),
                "owner_node": self.owner[0], "lifetime": self.lifetime or "non_detached",
                "reason": self.reason}


@dataclass(frozen=True, slots=True)
class GroupStatistics:
    groups: int          # groups this node holds (pending, created or rescheduling)
    bundles_held: int    # bundles this node holds, for its groups and others'
    created: int         # groups created through this node
    removed: int
    rolled_back: int     # attempts a host refused (or did not answer), released everywhere


class PlacementGroupService:
    """A node's placement groups (see the module doc)."""

    def __init__(self, node_id: str, actors: ActorLifecycle, membership: Membership,
                 spawn: Spawn) -> None:
        self.node_id = node_id
        self.actors = actors
        self.membership = membership
        self._spawn = spawn
        self.groups: dict[str, GroupRecord] = {}
        self.names: dict[str, str] = {}
        self._claiming: set[str] = set()   # names being looked up on the members
        self.removed: OrderedDict[str, GroupRecord] = OrderedDict()
        # The bundles this node holds, for its groups and others' (the host role).
        self.hosted = HostedBundles(node_id, actors, on_release=self.kick)
        self.reserve = self.hosted.reserve
        self.bundle_for = self.hosted.bundle_for
        self._counts = {"created": 0, "removed": 0, "rolled_back": 0}

    def statistics(self) -> GroupStatistics:
        return GroupStatistics(len(self.groups), len(self.hosted.held), self._counts["created"],
                               self._counts["removed"], self._counts["rolled_back"])

    def describe(self) -> dict[str, Any]:
        return {"statistics": asdict(self.statistics()),
                "groups": [g.entry() for g in self.groups.values()],
                "held": [{"group_id": b.group_id, "index": b.index, "resources": b.resources,
                          "available": b.queue.available, "owner_node": b.owner_node}
                         for b in self.hosted.held.values()]}

    # ------------------------------------------------------- the group's node

    async def create(self, body: CreatePlacementGroup, options: dict[str, Any]) -> Message:
        """A client's new group (``options`` name its owner): tried once
        now, then kept trying while pending. The answer is its entry."""
        why = bundle_error(body.bundles)
        if not why and body.strategy not in STRATEGIES:
            why = (f"unknown placement strategy {body.strategy!r:.40}; use one of "
                   f"{', '.join(STRATEGIES)}")
        if not why and not body.group_id.startswith(self.node_id[:16]):
            why = (f"group id {body.group_id!r:.60} does not begin with this node's id "
                   f"{self.node_id[:16]} (the group's node is in its id)")
        lifetime = options.get("lifetime") or ""
        if not why and lifetime not in ("", "non_detached", "detached"):
            why = f"lifetime must be 'detached' or None, not {lifetime!r:.40}"
        if why:
            return Failure(FailureKind.BAD_REQUEST, "ValueError", f"placement_group: {why}")
        if body.group_id in self.groups:
            return PlacementGroups([self.groups[body.group_id].entry()])
        if body.name and await self._name_taken(body.name):
            return Failure(FailureKind.BAD_REQUEST, "ValueError",
                           f"a placement group named {body.name!r} already exists; pick another "
                           f"name or use pmetal.util.get_placement_group({body.name!r})")
        record = GroupRecord(body.group_id, body.name,
                             [check_resources(b, "placement_group") for b in body.bundles],
                             body.strategy, lifetime,
                             (options["owner_node"], int(options.get("owner_pid") or 0)),
                             options.get("owner_client") or "")
        self.groups[record.group_id] = record
        if record.name:
            self.names[record.name] = record.group_id
        self._counts["created"] += 1
        record.trying = True   # (the first try, before the loop)
        try:
            await self._place(record)
        finally:
            record.trying = False
        if record.state == "PENDING":
            log.info("placement group %s is pending: %s", record.group_id, record.reason)
            self._spawn(self._keep_trying(record))
        return PlacementGroups([record.entry()])

    async def _name_taken(self, name: str) -> bool:
        """Whether a live group has ``name`` here or on a member. The name
        is claimed while the members are asked, so a second creation of it
        through this node meanwhile is refused."""
        if name in self.names or name in self._claiming:
            return True
        self._claiming.add(name)
        try:
            entries = await self._ask_members(PlacementGroupQuery(name=name, local=True))
        finally:
            self._claiming.discard(name)
        return name in self.names or any(
            e.get("name") == name and e.get("state") != "REMOVED" for e in entries)

    async def _free(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """What each node that answers has free now, and in all."""
        members = list(self.membership.members.values())
        answers = await asyncio.gather(*(
            asyncio.wait_for(self.membership.ask(m, ResourcesRequest()), _ASK)
            for m in members), return_exceptions=True)
        free = {self.node_id: dict(self.actors.available)}
        total = {self.node_id: dict(self.actors.resources)}
        for m, a in zip(members, answers):
            if isinstance(a, Resources):
                free[m.node_id], total[m.node_id] = dict(a.available), dict(a.total)
        return free, total

    async def _place(self, record: GroupRecord) -> None:
        """One attempt: plan the bundles not placed (all of a PENDING group;
        those of a dead node for a RESCHEDULING one), ask every chosen node
        to hold its share, and roll the attempt back on every node asked
        unless all of them did."""
        free, total = await self._free()
        if record.state not in _WAITING:
            return
        placed = record.bundle_nodes or [""] * len(record.bundles)
        lost = [i for i, n in enumerate(placed) if not n]
        if not lost:
            return
        nodes = self._plan(record, [record.bundles[i] for i in lost],
                           {n for n in placed if n}, free)
        if nodes is None:
            record.reason = why_pending(record.bundles, free, total, record.strategy)
            if len(lost) < len(placed):
                record.reason = f"bundles {lost} lost with their node; {record.reason}"
            return
        record.attempt += 1
        attempt = record.attempt
        shares: dict[str, list[list[Any]]] = {}
        for index, node in zip(lost, nodes):
            shares.setdefault(node, []).append([index, record.bundles[index]])
        record.asked.update(shares)
        answers = await asyncio.gather(*(
            self._on(node, ReserveBundles(record.group_id, attempt, share, False, self.node_id))
            for node, share in shares.items()))
        refused = [a for a in answers if not isinstance(a, Ack)]
        if not refused and record.state in _WAITING:
            for index, node in zip(lost, nodes):
                placed[index] = node
            record.state, record.bundle_nodes, record.reason = "CREATED", placed, ""
            record.settled.set()
            log.info("placement group %s created (%s): bundles on %s", record.group_id,
                     record.strategy, [n[:8] for n in placed])
            return
        self._counts["rolled_back"] += 1
        await self._release_on(shares, record.group_id, attempt, shares)
        if record.state in _WAITING:
            record.reason = ("a node refused its bundles (its resources went meanwhile); "
                             "trying again: " + "; ".join(getattr(a, "message", str(a))
                                                          for a in refused)[:300])

    def _plan(self, record: GroupRecord, bundles: list[dict[str, float]], kept: set[str],
              free: dict[str, dict[str, float]]) -> list[str] | None:
        """Nodes for ``bundles``, the others of the group staying on ``kept``:
        STRICT_SPREAD avoids those nodes, SPREAD tries to, STRICT_PACK
        needs the node they are on (none is left: all were lost together)."""
        if record.strategy in ("STRICT_SPREAD", "SPREAD") and kept:
            others = {n: f for n, f in free.items() if n not in kept}
            nodes = plan(bundles, others, record.strategy, home=self.node_id) if others else None
            if nodes is not None or record.strategy == "STRICT_SPREAD":
                return nodes
        return plan(bundles, free, record.strategy, home=self.node_id)

    async def _on(self, node: str, body: ReserveBundles) -> Message:
        """``body`` carried out by ``node`` (this one: at once)."""
        if node == self.node_id:
            return self.reserve(body)
        member = self.membership.members.get(node)
        if member is None:
            return Failure(FailureKind.PLACEMENT, "PeerError", f"node {node[:8]} left the cluster")
        try:
            return await asyncio.wait_for(self.membership.ask(member, body), _RESERVE_ASK)
        except asyncio.TimeoutError:
            return Failure(FailureKind.PLACEMENT, "PeerError",
                           f"node {node[:8]} did not answer within {_RESERVE_ASK:g} s")

    async def _release_on(self, nodes: Any, group_id: str, attempt: int,
                          shares: dict[str, list[list[Any]]] | None = None) -> None:
        """Tell ``nodes`` to release the group's bundles of attempts up to
        ``attempt``: those of ``shares`` only, when given (a rolled-back
        attempt must not release the bundles that stayed), else all."""
        answers = await asyncio.gather(*(
            self._on(node, ReserveBundles(group_id, attempt,
                                          [[i, {}] for i, _ in (shares or {}).get(node, [])],
                                          True, self.node_id))
            for node in nodes))
        for node, answer in zip(nodes, answers):
            if isinstance(answer, Failure):
                log.warning("could not release placement group %s on node %s: %s", group_id,
                            node[:8], answer.message)

    async def _keep_trying(self, record: GroupRecord) -> None:
        """Try a pending group again (sooner when kicked) until it is
        created or removed; owned by the node's task group."""
        if record.trying:   # one loop per group: two would race for its bundles
            record.kick.set()
            return
        record.trying = True
        try:
            await self._try_until_placed(record)
        finally:
            record.trying = False

    async def _try_until_placed(self, record: GroupRecord) -> None:
        delay = 0.05
        while record.state in _WAITING:
            try:
                await asyncio.wait_for(record.kick.wait(), delay)
            except asyncio.TimeoutError:
                pass
            record.kick.clear()
            delay = min(delay * 2, RETRY_MAX)
            await self._place(record)

    def kick(self) -> None:
        """Resources may have freed (a member joined, a group was removed):
        try the pending groups now."""
        for record in self.groups.values():
            if record.state in _WAITING:
                record.kick.set()

    async def remove(self, record: GroupRecord, why: str) -> None:
        """Remove a group this node holds: every node asked releases it
        (this node at once, the others before this returns)."""
        others = self._end(record, why)
        await self._release_on(others, record.group_id, record.attempt)

    def _end(self, record: GroupRecord, why: str) -> list[str]:
        """Mark the group removed and release its bundles here; the other
        nodes that must release it."""
        if record.state == "REMOVED":
            return []
        record.state, record.reason = "REMOVED", why
        record.settled.set()
        record.kick.set()
        self.groups.pop(record.group_id, None)
        if self.names.get(record.name) == record.group_id:
            del self.names[record.name]
        self.removed[record.group_id] = record
        while len(self.removed) > _TAIL:
            self.removed.popitem(last=False)
        self._counts["removed"] += 1
        log.info("placement group %s removed: %s", record.group_id, why)
        self.reserve(ReserveBundles(record.group_id, record.attempt, [], True, self.node_id))
        self.kick()
        return sorted(record.asked - {self.node_id})

    def remove_owned(self, owned_by: Callable[[Any], bool], why: str) -> int:
        """Remove the non-detached groups of an owner that went."""
        gone = [g for g in self.groups.values() if owned_by(g) and not g.detached]
        for record in gone:
            others = self._end(record, f"{why}; create it with lifetime='detached' to keep it")
            if others:
                self._spawn(self._release_on(others, record.group_id, record.attempt))
        return len(gone)

    def node_dead(self, node_id: str) -> None:
        """A node was declared dead: the bundles held here for its groups
        are released (nobody is left to remove those groups), and the
        bundles of this node's groups that it held are placed again
        (RESCHEDULING until they are; the bundles elsewhere stay, with
        their actors)."""
        freed = self.hosted.release(lambda b: b.owner_node == node_id,
                                    f"the node {node_id[:8]} of its placement group died")
        if freed:
            log.info("released %d bundles of placement groups of dead node %s", freed,
                     node_id[:8])
        self._lost(node_id)

    def _lost(self, node_id: str) -> None:
        """Place again the bundles of this node's groups that ``node_id`` held."""
        for record in self.groups.values():
            if record.state in ("CREATED", "RESCHEDULING") and node_id in record.bundle_nodes:
                lost = [i for i, n in enumerate(record.bundle_nodes) if n == node_id]
                record.bundle_nodes = ["" if n == node_id else n for n in record.bundle_nodes]
                if record.state == "CREATED":
                    record.state = "RESCHEDULING"
                    record.settled = asyncio.Event()
                record.reason = f"bundles {lost} lost with node {node_id[:8]}; placing them again"
                log.info("placement group %s: %s", record.group_id, record.reason)
                self._spawn(self._keep_trying(record))

    def fenced(self) -> None:
        """This node was fenced (held dead): its actors ended, and the groups'
        nodes place the bundles held here again elsewhere; give them back."""
        self.hosted.release(lambda b: True, "this node was fenced")
        self._lost(self.node_id)

    # ---------------------------------------------------------------- queries

    def _local(self, body: PlacementGroupQuery) -> list[dict[str, Any]]:
        """Entries of this node's groups that match, plus, per group, what
        the bundles held here have free (``available``: index -> pool)."""
        out: dict[str, dict[str, Any]] = {}
        for record in [*self.groups.values(), *self.removed.values()]:
            if (body.group_id and record.group_id != body.group_id) or (
                    body.name and record.name != body.name):
                continue
            out[record.group_id] = record.entry()
        for bundle in self.hosted.held.values():
            if body.group_id and bundle.group_id != body.group_id:
                continue
            entry = out.get(bundle.group_id)
            if entry is None:
                if body.name:
                    continue
                entry = out[bundle.group_id] = {"group_id": bundle.group_id, "state": "HELD"}
            entry.setdefault("available", {})[str(bundle.index)] = dict(bundle.queue.available)
        return list(out.values())

    async def _ask_members(self, query: PlacementGroupQuery,
                           nodes: list[str] | None = None) -> list[dict[str, Any]]:
        members = [m for m in self.membership.members.values()
                   if nodes is None or m.node_id in nodes]
        answers = await asyncio.gather(*(asyncio.wait_for(self.membership.ask(m, query), _ASK)
                                         for m in members), return_exceptions=True)
        return [e for a in answers if isinstance(a, PlacementGroups) for e in a.groups
                if isinstance(e, dict)]

    async def query(self, body: PlacementGroupQuery) -> Message:
        """A client's (or, ``local``, a member's) question; see the message."""
        if body.wait:
            return await self._wait(body)
        if body.remove:
            return await self._remove(body)
        entries = self._local(body)
        if not body.local:
            entries += await self._ask_members(replace_local(body))
        return PlacementGroups(merge(entries))

    def _owner(self, group_id: str) -> Any:
        """The member whose id begins the group id (the group's node)."""
        prefix = group_id[:16]
        if len(prefix) < 16:
            return None
        return self.membership.find(prefix)

    async def _wait(self, body: PlacementGroupQuery) -> Message:
        record = self.groups.get(body.group_id) or self.removed.get(body.group_id)
        if record is None:
            member = None if body.local else self._owner(body.group_id)
            if member is None:
                return Failure(FailureKind.NOT_FOUND, "ValueError",
                               f"no placement group {body.group_id!r:.60} in this cluster")
            return await self.membership.ask(member, replace_local(body))
        await record.settled.wait()
        if record.state == "CREATED":
            # get(pg.ready()) gives the group, as in Ray.
            from pmetal.actors.groups import PlacementGroup
            from pmetal.actors.serialization import pack_value
            return Result(pack_value(PlacementGroup(record.group_id, record.bundles,
                                                    record.strategy, record.name)))
        return Failure(FailureKind.PLACEMENT, "PlacementError",
                       f"placement group {record.group_id} was removed ({record.reason})")

    async def _remove(self, body: PlacementGroupQuery) -> Message:
        record = self.groups.get(body.group_id) or self.removed.get(body.group_id)
        if record is None:
            member = None if body.local else self._owner(body.group_id)
            if member is None:
                return Failure(FailureKind.NOT_FOUND, "ValueError",
                               f"no placement group {body.group_id!r:.60} in this cluster")
            return await self.membership.ask(member, replace_local(body))
        await self.remove(record, "removed by pmetal.util.remove_placement_group")
        return PlacementGroups([record.entry()])

    async def resolve(self, options: dict[str, Any], deadline: float) -> dict[str, Any] | Failure:
        """The creation ``options`` of an actor in a placement group, with
        the node of its bundle (and, for index -1, the bundle: the first
        with room, else the first that could hold it). Waits for a pending
        group until ``deadline``."""
        group_id = str(options.get("placement_group"))
        index = options.get("bundle_index", -1)
        entry = await self._entry(group_id)
        if isinstance(entry, dict) and entry.get("state") in _WAITING and not (
                type(index) is int and 0 <= index < len(entry["bundle_nodes"])
                and entry["bundle_nodes"][index]):   # (a bundle that stayed: go ahead)
            waited = await self._until_created(group_id, deadline - time.monotonic())
            entry = waited if isinstance(waited, Failure) else await self._entry(group_id)
        if isinstance(entry, Failure):
            return entry
        state = entry.get("state")
        if state not in ("CREATED", "RESCHEDULING") or (
                state == "RESCHEDULING" and index == -1):
            why = entry.get("reason") or ""
            if state == "REMOVED":
                return Failure(FailureKind.PLACEMENT, "PlacementError",
                               f"placement group {group_id} was removed ({why}); an actor "
                               f"cannot be placed in it any more: create another group")
            text = (f"placement group {group_id} is {str(state).lower()}"
                    f"{': ' + why if why else ''}; an actor can be placed in it only once it is "
                    f"created (pg.ready())")
            if state in _WAITING:
                return Failure(FailureKind.TIMEOUT, "PMetalTimeoutError",
                               f"{text}, and it was not created within the creation's deadline")
            return Failure(FailureKind.PLACEMENT, "PlacementError", text)
        bundles, nodes = entry["bundles"], entry["bundle_nodes"]
        if type(index) is not int or not -1 <= index < len(bundles):
            return Failure(FailureKind.BAD_REQUEST, "ValueError",
                           f"placement_group_bundle_index={index!r}: placement group {group_id} "
                           f"has {len(bundles)} bundles (use 0-{len(bundles) - 1}, or -1 for any)")
        from pmetal.node.placement import needs
        need = needs(options)
        if index == -1:
            held = await self._held(group_id, sorted(set(nodes)))
            fitting = [i for i in range(len(bundles)) if fits(need, bundles[i])]
            if not fitting:
                return Failure(FailureKind.PLACEMENT, "PlacementError",
                               f"the actor needs {resources_text(need)}, more than any bundle of "
                               f"placement group {group_id} holds ({bundles})")
            index = next((i for i in fitting if fits(need, held.get(i, {}))), fitting[0])
        return {**options, "bundle_index": index, "node": nodes[index], "soft": False,
                "strategy": "DEFAULT"}

    async def _entry(self, group_id: str) -> dict[str, Any] | Failure:
        record = self.groups.get(group_id) or self.removed.get(group_id)
        if record is not None:
            return record.entry()
        member = self._owner(group_id)
        if member is not None:
            reply = await self.membership.ask(member, PlacementGroupQuery(group_id, local=True))
            if isinstance(reply, PlacementGroups):
                found = [e for e in reply.groups if e.get("group_id") == group_id
                         and e.get("state") != "HELD"]
                if found:
                    return found[0]
        return Failure(FailureKind.PLACEMENT, "PlacementError",
                       f"no placement group {group_id} in this cluster (it was removed, or its "
                       f"node left)")

    async def _until_created(self, group_id: str, timeout: float) -> Failure | None:
        try:
            reply = await asyncio.wait_for(self._wait(PlacementGroupQuery(group_id, wait=True)),
                                           max(0.0, timeout))
        except asyncio.TimeoutError:
            return None
        return reply if isinstance(reply, Failure) else None

    async def _held(self, group_id: str, nodes: list[str]) -> dict[int, dict[str, float]]:
        """What the bundles of ``group_id`` have free, from their hosts."""
        query = PlacementGroupQuery(group_id, local=True)
        entries = self._local(query) if self.node_id in nodes else []
        entries += await self._ask_members(query, [n for n in nodes if n != self.node_id])
        return {int(i): pool for e in entries for i, pool in (e.get("available") or {}).items()}


def replace_local(body: PlacementGroupQuery) -> PlacementGroupQuery:
    return PlacementGroupQuery(body.group_id, body.name, body.remove, body.wait, True)


def merge(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per group from the nodes' answers: the group's node's
    entry, with the free pools of every host's bundles."""
    out: dict[str, dict[str, Any]] = {}
    for entry in entries:
        group_id = entry.get("group_id")
        if not isinstance(group_id, str):
            continue
        known = out.get(group_id)
        if known is None or (known.get("state") == "HELD" and entry.get("state") != "HELD"):
            pools = (known or {}).get("available") or {}
            out[group_id] = {**entry, "available": {**pools, **(entry.get("available") or {})}}
        else:
            known.setdefault("available", {}).update(entry.get("available") or {})
    return [e for e in out.values() if e.get("state") != "HELD"]
