"""The node daemon: one per machine; membership, worker pool, actor placement.

User code never runs here (it runs in workers), so the node stays responsive
whatever actors do. The daemon is an asyncio program (uvloop when
installed) around one :class:`~pmetal.endpoint.SecureListener`:

* it pre-starts a pool of actor workers (:mod:`pmetal.actors.pool`), so
  creating an actor is one message to an idle worker, and a few task workers
  for remote functions;
* it places actors (resources, a chosen node, a name), re-runs an actor's
  constructor in a fresh worker when its process dies and restarts remain,
  and answers where an actor lives now;
* it keeps the member list of the cluster (:mod:`pmetal.actors.membership`:
  static peers now; discovery and election join later through the same
  component), versioned by an epoch, and forwards placements and kills aimed
  at other nodes.

Started by ``pmetal start`` (a long-lived daemon) or by ``pmetal.init()``
(embedded: bound to 127.0.0.1, nothing announced, and it exits when the
driver that started it goes away).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from pmetal import shm
from pmetal.actors.membership import Member, Membership
from pmetal.actors.nodeproc import (READY_LINE, is_node_process, node_file, read_ready_line,
                                    routable_address)
from pmetal.actors.owners import OwnerLeases, OwnerWatch
from pmetal.actors.placement import PlacementQueue, check_options, check_resources, fits, needs
from pmetal.actors.records import ActorRecord, ActorTable, exit_text
from pmetal.actors.pool import WorkerPool, WorkerProc
from pmetal.actors.zygote import ForkServer
from pmetal.config import PMetalConfig, load_config, setup_process_logging
from pmetal.endpoint import Incoming, SecureListener
from pmetal.errors import ClosedError, PeerError, PMetalError, PMetalTimeoutError
from pmetal.hardware import gpu_count
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.wire import (Ack, ActorLocation, CreateActor, Detach, Failure, InitActor, KillActor,
                         LeaseWorkers, LookupActor, Message, NodeJoin, OwnerDied, Ping, Pong,
                         Resources, ResourcesRequest, Shutdown, Status, StatusRequest,
                         WorkerReady)

# READY_LINE, node_file, read_ready_line, is_node_process and routable_address
# live in pmetal.actors.nodeproc and stay importable from here.
__all__ = ["READY_LINE", "NodeDaemon", "NodeStatistics", "is_node_process", "main", "node_file",
           "read_ready_line", "routable_address"]

log = logging.getLogger(__name__)

_REPLY_MARGIN = 0.5
"""s before the creator's deadline at which a queued creation gives up, so
that its answer (a clear timeout) arrives before the creator stops waiting."""

_ASK_RESOURCES = 2.0
"""s a member may take to say what it has free before placement skips it."""


@dataclass(frozen=True)
class NodeStatistics:
    workers: int
    idle_workers: int
    actors_alive: int
    actors_created: int
    actor_restarts: int
    members: int
    epoch: int
    requests: int
    requests_failed: int = 0      # answered with an error by the dispatcher (bad input, bugs)
    actors_queued: int = 0        # creations waiting for resources
    owners_died: int = 0          # owner processes seen exiting (their actors were killed)


def default_resources(num_cpus: float | None = None) -> dict[str, float]:
    cpus = float(num_cpus if num_cpus is not None else (os.cpu_count() or 1))
    try:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        memory = 0.0
    gpus = gpu_count()   # listed only when there are some, as in Ray
    return {"CPU": cpus, **({"GPU": float(gpus)} if gpus else {}), "memory": memory}


class NodeDaemon:
    def __init__(self, config: PMetalConfig, namespace: NetworkNamespace,
                 identity: NodeIdentity, *, host: str = "127.0.0.1", port: int = 0,
                 num_workers: int | None = None, num_task_workers: int | None = None,
                 resources: dict[str, float] | None = None, peers: list[str] | None = None,
                 embedded: bool = False, fork_server: ForkServer | None = None) -> None:
        self.config = config
        self.namespace = namespace
        self.identity = identity
        self.node_id = identity.node_id
        self.host = host
        self.embedded = embedded
        self.transport = ZmqTransport(config.transport, curve=namespace.curve_keys())
        self.listener = SecureListener(self.transport.listen(f"tcp://{host}:{port}"), identity,
                                       namespace, config)
        # What peers are told to dial: never a wildcard such as 0.0.0.0.
        self.address = routable_address(self.listener.address)
        self.resources = {**default_resources(),
                          **check_resources(resources or {}, "node resources")}
        self.available = dict(self.resources)
        self.queue = PlacementQueue(self.available)
        self.peers = list(peers or [])
        cpus = os.cpu_count() or 1
        # Workers bind the concrete address the node advertises: a worker
        # bound to a wildcard would take 0.0.0.0 for its own address (which
        # it compares with the addresses its node hands out).
        worker_host = self.address.partition("://")[2].rpartition(":")[0]
        self.pool = WorkerPool(
            node_id=self.node_id, host=worker_host, identity=identity, namespace=namespace,
            config=config, transport=self.transport,
            num_actor=max(1, num_workers if num_workers is not None else max(2, cpus)),
            num_task=max(1, num_task_workers if num_task_workers is not None else cpus),
            on_exit=self._worker_exited, fork_server=fork_server)
        self.table = ActorTable()
        self.actors = self.table.actors   # actor id -> record (dead ones: the last DEAD_TAIL)
        self.names = self.table.names     # name -> actor id
        self._claiming: set[str] = set()   # names being looked up on the peers
        self.membership = Membership(identity, namespace, config, self.transport)
        self.owners = OwnerWatch(self._owner_exited)
        self.leases = OwnerLeases(config.actors.owner_lease)
        # (owner pid or 0, owner client) -> members hosting actors of that owner
        self._placed_with: dict[tuple[int, str], set[str]] = {}
        self._stopping = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None
        self._cancellable: set[asyncio.Task[Any]] = set()
        self._counts = {"created": 0, "restarts": 0, "requests": 0, "failed": 0,
                        "owners_died": 0}

    def statistics(self) -> NodeStatistics:
        alive = sum(1 for a in self.actors.values() if a.state == "alive")
        members = self.membership.statistics()
        return NodeStatistics(len(self.pool.workers), len(self.pool.idle), alive, self._counts["created"],
                              self._counts["restarts"], members.members, members.epoch,
                              self._counts["requests"], self._counts["failed"], len(self.queue),
                              self._counts["owners_died"])

    # ------------------------------------------------------------- running

    async def run(self, on_ready: Any = None) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                self.pool.start(group, self.address, self._stopping)
                self._cancellable_task(self.pool.fill())
                self._cancellable_task(self.owners.poll(self._stopping))
                self._cancellable_task(self._expire_leases())
                join = NodeJoin(self.node_id, self.address, self.resources)
                for peer in self.peers:
                    self._cancellable_task(self.membership.join(peer, join, self._stopping))
                if on_ready is not None:
                    on_ready(self)
                serve = group.create_task(self._serve())
                await self._stopping.wait()
                # interrupt() makes the pending arecv raise ClosedError: a
                # cancel alone can be lost when it races a completing receive.
                self.listener.interrupt()
                serve.cancel()
                for task in self._cancellable:
                    task.cancel()
                self.pool.kill_all()
        finally:
            self.owners.close()
            self.listener.close()
            self.membership.close()
            self.pool.close()

    def stop(self) -> None:
        self._stopping.set()

    async def _serve(self) -> None:
        while True:
            try:
                incoming = await self.listener.arecv()
            except ClosedError:
                return
            self._counts["requests"] += 1
            if self.leases:   # any message from a remote owner renews its lease
                self.leases.renew(incoming.peer, time.monotonic())
            try:
                reply = self._handle_now(incoming)
            except Exception as exc:  # noqa: BLE001 - no request may end the node
                reply = self._failed(incoming, exc)
            if reply is not None:
                await self._reply(incoming, reply)

    def _failed(self, incoming: Incoming, exc: Exception) -> Failure:
        """The answer to a request whose handler raised: logged and counted.
        Bad input from a peer (a TypeError or ValueError of a check) is a
        warning; anything else is a bug of ours, logged with its traceback."""
        self._counts["failed"] += 1
        kind = type(incoming.body).__name__
        if isinstance(exc, (TypeError, ValueError, PMetalError)):
            log.warning("refused a %s from %s: %s: %s", kind, incoming.peer[:8],
                        type(exc).__name__, exc)
        else:
            log.error("a %s from %s failed", kind, incoming.peer[:8], exc_info=exc)
        return Failure("bad_request", type(exc).__name__, str(exc) or repr(exc))

    async def _reply(self, incoming: Incoming, reply: Message) -> None:
        if not incoming.envelope.corr:
            return
        try:
            await self.listener.areply(incoming, reply)
        except (PeerError, PMetalTimeoutError) as exc:
            log.warning("could not reply to %s: %s", incoming.peer, exc)
        except Exception as exc:  # noqa: BLE001 - e.g. ZMQError: too many open files
            self._counts["failed"] += 1
            log.error("could not reply to %s: %s", incoming.peer, exc, exc_info=exc)

    def _later(self, incoming: Incoming, work: Any) -> None:
        """Run a slow request in its own task so the loop keeps serving;
        whatever it raises becomes a Failure reply, never an exception in
        the node's task group."""
        async def run() -> None:
            try:
                reply = await work
            except Exception as exc:  # noqa: BLE001 - no request may end the node
                reply = self._failed(incoming, exc)
            await self._reply(incoming, reply)
        self._cancellable_task(run())

    def _cancellable_task(self, coro: Any) -> None:
        """A task that shutdown cancels (requests, peer joins, restarts)."""
        assert self._group is not None
        task = self._group.create_task(self._guarded(coro))
        self._cancellable.add(task)
        task.add_done_callback(self._cancellable.discard)

    async def _guarded(self, coro: Any) -> None:
        # A background task that fails is logged, not allowed to end the
        # task group (and with it the node and every actor).
        try:
            await coro
        except Exception as exc:  # noqa: BLE001
            self._counts["failed"] += 1
            log.error("a background task of the node failed", exc_info=exc)

    def _handle_now(self, incoming: Incoming) -> Message | None:
        body = incoming.body
        kind = type(body)
        if kind is Ping:
            return Pong(body.payload)  # type: ignore[attr-defined]
        if kind is WorkerReady:
            # A worker bound to a wildcard reports it: peers get a routable address.
            body = replace(body, address=routable_address(body.address))  # type: ignore[arg-type]
            return self.pool.ready(body)  # type: ignore[arg-type]
        if kind is CreateActor:
            self._later(incoming, self._create_actor(body, incoming))  # type: ignore[arg-type]
            return None
        if kind is LookupActor:
            self._later(incoming, self._lookup(body))  # type: ignore[arg-type]
            return None
        if kind is KillActor:
            if body.actor_id in self.actors or not body.node_id:  # type: ignore[attr-defined]
                return self._kill_actor(body)  # type: ignore[arg-type]
            self._later(incoming, self._kill_remote(body))  # type: ignore[arg-type]
            return None
        if kind is LeaseWorkers:
            self._later(incoming, self.pool.lease(body))  # type: ignore[arg-type]
            return None
        if kind is StatusRequest:
            self._later(incoming, self._status_with_calls())
            return None
        if kind is ResourcesRequest:
            return Resources(self.resources, self.available, len(self.queue))
        if kind is OwnerDied:
            if body.node_id != incoming.peer:  # type: ignore[attr-defined]
                raise ValueError(f"OwnerDied for node {body.node_id[:8]} came from node "  # type: ignore[attr-defined]
                                 f"{incoming.peer[:8]}; a node reports its own processes")
            return Ack(self._owner_died(body.node_id, body.pid, body.client))  # type: ignore[attr-defined]
        if kind is Detach:
            return Ack(self._client_gone(incoming.peer, f"its owner (client {incoming.peer[:8]}) "
                                                        f"shut down"))
        if kind is NodeJoin:
            self._later(incoming, self.membership.joined(body, incoming.peer,  # type: ignore[arg-type]
                                                         self.status))
            return None
        if kind is Shutdown:
            log.info("shutdown requested by %s: %s", incoming.peer, body.reason)  # type: ignore[attr-defined]
            asyncio.get_running_loop().call_soon(self.stop)
            return Ack()
        return Failure("bad_request", "ProtocolError",
                       f"a node does not handle {kind.__name__} messages")

    # -------------------------------------------------------------- workers

    async def _worker_exited(self, worker: WorkerProc, code: int) -> None:
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
        record.state, record.reason = "restarting", why
        record.incarnation += 1
        self._counts["restarts"] += 1
        record.notify()
        log.info("restarting actor %s (incarnation %d): %s", record.spec.actor_id,
                 record.incarnation, why)
        self._cancellable_task(self._construct(record))

    # --------------------------------------------------------------- actors

    def _release(self, record: ActorRecord) -> None:
        held, record.held = record.held, {}
        if held:
            self.queue.give(held)
        record.worker_id = ""

    def _mark_dead(self, record: ActorRecord, reason: str) -> None:
        self._release(record)
        self.table.mark_dead(record, reason)

    async def _create_actor(self, spec: CreateActor, incoming: Incoming) -> Message:
        check_options(spec.options)
        if spec.options.get("owner_node") == incoming.peer:
            # Forwarded by the creator's node, which named the owner (only
            # that node's own session can pass an owner on).
            return await self._place(spec)
        # The creator's own node names the owner: the process that created
        # it, watched by pid when it proved it runs on this machine; else
        # (another machine) the client's session, which holds a lease.
        session = self.listener.session(incoming.route)
        pid = int(spec.options.get("owner_pid") or 0)
        local = bool(getattr(session, "local", False))
        if pid and local and not self.owners.watch(pid):
            return Failure("actor_died", "ActorDiedError",
                           f"the process that creates the actor (pid {pid}) has exited")
        if not local:
            self.leases.hold(incoming.peer, time.monotonic())
        spec = replace(spec, options={**spec.options, "owner_node": self.node_id,
                                      "owner_pid": pid if local else 0,
                                      "owner_client": incoming.peer})
        reply = await self._place(spec)
        if isinstance(reply, ActorLocation) and not local:
            reply = replace(reply, owner_lease=self.leases.timeout)
        return reply

    async def _place(self, spec: CreateActor) -> Message:
        options = spec.options
        target = options.get("node") or ""
        need = needs(options)
        if target and target != self.node_id:
            return await self._forward(target, spec)
        if not target and not fits(need, self.available):
            elsewhere = await self._place_elsewhere(need)
            if elsewhere is not None:
                return await self._forward(elsewhere.node_id, spec)
        if not fits(need, self.resources):
            return Failure("placement", "PlacementError",
                           f"node {self.node_id[:8]} has {self.resources} in all, the actor "
                           f"needs {need}; no node of this cluster could ever hold it "
                           f"(cluster: {self.membership.total_resources(self.resources)})")
        name = options.get("name") or ""
        taken = name and (name in self._claiming or (
            name in self.names and self.actors[self.names[name]].state != "dead"))
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
            taken = found is not None and found.state != "dead"
            if not taken:
                taken = name in self.names and self.actors[self.names[name]].state != "dead"
        if taken:
            return Failure("bad_request", "ValueError",
                           f"an actor named {name!r} already exists (or is being created); "
                           f"pick another name or use pmetal.get_actor({name!r})")
        record = ActorRecord(spec, restarts_left=int(options.get("max_restarts") or 0),
                             owner=(options["owner_node"], int(options.get("owner_pid") or 0)),
                             owner_client=options.get("owner_client") or "")
        record.reason = "waiting for resources" if not fits(need, self.available) else ""
        self.actors[spec.actor_id] = record
        if name:
            self.names[name] = spec.actor_id
        self._counts["created"] += 1
        timeout = float(options.get("timeout") or self.config.transport.request_timeout)
        what = f"actor {options.get('class_name') or spec.actor_id}"
        try:
            reserved = await self.queue.reserve(need, time.monotonic() + timeout - _REPLY_MARGIN,
                                                what, self._holders, record.cancelled)
        except PMetalTimeoutError as exc:
            self._mark_dead(record, str(exc))
            return Failure("timeout", "PMetalTimeoutError", str(exc))
        if not reserved:
            self._mark_dead(record, record.reason or "killed while waiting for resources")
            return Failure("actor_died", "ActorDiedError", record.reason)
        record.held = need
        record.reason = ""
        return await self._construct(record)

    def _holders(self) -> str:
        held = [f"{a.spec.options.get('class_name') or a.spec.actor_id} {a.held}"
                for a in self.actors.values() if a.held]
        return (f"node {self.node_id[:8]} has {self.available} free of {self.resources}; "
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
            return Failure("placement", "PlacementError", str(exc))
        if record.state == "dead":   # killed while it waited for a worker
            self.pool.kill(worker)
            return Failure("actor_died", "ActorDiedError", record.reason)
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
        record.state, record.reason = "alive", ""
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
            return Failure("actor_died", "ActorDiedError",
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
                return Failure("actor_died", "ActorDiedError",
                               f"the worker of actor {cls} failed while constructing it: {exc}")
        why = "was killed by pmetal.kill" if worker.killed else exit_text(worker.proc.returncode)
        return Failure("actor_died", "ActorDiedError",
                       f"the worker process (pid {worker.proc.pid}) of actor {cls} {why} "
                       f"while running its constructor")

    def _locate(self, record: ActorRecord) -> ActorLocation:
        worker = self.pool.workers.get(record.worker_id)
        return record.location(self.node_id, worker.address if worker else "")

    async def _lookup(self, body: LookupActor) -> Message:
        actor_id = body.actor_id or self.names.get(body.name, "")
        record = self.actors.get(actor_id)
        if record is None:
            if not body.local:
                found = await self.membership.find_actor(body)
                if found is not None:
                    return found
            what = f"named {body.name!r}" if body.name else actor_id
            return Failure("not_found", "ValueError", f"no actor {what} in this cluster")
        deadline = time.monotonic() + body.wait
        while not (record.state == "dead" or (record.state == "alive"
                                              and record.incarnation >= body.min_incarnation)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(record.changed.wait(), remaining)
            except asyncio.TimeoutError:
                break
        return self._locate(record)

    def _kill_actor(self, body: KillActor) -> Message:
        record = self.actors.get(body.actor_id)
        if record is None:
            return Failure("not_found", "ValueError", f"no actor {body.actor_id} on this node")
        self._kill_record(record, body.no_restart, "killed by pmetal.kill")
        return Ack()

    def _kill_record(self, record: ActorRecord, no_restart: bool, reason: str) -> None:
        record.no_restart = no_restart
        if no_restart and record.state != "dead":
            record.reason = reason
        worker = self.pool.workers.get(record.worker_id)
        if worker is not None:
            self.pool.kill(worker)
        elif record.state == "pending" and not record.held:   # still in the queue
            record.cancelled.set()
        elif record.state != "dead" and not record.constructing:
            self._mark_dead(record, reason)

    async def _kill_remote(self, body: KillActor) -> Message:
        """Pass a kill on to the member that hosts the actor (one hop: the
        member answers from its own actors)."""
        member = self.membership.members.get(body.node_id)
        if member is None or body.node_id == self.node_id:
            return Failure("not_found", "ValueError",
                           f"no actor {body.actor_id} on this node, and its node "
                           f"{body.node_id[:8]} is not a member of this cluster (it left, or "
                           f"the handle comes from another cluster)")
        return await self.membership.ask(member, KillActor(body.actor_id, body.no_restart, ""))

    # --------------------------------------------------------------- owners

    def _owner_exited(self, pid: int) -> None:
        """A local owner process exited: its actors die with it, here and on
        the members that host some of them."""
        self._counts["owners_died"] += 1
        killed = self._owner_died(self.node_id, pid, "")
        members = self._members_hosting(lambda key: key[0] == pid)
        log.info("owner process %d exited: killed %d of its actors here, telling %d member(s)",
                 pid, killed, len(members))
        shm.sweep()   # what it was sent and never read, what it made for nobody
        self._tell_members(members, OwnerDied(self.node_id, pid))

    def _client_gone(self, client: str, why: str) -> int:
        """A client detached (pmetal.shutdown) or its lease lapsed: the actors
        its session created die, here and on the members hosting some."""
        self.leases.drop(client)
        killed = self._kill_owned(
            lambda r: r.owner[0] == self.node_id and r.owner_client == client, why)
        members = self._members_hosting(lambda key: key[1] == client)
        if killed or members:
            self._counts["owners_died"] += 1
            log.info("%s: killed %d of its actors here, telling %d member(s)", why, killed,
                     len(members))
        self._tell_members(members, OwnerDied(self.node_id, 0, client))
        return killed

    def _members_hosting(self, owner: Any) -> set[str]:
        keys = [key for key in self._placed_with if owner(key)]
        return set().union(*(self._placed_with.pop(key) for key in keys))

    def _tell_members(self, members: set[str], message: OwnerDied) -> None:
        for node_id in members:
            member = self.membership.members.get(node_id)
            if member is not None:
                self._cancellable_task(self._tell_owner_died(member, message))

    async def _tell_owner_died(self, member: Member, message: OwnerDied) -> None:
        reply = await self.membership.ask(member, message)
        if isinstance(reply, Failure):
            log.warning("could not tell node %s that an owner died (%s): %s",
                        member.node_id[:8], message, reply.message)

    def _owner_died(self, node_id: str, pid: int, client: str) -> int:
        """Kill the non-detached actors of process ``pid`` (or, with
        ``client``, of that client session) that reached the cluster through
        node ``node_id``; how many."""
        if client:
            return self._kill_owned(lambda r: r.owner[0] == node_id and r.owner_client == client,
                                    f"its owner (client {client[:8]} of node {node_id[:8]}) "
                                    f"is gone")
        return self._kill_owned(lambda r: r.owner == (node_id, pid),
                                f"its owner (pid {pid} on node {node_id[:8]}) exited")

    def _kill_owned(self, owned_by: Any, why: str) -> int:
        owned = [r for r in self.actors.values()
                 if owned_by(r) and not r.detached and r.state != "dead"]
        for record in owned:
            self._kill_record(record, True, f"{why}; create it with lifetime='detached' to "
                                            f"keep it")
        return len(owned)

    async def _expire_leases(self) -> None:
        """End the actors of remote owners whose lease lapsed (looked at four
        times per lease, so within 1.25 leases of their last message)."""
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), self.leases.timeout / 4)
                return
            except asyncio.TimeoutError:
                pass
            for client in self.leases.expired(time.monotonic()):
                self._client_gone(client, f"its owner (client {client[:8]}, on another machine) "
                                          f"sent nothing for {self.leases.timeout:g} s (its "
                                          f"lease lapsed)")

    # ------------------------------------------------------------ membership

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
            return Failure("placement", "PlacementError",
                           f"no node {node_id} in this cluster; members: "
                           f"{[self.node_id, *self.membership.members]}")
        options = dict(spec.options)
        options["node"] = member.node_id
        if options.get("owner_node") == self.node_id:
            owner = (int(options.get("owner_pid") or 0), options.get("owner_client") or "")
            self._placed_with.setdefault(owner, set()).add(member.node_id)
        return await self.membership.ask(member, CreateActor(
            spec.actor_id, spec.cls_id, spec.cls_ref, spec.args, spec.kwargs, options))

    # --------------------------------------------------------------- status

    async def _status_with_calls(self) -> Message:
        """status() plus each worker's calls served (asked of the workers)."""
        info = self.status()
        await self.pool.add_calls(info["workers"])
        return Status(info)

    def status(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "address": self.address,
            "namespace": self.namespace.name,
            "pid": os.getpid(),
            "epoch": self.membership.epoch,
            "resources": self.resources,
            "available": self.available,
            "members": self.membership.describe(),
            "refused_peers": self.membership.describe_refused(),
            "workers": self.pool.describe(),
            "actors": self.table.describe(self.node_id),
            "queue": self.queue.describe(),
            "owner_leases": self.leases.describe(time.monotonic()),
            "statistics": self.statistics().__dict__,
            "leases": self.leases.statistics().__dict__,
            "pool": self.pool.statistics().__dict__,
            "membership": self.membership.statistics().__dict__,
        }


# ----------------------------------------------------------------- process

def _watch_stdin(loop: asyncio.AbstractEventLoop, daemon: NodeDaemon) -> None:
    # os.read on the raw fd: a daemon thread blocked in sys.stdin's buffered
    # reader holds its lock and makes interpreter shutdown abort.
    try:
        while os.read(0, 1 << 16):
            pass
    except OSError:
        pass
    loop.call_soon_threadsafe(daemon.stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pmetal.actors.node")
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--num-workers", type=int, default=None)
    parser.add_argument("--num-task-workers", type=int, default=None)
    parser.add_argument("--resources", default="{}", help="JSON object of extra resources")
    parser.add_argument("--peers", default="", help="comma-separated host:port of other nodes")
    parser.add_argument("--embedded", action="store_true",
                        help="started by pmetal.init(): exit when stdin closes")
    args = parser.parse_args(argv)
    # First, while this process has one thread and no ZeroMQ context, and
    # before it loads its key pair (workers run user code): the fork server
    # that starts workers in milliseconds (pmetal.actors.zygote).
    fork_server = ForkServer.fork_here()
    try:
        setup_process_logging("node")
    except PMetalError as exc:
        print(f"pmetal node: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        config = load_config()
        namespace = NetworkNamespace.resolve(config.security)
        identity = NodeIdentity.generate() if args.embedded else NodeIdentity.load_or_create()
        host = args.host or config.transport.host
        port = args.port if args.port is not None else config.transport.port
        from pmetal.aio import new_event_loop
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        daemon = NodeDaemon(config, namespace, identity, host=host, port=port,
                            num_workers=args.num_workers, num_task_workers=args.num_task_workers,
                            resources=json.loads(args.resources),
                            peers=[p for p in args.peers.split(",") if p],
                            embedded=args.embedded, fork_server=fork_server)
    except (PMetalError, ValueError, TypeError) as exc:
        if fork_server is not None:
            fork_server.close()
        print(f"pmetal node: {exc}", file=sys.stderr, flush=True)
        return 1

    def ready(d: NodeDaemon) -> None:
        print(f"{READY_LINE} {d.address} {d.node_id}", flush=True)

    if args.embedded:
        threading.Thread(target=_watch_stdin, args=(loop, daemon), daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.stop)
    try:
        loop.run_until_complete(daemon.run(ready))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    # Run main() of the imported module, not of __main__, so that module
    # state lives in one module object.
    from pmetal.actors import node as _node
    sys.exit(_node.main())
