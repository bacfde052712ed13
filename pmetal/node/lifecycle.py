"""The life of the actors a node hosts: placement, construction, restarts,
lookups and kills.

:class:`ActorLifecycle` owns the node's actor records (:mod:`pmetal.node.records`),
its resources and the queue of creations waiting for them
(:mod:`pmetal.node.placement`). A creation is placed here if it fits
(queued while it fits this node but not now), else on a member with room,
else queued where it could ever fit; the constructor runs in an idle worker
of the pool, and a worker's death restarts the actor it hosted while
restarts remain. The node daemon (:mod:`pmetal.node.daemon`) decides who
owns a creation and hands requests here; it never touches a record itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from pmetal.node.membership import Member, Membership
from pmetal.node.placement import PlacementQueue, fits, needs, resources_text
from pmetal.node.pool import WorkerPool, WorkerProc
from pmetal.node.records import ActorRecord, ActorTable, exit_text
from pmetal.config import PMetalConfig
from pmetal.errors import PMetalError, PMetalTimeoutError
from pmetal.values import ActorState, FailureKind
from pmetal.wire import (Ack, ActorLocation, CreateActor, Failure, InitActor, KillActor,
                         LookupActor, Message, Resources, ResourcesRequest)

__all__ = ["ActorLifecycle"]

log = logging.getLogger(__name__)

_REPLY_MARGIN = 0.5
"""s before the creator's deadline at which a queued creation gives up, so
that its answer (a clear timeout) arrives before the creator stops waiting."""

_ASK_RESOURCES = 2.0
"""s a member may take to say what it has free before placement skips it."""

_KILL_WAIT = 2.0
"""s pmetal.kill waits for the actor's process to exit before it answers."""

Spawn = Callable[[Coroutine[Any, Any, Any]], None]


class ActorLifecycle:
    """The actors of one node, from creation to death."""

    def __init__(self, config: PMetalConfig, node_id: str, resources: dict[str, float],
                 pool: WorkerPool, membership: Membership, spawn: Spawn,
                 on_forwarded: Callable[[dict[str, Any], str], None]) -> None:
        self.config = config
        self.node_id = node_id
        self.resources = resources
        self.available = dict(resources)
        self.queue = PlacementQueue(self.available)
        self.pool = pool
        self.membership = membership
        self.table = ActorTable()
        self.actors = self.table.actors   # actor id -> record (dead ones: the last DEAD_TAIL)
        self.names = self.table.names     # name -> actor id
        self._claiming: set[str] = set()   # names being looked up on the peers
        # spawn: a task the node's shutdown cancels (restarts); on_forwarded:
        # told of each creation passed on to a member (its owner's node must
        # tell that member when the owner dies).
        self._spawn = spawn
        self._on_forwarded = on_forwarded
        self._counts = {"created": 0, "restarts": 0}
        # The newest election term this node knows (the node sets it): a
        # creation a master stamped with an older term is refused.
        self.current_term: Callable[[], int] = lambda: 0
        # This node's incarnation (the node sets it; a fence renews it).
        self.node_incarnation: Callable[[], int] = lambda: 0
        # The pool of a placement group's bundle held here, for an actor
        # placed in it (the node sets it: pmetal.node.groups).
        self.bundle_for: Callable[[dict[str, Any], dict[str, float]], Any] = \
            lambda options, need: Failure(FailureKind.PLACEMENT, "PlacementError",
                                          "this node holds no placement groups")

    @property
    def created(self) -> int:
        return self._counts["created"]

    @property
    def restarts(self) -> int:
        return self._counts["restarts"]

    def alive(self) -> int:
        return sum(1 for a in self.actors.values() if a.state == ActorState.ALIVE)

    # -------------------------------------------------------------- workers

    async def worker_exited(self, worker: WorkerProc, code: int) -> None:
        """The pool lost ``worker`` (it has forgotten it already): restart
        the actor it hosted if it may."""
        record = self.actors.get(worker.actor_id) if worker.actor_id else None
        if record is None or record.worker_id != worker.worker_id or record.constructing:
            return   # (a death during the constructor is _construct's to report)
        record.worker_id = ""
        why = ("killed by pmetal.kill" if record.no_restart else
               f"its worker process (pid {worker.proc.pid}) {exit_text(code)}")
        if record.no_restart or record.restarts_left == 0:
            self._mark_dead(record, record.reason or why)
            return
        if record.restarts_left > 0:
            record.restarts_left -= 1
        # The restart keeps the resources the actor holds: no queued creation
        # may take them in between.
        record.state, record.reason = ActorState.RESTARTING, why
        record.incarnation += 1
        self._counts["restarts"] += 1
        record.notify()
        log.info("restarting actor %s (incarnation %d): %s", record.spec.actor_id,
                 record.incarnation, why)
        self._spawn(self._construct(record))

    # --------------------------------------------------------------- actors

    def _release(self, record: ActorRecord) -> None:
        held, record.held = record.held, {}
        if held:
            (self.queue if record.pool is None else record.pool).give(held)
        record.worker_id = ""

    def _mark_dead(self, record: ActorRecord, reason: str) -> None:
        self._release(record)
        self.table.mark_dead(record, reason)

    async def create(self, spec: CreateActor) -> Message:
        options = spec.options
        existing = self.actors.get(spec.actor_id)
        if existing is not None and existing.state != ActorState.DEAD:
            # Asked twice (a master's decision retried under its successor):
            # the actor is created once; this is it.
            return await self.lookup(LookupActor(actor_id=spec.actor_id, wait=float(
                options.get("timeout") or self.config.transport.request_timeout)))
        stale = self._stale(spec)
        if stale is not None:
            return stale
        target = options.get("node") or ""
        need = needs(options)
        if target and target != self.node_id:
            return await self._forward(target, spec)
        if not target and not fits(need, self.available):
            elsewhere = await self._place_elsewhere(need)
            if elsewhere is not None:
                return await self._forward(elsewhere.node_id, spec)
        queue = self.queue
        if options.get("placement_group"):
            # In a bundle of a placement group: its resources come from the
            # bundle, not from the node's free pool.
            bundle = self.bundle_for(options, need)
            if isinstance(bundle, Failure):
                return bundle
            queue = bundle[0]
        elif not fits(need, self.resources):
            return Failure(FailureKind.PLACEMENT, "PlacementError",
                           f"node {self.node_id[:8]} has {self.resources} in all, the actor "
                           f"needs {need}; no node of this cluster could ever hold it "
                           f"(cluster: {self.membership.total_resources(self.resources)})")
        name = options.get("name") or ""
        taken = name and (name in self._claiming or (
            name in self.names and self.actors[self.names[name]].state != ActorState.DEAD))
        if name and not taken:
            # Names are unique in the cluster, not just on this node. The name
            # is claimed here while the peers are asked, so that a second
            # request for it on this node meanwhile is refused. (Two nodes
            # asked for one name at the same instant can still both take it:
            # that needs one arbiter for the cluster.)
            self._claiming.add(name)
            try:
                found = await self.membership.find_actor(LookupActor(name=name))
            finally:
                self._claiming.discard(name)
            # (A copy a fence ended, "moved", holds no name: its restart is
            # this very creation, perhaps.)
            taken = found is not None and found.live
            if not taken:
                taken = (name in self.names
                         and self.actors[self.names[name]].state != ActorState.DEAD)
        if taken:
            return Failure(FailureKind.BAD_REQUEST, "ValueError",
                           f"an actor named {name!r} already exists (or is being created); "
                           f"pick another name or use pmetal.get_actor({name!r})")
        restarts = options.get("restarts_left", options.get("max_restarts") or 0)
        record = ActorRecord(spec, restarts_left=int(restarts),
                             incarnation=int(options.get("incarnation") or 0),
                             owner=(options["owner_node"], int(options.get("owner_pid") or 0)),
                             owner_client=options.get("owner_client") or "")
        record.pool = queue if queue is not self.queue else None
        record.reason = "waiting for resources" if not fits(need, queue.available) else ""
        self.actors[spec.actor_id] = record
        if name:
            self.names[name] = spec.actor_id
        self._counts["created"] += 1
        timeout = float(options.get("timeout") or self.config.transport.request_timeout)
        what = f"actor {options.get('class_name') or spec.actor_id}"
        try:
            reserved = await queue.reserve(need, time.monotonic() + timeout - _REPLY_MARGIN,
                                                what, self._holders, record.cancelled)
        except PMetalTimeoutError as exc:
            self._mark_dead(record, str(exc))
            return Failure(FailureKind.TIMEOUT, "PMetalTimeoutError", str(exc))
        if not reserved:
            self._mark_dead(record, record.reason or "killed while waiting for resources")
            return Failure(FailureKind.ACTOR_DIED, "ActorDiedError", record.reason)
        record.held = need
        record.reason = ""
        stale = self._stale(spec)
        if stale is not None:
            # Placed by a master that was deposed while the creation waited
            # for resources: its decision is void (the creator asks the
            # current master, which may place it elsewhere).
            self._mark_dead(record, stale.message)
            return stale
        return await self._construct(record)

    def _stale(self, spec: CreateActor) -> Failure | None:
        """A StaleTermError when a master placed ``spec`` in a term older
        than the newest this node knows (None when it did not, or is current)."""
        placed = spec.options.get("term")
        if placed is None or int(placed) >= self.current_term():
            return None
        return Failure(FailureKind.PLACEMENT, "StaleTermError",
                       f"refused a placement of actor {spec.actor_id} decided in term {placed}: "
                       f"the current term is {self.current_term()} (the master that decided "
                       f"was deposed); ask the current master")

    def _holders(self) -> str:
        held = [f"{a.spec.options.get('name') or a.spec.options.get('class_name') or ''} "
                f"({resources_text(a.held)})".lstrip()
                for a in self.actors.values() if a.held]
        return (f"node {self.node_id[:8]} has {resources_text(self.available)} free of "
                f"{resources_text(self.resources)}; "
                f"held by {', '.join(held[:10]) or 'nothing'}")

    async def _construct(self, record: ActorRecord) -> Message:
        """Run the constructor in an idle worker. The worker's exit while the
        constructor runs (``os._exit`` in it, a crash, a kill) answers at once
        with ActorDiedError naming the exit code."""
        spec = record.spec
        deadline = time.monotonic() + self.config.transport.connect_timeout
        try:
            worker = await self.pool.take_idle(deadline)
        except PMetalTimeoutError as exc:
            self._mark_dead(record, str(exc))
            return Failure(FailureKind.PLACEMENT, "PlacementError", str(exc))
        if record.state == ActorState.DEAD:   # killed while it waited for a worker
            self.pool.kill(worker)
            return Failure(FailureKind.ACTOR_DIED, "ActorDiedError", record.reason)
        worker.actor_id = spec.actor_id
        record.worker_id = worker.worker_id
        init = InitActor(spec.actor_id, spec.cls_id, spec.cls_ref, spec.args, spec.kwargs,
                         spec.options, record.incarnation)
        record.constructing = True
        try:
            reply = await self._init_or_exit(worker, init)
        finally:
            record.constructing = False
        if isinstance(reply, Failure):
            self.pool.kill(worker)
            self._mark_dead(record, f"constructor failed: {reply.error_type}: {reply.message}")
            return reply
        record.state, record.reason = ActorState.ALIVE, ""
        record.notify()
        return record.location(self.node_id, worker.address)

    async def _init_or_exit(self, worker: WorkerProc, init: InitActor) -> Message:
        """The worker's answer to ``init``, or a Failure as soon as its
        process exits (whichever comes first)."""
        cls = init.options.get("class_name") or init.actor_id
        try:
            # Opened here, before anything else is scheduled, as status asks
            # of the pool race to open it too (a worker that dies during the
            # handshake fails it within handshake_timeout).
            channel = await self.pool.channel(worker, self.config.transport.handshake_timeout)
        except PMetalError as exc:
            return Failure(FailureKind.ACTOR_DIED, "ActorDiedError",
                           f"the worker of actor {cls} did not open a session: {exc}")

        async def construct() -> Message:
            return (await channel.arequest(init)).body

        # Both tasks are owned here: the loser is cancelled before returning.
        answer = asyncio.ensure_future(construct())
        exited = asyncio.ensure_future(worker.proc.wait())
        try:
            await asyncio.wait((answer, exited), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (answer, exited):
                task.cancel()
        if answer.done() and not answer.cancelled():
            exc = answer.exception()
            if exc is None:
                return answer.result()
            if not isinstance(exc, PMetalError):
                raise exc
            try:   # the channel broke: if the process is exiting, say how
                await asyncio.wait_for(worker.proc.wait(), 1.0)
            except asyncio.TimeoutError:
                return Failure(FailureKind.ACTOR_DIED, "ActorDiedError",
                               f"the worker of actor {cls} failed while constructing it: {exc}")
        why = "was killed by pmetal.kill" if worker.killed else exit_text(worker.proc.returncode)
        return Failure(FailureKind.ACTOR_DIED, "ActorDiedError",
                       f"the worker process (pid {worker.proc.pid}) of actor {cls} {why} "
                       f"while running its constructor")

    def locate(self, record: ActorRecord) -> ActorLocation:
        worker = self.pool.workers.get(record.worker_id)
        return dataclasses.replace(record.location(self.node_id, worker.address if worker else ""),
                                   node_incarnation=self.node_incarnation())

    async def lookup(self, body: LookupActor) -> Message:
        actor_id = body.actor_id or self.names.get(body.name, "")
        record = self.actors.get(actor_id)
        if record is None or (record.moved and not body.local):
            # (A copy here that a fence ended: its restart is elsewhere.)
            if not body.local:
                found = await self.membership.find_actor(body)
                if found is not None and (record is None or found.live):
                    return found
            if record is not None:
                return self.locate(record)
            what = f"named {body.name!r}" if body.name else actor_id
            return Failure(FailureKind.NOT_FOUND, "ValueError", f"no actor {what} in this cluster")
        deadline = time.monotonic() + body.wait
        while not (record.state == ActorState.DEAD or record.moved or (
                record.state == ActorState.ALIVE
                and record.incarnation >= body.min_incarnation)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(record.changed.wait(), remaining)
            except asyncio.TimeoutError:
                break
        return self.locate(record)

    async def kill(self, body: KillActor) -> Message:
        """``pmetal.kill``: answered once the actor's process has exited
        (within :data:`_KILL_WAIT`), so that what the caller does next sees
        it gone: the objects it owned are lost (OwnerDiedError, not their
        values from a process still giving its last report), its resources
        are free."""
        record = self.actors.get(body.actor_id)
        if record is None:
            return Failure(FailureKind.NOT_FOUND, "ValueError",
                           f"no actor {body.actor_id} on this node")
        worker = self.pool.workers.get(record.worker_id)
        self.kill_record(record, body.no_restart, "killed by pmetal.kill")
        if worker is not None and worker.proc.returncode is None:
            try:
                await asyncio.wait_for(worker.proc.wait(), _KILL_WAIT)
            except asyncio.TimeoutError:
                log.warning("the worker (pid %d) of actor %s had not exited %.3g s after "
                            "pmetal.kill", worker.proc.pid, body.actor_id, _KILL_WAIT)
        return Ack()

    def kill_record(self, record: ActorRecord, no_restart: bool, reason: str) -> None:
        record.no_restart = no_restart
        if no_restart and record.state != ActorState.DEAD:
            record.reason = reason
        worker = self.pool.workers.get(record.worker_id)
        if worker is not None:
            self.pool.end(worker)   # its last report first (pool.last_words), briefly
        elif record.state == ActorState.PENDING and not record.held:   # still in the queue
            record.cancelled.set()
        elif record.state != ActorState.DEAD and not record.constructing:
            self._mark_dead(record, reason)

    async def kill_remote(self, body: KillActor) -> Message:
        """Pass a kill on to the member that hosts the actor (one hop: the
        member answers from its own actors)."""
        member = self.membership.members.get(body.node_id)
        if member is None or body.node_id == self.node_id:
            return Failure(FailureKind.NOT_FOUND, "ValueError",
                           f"no actor {body.actor_id} on this node, and its node "
                           f"{body.node_id[:8]} is not a member of this cluster (it left, or "
                           f"the handle comes from another cluster)")
        return await self.membership.ask(member, KillActor(body.actor_id, body.no_restart, ""))

    def kill_owned(self, owned_by: Any, why: str) -> int:
        owned = [r for r in self.actors.values()
                 if owned_by(r) and not r.detached and r.state != ActorState.DEAD]
        for record in owned:
            self.kill_record(record, True, f"{why}; create it with lifetime='detached' to "
                                            f"keep it")
        return len(owned)

    # ------------------------------------------------------------ elsewhere

    async def _place_elsewhere(self, need: dict[str, float]) -> Member | None:
        """A member with ``need`` free now (asked now, in parallel), else one
        that could hold it when empty while this node could not."""
        members = list(self.membership.members.values())
        if not members:
            return None
        answers = await asyncio.gather(*(
            asyncio.wait_for(self.membership.ask(m, ResourcesRequest()), _ASK_RESOURCES)
            for m in members), return_exceptions=True)
        for member, answer in zip(members, answers):
            if isinstance(answer, Resources) and not answer.queued \
                    and fits(need, answer.available):
                return member
        if fits(need, self.resources):
            return None   # wait here
        for member, answer in zip(members, answers):
            if fits(need, answer.total if isinstance(answer, Resources) else member.resources):
                return member   # wait there
        return None

    async def _forward(self, node_id: str, spec: CreateActor) -> Message:
        member = self.membership.find(node_id)
        if member is None:
            return Failure(FailureKind.PLACEMENT, "PlacementError",
                           f"no node {node_id} in this cluster; members: "
                           f"{[self.node_id, *self.membership.members]}")
        options = dict(spec.options)
        options["node"] = member.node_id
        self._on_forwarded(options, member.node_id)
        return await self.membership.ask(member, CreateActor(
            spec.actor_id, spec.cls_id, spec.cls_ref, spec.args, spec.kwargs, options))
