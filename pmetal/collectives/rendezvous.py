"""How the actors of a collective group find each other: the machinery
behind :mod:`pmetal.collective`.

A group is a list of actors in rank order and a :class:`Formation`: the
schedule (strategy, ring order, chunk size), the master's term and the
membership epoch at the time the group formed, and the group's own epoch,
which grows each time the group forms anew under the same name. The
formation lives in a **rendezvous actor** (:class:`Rendezvous`, an async,
detached pmetal actor named ``pmetal-collective:<name>``, like Ray's
collective "Info" actor), started by :func:`form` on the master's node.

- :func:`form` (the driver's ``create_group``) sends the request (members
  in rank order, their nodes, the :class:`~pmetal.config.CollectiveConfig`,
  which may force the strategy and chunk size) to the rendezvous actor.
  There, on the master's node, :meth:`Rendezvous.form` reads the cluster
  as that node knows it (term, membership epoch, the topology's link
  figures), orders the ring by
  :meth:`~pmetal.cluster.topology.ClusterTopology.best_ring` over the
  members' nodes (members of one node side by side; rank order when the
  members share one node or the topology lacks one of them) and stamps
  the formation. The same request again returns the formation there is,
  unless an operation failed in it; anything else makes a new one
  (epoch + 1, a fresh formation id).
- :func:`~pmetal.collectives.actorgroup.join_group` (``get_group`` inside a
  member's method; the member side lives in :mod:`pmetal.collectives.actorgroup`) fetches the
  formation, finds the caller's rank from its actor id, listens on its
  worker's host (port 0), registers the address with the rendezvous actor
  and waits there (bounded by ``connect_timeout``) for every member, then
  connects the full mesh (:func:`~pmetal.links.tcplinks.connect_mesh`)
  with the namespace's PSK, bound to a tag of the name, formation id,
  term and both epochs. Members then exchange data directly.
- The :class:`~pmetal.collectives.actorgroup.ActorGroup` it returns is a
  :class:`~pmetal.collectives.group.Group`
  cached per process and name. An operation that fails (a member died or
  stalled) closes this rank's connections, so every other member's
  operation fails at once instead of at its timeout, and tells the
  rendezvous actor: the formation is spent, and the driver forms the group
  again over the live members (the same members too, when the one that
  failed was only stalled).
  A member that holds a formation older than the rendezvous actor's (or a
  group since destroyed) is refused with a :class:`CollectiveError` that
  says so.

The rendezvous actor stays on the node that was master when the group
first formed: after an election it goes on scheduling the group from that
node's view, which follows the new master's term. If that node dies, the
members keep their connections but ``get_group`` and ``create_group``
start over with a new rendezvous actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pmetal.actors import context
from pmetal.actors.handles import ActorClass, ActorHandle
from pmetal.links import tcplinks
from pmetal.collectives.group import Schedule
from pmetal.config import CollectiveConfig
from pmetal.errors import (
    ActorDiedError,
    CollectiveError,
    PMetalError,
    PMetalTypeError,
    PMetalValueError,
    RemoteError,
)
from pmetal.values import ActorState

__all__ = ["RENDEZVOUS_PREFIX", "Formation", "Rendezvous", "destroy", "form", "ring_order",
           "slowest_link"]

log = logging.getLogger(__name__)

RENDEZVOUS_PREFIX = "pmetal-collective:"
"""The rendezvous actor of group ``name`` is named ``RENDEZVOUS_PREFIX + name``."""

_ASK_MARGIN = 5.0  # s a request to the rendezvous actor may take beyond its own wait
_EXPLAIN_WAIT = 2.0  # s to ask why an operation failed before raising what we have
_MASTER_WAIT = 10.0  # s to wait for an election before starting a rendezvous actor anyway


@dataclass(frozen=True)
class Formation:
    """One formation of a group, as the rendezvous actor records it.
    ``members`` are actor ids in rank order, ``nodes`` each member's node;
    ``schedule.term`` is the master's term and ``cluster_epoch`` the
    membership epoch when it formed; ``epoch`` counts the formations of
    this name (``schedule.epoch`` too). ``link_encryption``: the creator's
    setting (:class:`~pmetal.config.CollectiveConfig`), which every member
    applies to its links."""
    name: str
    epoch: int
    formation_id: str
    members: tuple[str, ...]
    nodes: tuple[str, ...]
    schedule: Schedule
    cluster_epoch: int
    timeout: float
    connect_timeout: float
    link_encryption: str = "auto"

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def tag(self) -> bytes:
        """What both sides of every connection must agree on: another
        group, formation or master term is refused at the handshake."""
        return tcplinks.group_tag(f"{self.name}|{self.formation_id}|{self.cluster_epoch}",
                                  self.schedule.term, self.epoch)

    def rank_of(self, actor_id: str) -> int | None:
        try:
            return self.members.index(actor_id)
        except ValueError:
            return None



# ----------------------------------------------------------- the actor

class Rendezvous:
    """The rendezvous actor of one group (see the module docstring). Its
    methods are coroutines, so the members' ``join`` calls wait side by
    side."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.formation: Formation | None = None
        self._request: Formation | None = None  # what the caller asked for it
        self._forming = asyncio.Lock()
        self._epochs = 0
        self._joined: dict[int, tuple[str, int]] = {}
        self._complete = False
        self._failed = False
        self._changed = asyncio.Condition()
        self._enrolled: dict[str, str] = {}  # SPMD processes waiting: key -> node
        self._enrolment_world = 0

    def cluster_view(self) -> dict[str, Any]:
        """The cluster as this actor's node knows it: the master's term,
        the membership epoch, the topology (blocking: run in a thread).
        The one piece of I/O of the schedule; tests override it."""
        cluster: dict[str, Any] = context.current().status().get("cluster") or {}
        return cluster

    async def form(self, request: Formation) -> Formation:
        """Form the group ``request`` asks for (members, nodes, settings;
        its term, order and epochs are decided here), or return the
        formation there is when the request is the same and nothing failed
        in it."""
        async with self._forming:
            current = self.formation
            if current is not None and request == self._request and not self._failed:
                return current
            cluster = await asyncio.to_thread(self.cluster_view)
            if cluster.get("role") not in (None, "master"):
                log.info("collective group %r is scheduled on a node that is not the master "
                         "(it was when the group first formed); term %s", self.name,
                         cluster.get("term"))
            self._epochs += 1
            order = ring_order(request.nodes, cluster.get("topology"))
            schedule = dataclasses.replace(
                request.schedule, epoch=self._epochs, term=int(cluster.get("term") or 0),
                order=order).with_links(
                    slowest_link([request.nodes[r] for r in order], cluster.get("topology")))
            formation = dataclasses.replace(
                request, epoch=self._epochs, schedule=schedule,
                cluster_epoch=int(cluster.get("epoch") or 0), formation_id=secrets.token_hex(8))
            async with self._changed:
                self.formation, self._request = formation, request
                self._joined = {}
                self._complete = False
                self._failed = False
                self._changed.notify_all()
        log.info("collective group %r formed: epoch %d, %d members, term %d, ring %s",
                 self.name, formation.epoch, formation.size, schedule.term, schedule.order)
        return formation

    async def enroll(self, key: str, node: str, request: Formation,
                     timeout: float) -> Formation:
        """An SPMD process (:mod:`pmetal.collectives.autodiscovery`) asks to
        be one of ``request.schedule.world`` ranks. The last to enroll
        forms the group over all of them, ranks ordered by node id then
        key; every enrolled process gets that formation."""
        world = request.schedule.world
        async with self._changed:
            if self._enrolled and world != self._enrolment_world:
                raise CollectiveError(
                    f"group {self.name!r}: this process expects a world of {world}, the "
                    f"processes enrolled before it {self._enrolment_world}; every process "
                    "must wait for the same number of peers")
            self._enrolment_world = world
            self._enrolled[key] = node
            self._changed.notify_all()
            complete = len(self._enrolled) >= world
            members = sorted(self._enrolled, key=lambda k: (self._enrolled[k], k))
            if complete:
                self._enrolled = {}
        if complete:
            nodes = tuple(key.split(":", 1)[0] for key in members)
            return await self.form(dataclasses.replace(request, members=tuple(members),
                                                       nodes=nodes))
        async with self._changed:
            try:
                async with asyncio.timeout(timeout):
                    await self._changed.wait_for(
                        lambda: self.formation is not None and key in self.formation.members)
            except TimeoutError:
                self._enrolled.pop(key, None)
                raise CollectiveError(
                    f"group {self.name!r}: {len(self._enrolled) + 1} of {world} processes "
                    f"enrolled within {timeout:g} s; the others did not start, or wait for "
                    "another number of peers") from None
            assert self.formation is not None
            return self.formation

    async def current(self) -> Formation | None:
        return self.formation

    async def failed(self, formation_id: str) -> Formation | None:
        """A member's operation failed in formation ``formation_id``: it is
        spent, so forming the group again, even over the same members (a
        member that stalled and came back), makes a new formation. Returns
        the current formation."""
        if self.formation is not None and self.formation.formation_id == formation_id:
            if not self._failed:
                log.info("collective group %r: an operation failed in epoch %d", self.name,
                         self.formation.epoch)
            self._failed = True
        return self.formation

    async def join(self, formation_id: str, rank: int, address: tuple[str, int],
                   timeout: float) -> list[tuple[str, int]]:
        """Register ``rank``'s listening address; return every member's,
        in rank order, once all have registered (or raise)."""
        formation = self._check(formation_id, rank)
        if self._complete:
            raise CollectiveError(
                f"rank {rank} of collective group {self.name!r} joins epoch "
                f"{formation.epoch} again after every member connected (its process "
                "restarted, or its get_group failed): form the group again from the "
                "driver with create_group")
        address = (str(address[0]), int(address[1]))
        async with self._changed:
            self._joined[rank] = address
            self._changed.notify_all()
            try:
                async with asyncio.timeout(timeout):
                    await self._changed.wait_for(
                        lambda: self.formation is not formation
                        or len(self._joined) == formation.size)
            except TimeoutError:
                missing = [r for r in range(formation.size) if r not in self._joined]
                if self._joined.get(rank) == address:
                    del self._joined[rank]  # its listener closes with the failure
                raise CollectiveError(
                    f"collective group {self.name!r} (epoch {formation.epoch}): rank "
                    f"{rank} waited {timeout:g} s for rank(s) {missing} to call "
                    f"get_group({self.name!r}); those actors ("
                    f"{', '.join(formation.members[r] for r in missing)}) did not call it "
                    "in time, or died") from None
            self._check(formation_id, rank)
            self._complete = True
            return [self._joined[r] for r in range(formation.size)]

    def _check(self, formation_id: str, rank: int) -> Formation:
        formation = self.formation
        if formation is None or formation.formation_id != formation_id:
            epoch = formation.epoch if formation is not None else "none"
            raise CollectiveError(
                f"collective group {self.name!r} formed again (now epoch {epoch}) while "
                f"rank {rank} joined an older formation: a stale epoch is refused; call "
                f"get_group({self.name!r}) again")
        if not 0 <= rank < formation.size:
            raise PMetalValueError(f"rank {rank} is not in collective group {self.name!r} "
                                   f"of {formation.size}")
        return formation


# ----------------------------------------------------- driver side

def ring_order(nodes: Sequence[str], topology: dict[str, Any] | None) -> tuple[int, ...]:
    """The ring order of ranks whose actors live on ``nodes``: the nodes
    in the order of the topology's best ring, the ranks of one node side
    by side (in rank order); rank order when the ranks share one node or
    the topology does not know every node."""
    distinct = sorted(set(nodes))
    if len(distinct) < 2 or not topology:
        return tuple(range(len(nodes)))
    from pmetal.cluster.topology import ClusterTopology, NodeProfile
    graph = ClusterTopology()
    for profile in topology.get("nodes") or []:
        graph.add_node(NodeProfile.from_dict(profile))
    if any(n not in graph for n in distinct):
        log.debug("ring order: the topology lacks some of %s; using rank order", distinct)
        return tuple(range(len(nodes)))
    for link in topology.get("links") or []:
        graph.update_link(link["a"], link["b"], link.get("latency"), link.get("bandwidth"),
                          now=float(link.get("measured_at") or 0.0))
    position = {node: i for i, node in enumerate(graph.best_ring(distinct))}
    return tuple(sorted(range(len(nodes)), key=lambda r: (position[nodes[r]], r)))


def slowest_link(ring: Sequence[str], topology: dict[str, Any] | None) -> float | None:
    """The smallest measured bandwidth (bytes/s) between consecutive
    distinct nodes of ``ring`` (cyclic), or None when no such link has a
    figure (one node, or nothing probed yet)."""
    nodes = [n for i, n in enumerate(ring) if i == 0 or n != ring[i - 1]]
    if len(nodes) > 1 and nodes[0] == nodes[-1]:
        nodes.pop()
    if len(nodes) < 2 or not topology:
        return None
    figures = {frozenset((link["a"], link["b"])): link.get("bandwidth")
               for link in topology.get("links") or []}
    pairs = {frozenset((a, b)) for a, b in zip(nodes, nodes[1:] + nodes[:1]) if a != b}
    known = [figures[p] for p in pairs if figures.get(p)]
    return min(known) if known else None


def _check_name(name: Any) -> str:
    if type(name) is not str:
        raise PMetalTypeError(f"a collective group's name is a str, not {type(name).__name__}")
    if not name:
        raise PMetalValueError("a collective group needs a non-empty name")
    return name


def _ask(client: Any, handle: ActorHandle, method: str, *args: Any, timeout: float) -> Any:
    """``handle.method(*args)``'s result; a CollectiveError raised there is
    raised here as itself (not wrapped in its remote traceback)."""
    ref = client.call(handle, method, list(args), {})
    try:
        return client.get_one(ref, timeout)
    except CollectiveError as exc:
        if isinstance(exc, RemoteError):
            raise CollectiveError(exc.remote_message) from exc
        raise


def _rendezvous(client: Any, name: str) -> ActorHandle | None:
    """The group's rendezvous actor, or None when there is none. A handle
    found while another process still creates it is fine: its first call
    waits for that construction."""
    try:
        loc = client.lookup(name=RENDEZVOUS_PREFIX + name)
    except PMetalValueError:
        return None
    if loc.state == ActorState.DEAD:
        return None
    return ActorHandle(loc)


def form(actors: Sequence[ActorHandle], name: str,
         config: CollectiveConfig | None = None) -> tuple[Formation, ActorHandle]:
    """Form (or find) group ``name`` over ``actors`` in rank order; see
    :func:`pmetal.collective.create_group`."""
    _check_name(name)
    handles = list(actors) if isinstance(actors, (list, tuple)) else None
    if not handles or not all(isinstance(h, ActorHandle) for h in handles):
        raise PMetalTypeError("create_group takes a non-empty list of actor handles, one per "
                              f"rank, not {actors!r:.80}")
    ids = tuple(h._actor_id for h in handles)
    if len(set(ids)) != len(ids):
        raise PMetalValueError(f"create_group({name!r}): an actor is listed twice; each rank "
                               "is a different actor")
    if config is not None and not isinstance(config, CollectiveConfig):
        raise PMetalTypeError(f"config must be a CollectiveConfig, not {type(config).__name__}")
    client = context.current()
    if config is None:
        config = client.config.collectives
    # What the caller decides: members and settings. Term, epochs and ring
    # order are the rendezvous actor's, on the master's node.
    request = Formation(name, 0, "", ids, tuple(h._node_id for h in handles),
                        Schedule.from_config(name, len(handles), config), 0, config.timeout,
                        config.connect_timeout, config.link_encryption)
    timeout = client.config.transport.request_timeout
    rendezvous = _rendezvous(client, name)
    if rendezvous is not None:
        try:
            return _ask(client, rendezvous, "form", request, timeout=timeout), rendezvous
        except ActorDiedError:
            # Its node died (the master it started on): start over on the
            # current master; the members' get_group finds the new one.
            log.info("the rendezvous actor of collective group %r died; starting another",
                     name)
    rendezvous = _start_rendezvous(client, name)
    return _ask(client, rendezvous, "form", request, timeout=timeout), rendezvous


def _start_rendezvous(client: Any, name: str) -> ActorHandle:
    """Start group ``name``'s rendezvous actor on the master's node, so that
    the master schedules the group."""
    master = _master(client, time.monotonic()
                     + min(_MASTER_WAIT, client.config.transport.request_timeout))
    options = {"name": RENDEZVOUS_PREFIX + name, "lifetime": "detached", "node": master}
    try:
        return ActorClass(Rendezvous, options).remote(name)
    except (PMetalError, ValueError) as exc:
        # Another process may be making it at the same moment (the SPMD
        # processes of an AutoDiscoveryBackend all try): use that one once
        # it exists.
        deadline = time.monotonic() + client.config.transport.request_timeout
        while time.monotonic() < deadline:
            rendezvous = _rendezvous(client, name)
            if rendezvous is not None:
                return rendezvous
            time.sleep(0.05)  # bounded by the deadline; the creation is elsewhere
        raise CollectiveError(f"cannot start the rendezvous actor of collective group "
                              f"{name!r} on the master's node {master[:8]}: {exc}") from exc


def _master(client: Any, deadline: float) -> str:
    """The master's node id. While the cluster elects one (its master just
    died, say with a group's rendezvous actor), wait for it until
    ``deadline``: the master's node is the one place where two processes
    starting the same rendezvous actor at once get one actor, not one each
    (an actor's name is unique only where it is created). "" when none came."""
    master = (client.status().get("cluster") or {}).get("master") or ""
    if not master and client.watch.wait(lambda state: bool(state.master), deadline):
        master = client.watch.state.master
    return master


def destroy(name: str) -> bool:
    """Kill group ``name``'s rendezvous actor and close this process's
    membership of it; False when there was no such group."""
    _check_name(name)
    from pmetal.collectives.actorgroup import local_groups  # the member side imports us
    local_groups.drop(name, "the group was destroyed")
    client = context.current()
    rendezvous = _rendezvous(client, name)
    if rendezvous is None:
        return False
    client.kill(rendezvous._actor_id, True, rendezvous._node_id)
    # A kill takes effect when the process is gone: wait for that (no
    # incarnation ever reaches this one), so that a create_group right
    # after this finds no rendezvous actor and makes a new one.
    client.lookup(actor_id=rendezvous._actor_id, min_incarnation=1 << 62,
                  wait=client.config.transport.request_timeout)
    return True
