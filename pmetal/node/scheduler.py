"""Cluster-wide actor placement: the master decides, under its term.

A creation travels three legs at most: the creator's node names the owner
and asks the master (:meth:`Scheduler.place`); the master picks the node
(:meth:`Scheduler.decide`: ``options.node`` if given, a node affinity, else
by :func:`~pmetal.node.placement.choose`: Ray's hybrid policy, or SPREAD;
without room now anywhere, a node that could ever hold it, where the
creation waits in that node's queue) and
stamps the creation with its term; the chosen node constructs it
(:meth:`Scheduler.placed`) unless the term is older than the newest it
knows, which it refuses (fencing: a deposed master's late decision is
void). The master checks after each await of a decision that it is still
master in the term it began in, and places only when a quorum of its
member list answered it during the decision. A node alone decides for
itself.

If the master dies mid-decision, the creator's node sees it (its detector
declares the master dead, or a new master is elected) and asks the new
master; the new master first looks the actor up (a decision of the old one
may have been carried out already) and places it only if no node has it,
and a node asked to create an actor id it already hosts answers with that
actor: an actor is created once.

The creator's node also keeps the creation of every actor it placed on
another node that may restart: when the master's list marks that node dead,
it asks the master to place the actor again (same id, next incarnation) on a
surviving node that fits it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pmetal.node.placement import NodeLoad, choose, fits, needs
from pmetal.cluster.view import MemberState, has_quorum
from pmetal.values import ActorState, FailureKind
from pmetal.wire import (ActorLocation, CreateActor, Failure, LookupActor, Message, Resources,
                         ResourcesRequest)

if TYPE_CHECKING:
    from pmetal.node.daemon import NodeDaemon
    from pmetal.node.records import ActorRecord
    from pmetal.cluster.election import ElectionState

__all__ = ["Scheduler", "SchedulerStatistics"]

log = logging.getLogger(__name__)

_ASK_RESOURCES = 2.0   # s a member may take to say what it has free


def _deposed(reply: Message) -> bool:
    """The master that decided was deposed before its decision landed: the
    target refused its stale term (the creation did not happen there), and
    the creator asks the current master instead of failing."""
    return isinstance(reply, Failure) and reply.error_type == "StaleTermError"


@dataclass
class _Placed:
    spec: CreateActor
    node_id: str
    incarnation: int
    restarts_left: int     # -1: without limit
    node_incarnation: int = -1   # of its node when placed (-1: not known)


def restarted_elsewhere(spec: CreateActor) -> bool:
    """Whether ``spec`` restarts an actor whose node was held dead (the
    scheduler gave it a new incarnation): the old copy may still run there,
    if that node was merely cut off."""
    return int(spec.options.get("incarnation") or 0) > 0


def _again(spec: CreateActor, incarnation: int, restarts_left: int) -> CreateActor:
    """``spec`` as a restart: the next incarnation, one restart fewer, and
    no node or term (the master decides again)."""
    options = dict(spec.options)
    options.pop("term", None)
    options.pop("node", None)
    options["incarnation"] = incarnation
    options["restarts_left"] = restarts_left - 1 if restarts_left > 0 else -1
    return replace(spec, options=options)


@dataclass
class _Deciding:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    placed_elsewhere: int   # actors this node's creators placed on other nodes (live records)
    restarts: int           # restarts of actors placed elsewhere, decided here
    refused_stale: int      # placements refused for carrying a stale term (fencing)


class Scheduler:
    def __init__(self, node: NodeDaemon) -> None:
        self.node = node
        self.elsewhere: dict[str, _Placed] = {}   # restartable actors placed on other nodes
        self.restarts = 0
        self.refused_stale = 0
        # Actors whose restart elsewhere is due or under way: set when done.
        self._restarting: dict[str, asyncio.Event] = {}
        # News heard (list changes and our detector's verdicts; not the
        # decisions taken again on them): a restart that failed while news
        # came in decides again, once (see _restart).
        self._news = 0
        # Actor id (or "name:" and its name) -> the decisions under way for it.
        self._deciding: dict[str, _Deciding] = {}
        # Node id -> the needs of creations this master sent there and has
        # not heard back about: counted as placed, so that concurrent
        # decisions do not all read the same stale resources.
        self._sent: dict[str, list[dict[str, float]]] = {}

    # ------------------------------------------------------------ creator

    async def place(self, spec: CreateActor) -> Message:
        """Place a creation this node named the owner of (see module doc)."""
        node = self.node
        if spec.options.get("placement_group"):
            # In a placement group: on the node of its bundle (pmetal.node.groups).
            timeout = float(spec.options.get("timeout") or node.config.transport.request_timeout)
            options = await node.groups.resolve(spec.options, time.monotonic() + timeout)
            if isinstance(options, Failure):
                return options
            spec = replace(spec, options=options)
        if not node.membership.members and (not node.cluster.master or
                                            node.cluster.is_master()):
            target = spec.options.get("node") or ""
            if target and (node.node_id.startswith(target) or spec.options.get("soft")):
                # Alone: this node (named by a prefix), or a soft affinity
                # to another node, which falls back here.
                spec = replace(spec, options={**spec.options, "node": node.node_id})
            return await node.actors.create(spec)   # alone: nobody else to decide
        timeout = float(spec.options.get("timeout") or node.config.transport.request_timeout)
        deadline = time.monotonic() + timeout
        reply = await self._via_master(spec, deadline)
        if isinstance(reply, ActorLocation):
            self._remember(spec, reply)
        return reply

    async def _via_master(self, spec: CreateActor, deadline: float) -> Message:
        node = self.node
        while True:
            master = await node.cluster.wait_master(deadline)
            if not master:
                return Failure(FailureKind.PLACEMENT, "PlacementError",
                               f"no master was elected within the creation's deadline: this "
                               f"node sees {1 + len(node.membership.members)} of the "
                               f"{len(node.cluster.state.members)} members (a master needs a "
                               f"majority); check the network, or 'pmetal status'")
            if master == node.node_id:
                reply = await self.decide(spec, origin=node.node_id)
                if not _deposed(reply) or time.monotonic() >= deadline:
                    return reply
                # This node decided as master, but a newer master's term had
                # already reached the target: ask again under the new term.
                log.info("placing actor %s: this node's term was stale; asking the new "
                         "master", spec.actor_id)
                await asyncio.sleep(node.config.health.interval)
                continue
            member = node.membership.members.get(master)
            if member is None:
                if time.monotonic() >= deadline:
                    return Failure(FailureKind.TIMEOUT, "PMetalTimeoutError",
                                   f"the master {master[:8]} is not in this node's member list "
                                   f"yet; the creation's deadline passed")
                await asyncio.sleep(node.config.health.interval)   # the view is on its way
                continue
            ask = asyncio.ensure_future(node.membership.ask(member, spec))
            gone = asyncio.ensure_future(node.cluster.until_gone(master))
            try:
                await asyncio.wait((ask, gone), timeout=max(0.0, deadline - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (ask, gone):
                    task.cancel()
            if ask.done() and not ask.cancelled():
                reply = ask.result()
                if not (isinstance(reply, Failure) and reply.error_type == "NotMasterError"):
                    if not ((isinstance(reply, Failure) and master in node.cluster.dead())
                            or (_deposed(reply) and time.monotonic() < deadline)):
                        return reply
            elif time.monotonic() >= deadline:
                return Failure(FailureKind.TIMEOUT, "PMetalTimeoutError",
                               f"the master {master[:8]} did not place the actor in time")
            log.info("master %s went while placing actor %s; asking the next master",
                     master[:8], spec.actor_id)
            await asyncio.sleep(node.config.health.interval)

    def _remember(self, spec: CreateActor, loc: ActorLocation) -> None:
        node = self.node
        if loc.node_id == node.node_id:
            return
        node.owners.forwarded(spec.options, loc.node_id)
        restarts = int(spec.options.get("restarts_left", spec.options.get("max_restarts") or 0))
        if restarts != 0:
            self.elsewhere[spec.actor_id] = _Placed(
                spec, loc.node_id, loc.incarnation, restarts,
                loc.node_incarnation or self._node_incarnations().get(loc.node_id, -1))

    # ------------------------------------------------------------- master

    async def decide(self, spec: CreateActor, origin: str) -> Message:
        """Place ``spec`` as master, under the term this node is master in.

        Every await gives the election a chance to move on: after each one
        the decision checks that this node is still master in the same term
        (a master that stepped down, or one re-elected in a newer term, must
        not carry out a decision it began in an older one). The members'
        answers about their resources double as a quorum check made for
        this decision: a master that cannot reach a quorum of its member
        list now (the minority side of a partition that check-quorum has
        not stepped down yet) places nothing. Decisions for one actor id run
        one at a time, so the second finds what the first placed; so do
        decisions for one actor name, whatever nodes they choose, so that
        the second one's node finds the first's actor by that name and
        refuses (two nodes asked at once would both take it)."""
        node = self.node
        refused = self._not_master(None)
        if refused is not None:
            return refused
        term = node.cluster.term
        name = spec.options.get("name") or ""
        key = f"name:{name}" if name else spec.actor_id
        deciding = self._deciding.setdefault(key, _Deciding())
        deciding.waiting += 1
        try:
            async with deciding.lock:
                return await self._decide(spec, origin, term)
        finally:
            deciding.waiting -= 1
            if not deciding.waiting:
                del self._deciding[key]

    async def _decide(self, spec: CreateActor, origin: str, term: int) -> Message:
        node = self.node
        if (refused := self._not_master(term)) is not None:
            return refused
        # Exactly once: a previous master may have placed it already (then
        # wait for its constructor, as the creator would have).
        timeout = float(spec.options.get("timeout") or node.config.transport.request_timeout)
        existing = await self._existing(spec.actor_id, timeout)
        if (refused := self._not_master(term)) is not None:
            return refused
        if existing is not None:
            return existing
        options = dict(spec.options)
        free = await self._free()
        if (refused := self._not_master(term)) is not None:
            return refused
        heard = set(free)
        voters = [m.node_id for m in node.cluster.state.members] or [node.node_id]
        if not has_quorum(heard, voters, node.cluster.dead()):
            return Failure(FailureKind.PLACEMENT, "NotMasterError",
                           f"node {node.node_id[:8]} is master in term {term} but only "
                           f"{len(heard & set(voters))} of its {len(voters)} members answered "
                           f"it now (a minority side places nothing); ask again once a master "
                           f"with a majority is elected")
        target = self._target(options, free, origin)
        if isinstance(target, Failure):
            return target
        member = node.membership.find(target) if target != node.node_id else None
        options["node"] = target
        options["term"] = term
        log.info("master places actor %s on node %s (term %d)", spec.actor_id,
                 options["node"][:8], term)
        placed = replace(spec, options=options)
        need = needs(options)
        sent = self._sent.setdefault(target, [])
        sent.append(need)
        try:
            if member is None:
                return await node.actors.create(placed)
            return await node.membership.ask(member, placed)
        finally:
            sent.remove(need)
            if not sent:
                self._sent.pop(target, None)

    def _target(self, options: dict[str, Any], free: dict[str, NodeLoad],
                origin: str) -> str | Failure:
        """The node for a creation with ``options``, given what the nodes
        that answered have ``free``: its node affinity (``node``, with
        ``soft`` falling back to the policy when that node is unknown, dead
        or full), else :func:`choose`."""
        node = self.node
        need = needs(options)
        wanted = options.get("node") or ""
        if wanted:
            member = node.membership.find(wanted)
            found = node.node_id if node.node_id.startswith(wanted) else (
                member.node_id if member is not None else "")
            dead = next((n for n in node.cluster.dead() if n.startswith(wanted)), "")
            if found and not dead and not (options.get("soft") and not (
                    found in free and fits(need, free[found].available))):
                return found
            if not options.get("soft"):
                why = "is dead" if dead else "is not a member of this cluster"
                return Failure(FailureKind.PLACEMENT, "PlacementError",
                               f"node affinity: node {wanted} {why}; live nodes: {sorted(free)} "
                               f"(pmetal.nodes() lists them; soft=True falls back to another "
                               f"node)")
        target = choose(free, need, origin, str(options.get("strategy") or "DEFAULT"))
        if not target:
            total = node.membership.total_resources(node.resources)
            return Failure(FailureKind.PLACEMENT, "PlacementError",
                           f"no node of this cluster could ever hold the actor: it needs "
                           f"{need}; the cluster has {total}")
        return target

    def _not_master(self, term: int | None) -> Failure | None:
        """Why this node may not (go on to) decide in ``term``, or None."""
        cluster = self.node.cluster
        if not cluster.is_master():
            return Failure(FailureKind.PLACEMENT, "NotMasterError",
                           f"node {self.node.node_id[:8]} is not the master (the master is "
                           f"{cluster.master[:8] or 'not known'}); ask the master")
        if term is not None and cluster.term != term:
            self.refused_stale += 1
            return Failure(FailureKind.PLACEMENT, "StaleTermError",
                           f"node {self.node.node_id[:8]} began this decision as master in "
                           f"term {term} and is now in term {cluster.term}; ask again")
        return None

    async def _existing(self, actor_id: str, wait: float) -> Message | None:
        node = self.node
        record = node.actors.actors.get(actor_id)
        if record is not None and record.state != ActorState.DEAD:
            return await node.actors.lookup(LookupActor(actor_id=actor_id, wait=wait))
        found = await node.membership.find_actor(LookupActor(actor_id=actor_id, wait=wait))
        if found is not None and found.live:
            return found
        return None

    async def _free(self) -> dict[str, NodeLoad]:
        """What each node that answers has (this node first; a member that
        does not answer is left out), with the creations this master sent
        it and has not heard back about counted as placed."""
        node = self.node
        members = list(node.membership.members.values())
        answers = await asyncio.gather(*(
            asyncio.wait_for(node.membership.ask(m, ResourcesRequest()), _ASK_RESOURCES)
            for m in members), return_exceptions=True)
        free = {node.node_id: NodeLoad(dict(node.actors.available), node.resources,
                                       len(node.actors.queue), node.actors.alive())}
        for m, a in zip(members, answers):
            if isinstance(a, Resources):
                free[m.node_id] = NodeLoad(a.available, a.total, a.queued, a.actors)
        for node_id, sent in self._sent.items():
            if node_id in free:
                for need in sent:
                    free[node_id] = free[node_id].plus(need)
        return free

    # ---------------------------------------------------------- placed here

    async def placed(self, spec: CreateActor, sender: str) -> Message:
        """A creation the master placed on this node: construct it unless
        the term is stale (a deposed master)."""
        node = self.node
        term = int(spec.options.get("term") or 0)
        if term < node.cluster.term:
            self.refused_stale += 1
            return Failure(FailureKind.PLACEMENT, "StaleTermError",
                           f"refused a placement of term {term} from {sender[:8]}: the current "
                           f"term is {node.cluster.term} (a master that was deposed); ask the "
                           f"current master")
        return await node.actors.create(spec)

    # ----------------------------------------------------------- restarts

    def view_changed(self, state: ElectionState) -> None:
        """Restart the actors this node placed on a node the master's list
        now holds dead, or no longer lists while this node's detector holds
        it dead too. (A node merely missing from a list, as in a view adopted
        during a merge, may be alive: restarting its actors would make two.)"""
        self._news += 1
        self._restart_lost(state)

    def node_dead(self, node_id: str) -> None:
        """This node's detector declared ``node_id`` dead: restart what we
        placed there if the master's list no longer lists it (if it does,
        the master marks it dead and view_changed restarts)."""
        self._news += 1
        self._restart_lost(self.node.cluster.state)

    def _node_incarnations(self, state: ElectionState | None = None) -> dict[str, int]:
        state = state or self.node.cluster.state
        return {m.node_id: m.incarnation for m in state.members}

    def _restart_lost(self, state: ElectionState) -> None:
        listed = {m.node_id: m.state for m in state.members}
        incarnations = self._node_incarnations(state)
        dead = self.node.cluster.dead()
        # Gone: its node is held dead, or no longer listed and dead to our
        # detector, or listed as a newer incarnation of itself (it was
        # fenced and rejoined: the fence ended its actors, whether or not
        # this node saw the list that held it dead).
        gone = [p for p in self.elsewhere.values()
                if listed.get(p.node_id) == MemberState.DEAD
                or (p.node_id not in listed and p.node_id in dead)
                or 0 <= p.node_incarnation < incarnations.get(p.node_id, -1)]
        for p in gone:
            del self.elsewhere[p.spec.actor_id]
            if not self._owner_alive(p.spec):
                continue
            if p.restarts_left == 0:
                continue
            log.info("node %s is dead: restarting actor %s (incarnation %d) elsewhere",
                     p.node_id[:8], p.spec.actor_id, p.incarnation + 1)
            self._start_restart(_again(p.spec, p.incarnation + 1, p.restarts_left), lost=p)

    def place_again(self, record: ActorRecord) -> None:
        """This node was fenced while it ran ``record``, an actor it owns
        that replaced a copy on a node then held dead (which may have been
        merely cut off): once the record is dead, ask the master to place
        it again. The master looks it up first and answers with the copy
        that survived on its side, if any; else it is restarted."""
        log.info("fenced: placing actor %s again through the master (a copy may survive "
                 "elsewhere)", record.spec.actor_id)
        self._start_restart(_again(record.spec, record.incarnation + 1, record.restarts_left),
                            after=record)

    def _start_restart(self, spec: CreateActor, after: ActorRecord | None = None,
                       lost: _Placed | None = None) -> None:
        self.restarts += 1
        self._restarting.setdefault(spec.actor_id, asyncio.Event())
        self.node._cancellable_task(self._restart(spec, after, lost))

    async def _restart(self, spec: CreateActor, after: ActorRecord | None = None,
                       lost: _Placed | None = None) -> None:
        news = self._news
        try:
            if after is not None:
                # The copy here must be gone before the master looks for one.
                deadline = time.monotonic() + self.node.config.transport.request_timeout
                while after.state != ActorState.DEAD and time.monotonic() < deadline:
                    try:
                        await asyncio.wait_for(after.changed.wait(),
                                               deadline - time.monotonic())
                    except asyncio.TimeoutError:
                        break
            reply = await self.place(spec)
            deadline = time.monotonic() + self.node.config.transport.request_timeout
            while (isinstance(reply, Failure) and reply.error_type == "PeerError"
                   and time.monotonic() < deadline):
                # The node it was placed on died (or was fenced) before it
                # answered: place it again, without waiting for the list's
                # next change, which may not come.
                log.info("restart of actor %s: %s; placing it again", spec.actor_id,
                         reply.message)
                await asyncio.sleep(self.node.config.health.interval)
                reply = await self.place(spec)
        finally:
            done = self._restarting.pop(spec.actor_id, None)
            if done is not None:
                done.set()
        if not isinstance(reply, ActorLocation):
            log.warning("could not restart actor %s: %s", spec.actor_id,
                        getattr(reply, "message", reply))
            if lost is not None and spec.actor_id not in self.elsewhere:
                # (No master would place it: a minority side, whose copy
                # may well live on.) Keep it, so that the next change of the
                # member list decides again: restart if its node is still
                # held dead, nothing if the node is back.
                self.elsewhere[spec.actor_id] = lost
                if self._news != news:
                    # News came while it was being placed, and found it in
                    # nobody's hands (the list held its node dead before
                    # our detector did, so its placement group still named
                    # that node): decide again with what is known now.
                    self._restart_lost(self.node.cluster.state)

    async def lookup(self, body: LookupActor) -> Message:
        """A lookup that waits (up to ``body.wait``) for the restart of an
        actor this node placed on a node that died, rather than answering
        "no such actor" between the death and the restart.

        A peer's query (``local``: "your own actors only") is answered from
        this node's actors at once: the master asks every member before it
        places a restart, and waiting here for that very restart deadlocked
        the two until the creation's deadline (a restart took 20.8 s).

        A restart still under way when the wait is up is answered as
        "restarting" (not "no such actor", which made a caller give up on
        an actor whose restart was only slow: the actor of a lost
        placement-group bundle, restarted once its bundle is placed again)."""
        node = self.node
        if body.local:
            return await node.actors.lookup(body)
        placed = self.elsewhere.get(body.actor_id)
        deadline = time.monotonic() + body.wait
        while placed is not None and placed.node_id in node.cluster.dead() \
                and body.actor_id in self.elsewhere:
            # Dead to our detector; the master's list (and the restart) follows.
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(node.cluster.changed(), remaining)
            except asyncio.TimeoutError:
                break
        waiting = self._restarting.get(body.actor_id)
        if waiting is not None:
            try:
                await asyncio.wait_for(waiting.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                # Still being placed (a new master to elect, its placement
                # group's bundle to place again, a worker to start under
                # load): say so, rather than "no such actor", so that the
                # caller waits on (its restart has a deadline of its own).
                return ActorLocation(body.actor_id, ActorState.RESTARTING,
                                     reason="its restart is being placed by its creator's node")
        return await node.actors.lookup(body)

    def _owner_alive(self, spec: CreateActor) -> bool:
        from pmetal import shm
        pid = int(spec.options.get("owner_pid") or 0)
        if pid:
            return shm.pid_alive(pid)
        client = spec.options.get("owner_client") or ""
        return not client or client in self.node.owners.leases

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(len(self.elsewhere), self.restarts, self.refused_stale)
