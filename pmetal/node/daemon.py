"""The node daemon: one per machine; membership, worker pool, actor placement.

User code never runs here (it runs in workers), so the node stays responsive
whatever actors do. The daemon is an asyncio program (uvloop when
installed) around one :class:`~pmetal.endpoint.SecureListener`:

* it pre-starts a pool of actor workers (:mod:`pmetal.node.pool`), so
  creating an actor is one message to an idle worker, and a few task workers
  for remote functions;
* it places actors (resources, a chosen node, a name), re-runs an actor's
  constructor in a fresh worker when its process dies and restarts remain,
  and answers where an actor lives now (:mod:`pmetal.node.lifecycle`);
* it names the owner of each actor a client creates and ends the actors of
  owners that go (:mod:`pmetal.node.owners`);
* it serves the pieces of the models this machine stores to the members
  that lack them (:mod:`pmetal.store.serve`);
* it keeps the member list of the cluster (:mod:`pmetal.node.membership`:
  static peers now; discovery and election join later through the same
  component), versioned by an epoch, and forwards placements and kills aimed
  at other nodes.

This module is the daemon's shell: it receives requests, answers the quick
ones and hands the slow ones to tasks of its task group (a request never
ends the node), and runs the process. What the node says about itself
(``pmetal status``, a member's ``ResourcesRequest``, the machine's default
resources and profile) is gathered by :mod:`pmetal.node.status`.

Started by ``pmetal start`` (a long-lived daemon) or by ``pmetal.init()``
(embedded: bound to 127.0.0.1, nothing announced, and it exits when the
driver that started it goes away).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from pmetal.node.groups import PlacementGroupService
from pmetal.node.lifecycle import ActorLifecycle
from pmetal.node.membership import Membership
from pmetal.node.metrics import EMBEDDED_DELAY, MetricsServer
from pmetal.node.telemetry import NodeTelemetry
from pmetal.node.status import (default_resources, describe, machine_profile, resources,
                                resources_measured, status_with_calls)
from pmetal.node.process import (READY_LINE, is_node_process, node_file, read_ready_line,
                                    routable_address)
from pmetal.node.owners import Owners
from pmetal.node.placement import check_options, check_resources
from pmetal.node.pool import WorkerPool, WorkerProc
from pmetal.node.scheduler import Scheduler, restarted_elsewhere
from pmetal.node.zygote import ForkServer
from pmetal.cluster.capacity import ComputeMeter
from pmetal.cluster.clock import Gate
from pmetal.cluster.election import ElectionState
from pmetal.cluster.view import MemberState
from pmetal.cluster.eventlog import EventKind
from pmetal.cluster.service import ClusterService
from pmetal.config import PMetalConfig, load_config, pmetal_home, setup_process_logging
from pmetal.endpoint import Incoming, SecureListener
from pmetal.errors import (ClosedError, PeerError, PMetalError, PMetalTimeoutError,
                           TransportError)
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.store.serve import STORE_KINDS, PieceServer
from pmetal.transport import ZmqTransport
from pmetal.values import ActorState, FailureKind, host_of
from pmetal.wire import (Ack, ActorLocation, Beat, ClusterView, CreateActor,
                         CreatePlacementGroup, Detach, Failure, JoinCluster, KillActor,
                         LeaseWorkers, LookupActor, Machine, MachineRequest, Message,
                         NodeJoin, OwnerDied, Ping,
                         PlacementGroupQuery, PlacementGroups, Pong, Probe, ReserveBundles,
                         ResourcesRequest, Shutdown, Status, StatusRequest, Telemetry, Vote, VoteRequest,
                         WatchCluster, WorkerReady)

# READY_LINE, node_file, read_ready_line, is_node_process and routable_address
# live in pmetal.node.process and stay importable from here.
__all__ = ["READY_LINE", "NodeDaemon", "NodeStatistics", "is_node_process", "main", "node_file",
           "read_ready_line", "routable_address"]

log = logging.getLogger(__name__)

_MAX_RECEIVE_FAILURES = 100
_RECEIVE_BACKOFF = 0.01   # s between failed receives: a failing socket must not spin


@dataclass(frozen=True, slots=True)
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
    owners_died: int = 0          # owners seen going: a process exited, a client detached or
                                  # its lease lapsed (their actors were killed)
    receive_errors: int = 0       # receives on the node's socket that failed (and were retried)


_CLUSTER = (Beat, VoteRequest, Vote, ClusterView, JoinCluster, Probe)


TASK_WORKERS_PER_CORE = 4
"""At most this many task workers per core, whatever ``num_cpus`` says."""


def task_workers_for(cpu: float, cores: int) -> int:
    """How many task workers a node runs: one per CPU it advertises (as in
    Ray, a node of ``num_cpus=N`` runs N one-CPU tasks at once, more than
    its cores if N says so), at least 1. They are processes started ahead,
    so at most TASK_WORKERS_PER_CORE per core: a node declared with 1000
    CPUs on a laptop does not fork 1000 workers."""
    return max(1, min(math.ceil(cpu), TASK_WORKERS_PER_CORE * max(1, cores)))


class NodeDaemon:
    def __init__(self, config: PMetalConfig, namespace: NetworkNamespace,
                 identity: NodeIdentity, *, host: str = "127.0.0.1", port: int = 0,
                 num_workers: int | None = None, num_task_workers: int | None = None,
                 resources: dict[str, float] | None = None, peers: list[str] | None = None,
                 embedded: bool = False, fork_server: ForkServer | None = None,
                 discovery: bool | None = None, interfaces: str | None = None) -> None:
        self.config = config
        self.namespace = namespace
        self.identity = identity
        self.node_id = identity.node_id
        self.host = host
        self.embedded = embedded
        self.transport = ZmqTransport(config.transport, curve=namespace.curve_keys())
        # Its raw socket counts the strangers ZeroMQ's CURVE refuses (count_refusals).
        self.socket = self.transport.listen(f"tcp://{host}:{port}")
        self.listener = SecureListener(self.socket, identity, namespace, config)
        # What peers are told to dial: never a wildcard such as 0.0.0.0.
        self.address = routable_address(self.listener.address)
        self.resources = {**default_resources(memory=config.actors.memory),
                          **check_resources(resources or {}, "node resources")}
        self.peers = list(peers or [])
        cpus = os.cpu_count() or 1
        # Workers bind the concrete address the node advertises: a worker
        # bound to a wildcard would take 0.0.0.0 for its own address (which
        # it compares with the addresses its node hands out).
        worker_host = host_of(self.address)
        # Workers start no call and send no result while the node's
        # membership is unconfirmed after a pause (pmetal.cluster.clock).
        self.gate = Gate()
        self.pool = WorkerPool(
            node_id=self.node_id, host=worker_host, identity=identity, namespace=namespace,
            config=config, transport=self.transport,
            num_actor=max(1, num_workers if num_workers is not None else max(2, cpus)),
            num_task=max(1, num_task_workers if num_task_workers is not None
                         else task_workers_for(self.resources.get("CPU", cpus), cpus)),
            on_exit=self._worker_exited, fork_server=fork_server,
            gate=(self.gate.path, config.health.dead_after / 2))
        self.membership = Membership(identity, namespace, config, self.transport)
        # Two components hold the node's state: the actors (placement,
        # construction, restarts, kills) and their owners (who they die with).
        self.actors = ActorLifecycle(config, self.node_id, self.resources, self.pool,
                                     self.membership, self._cancellable_task,
                                     on_forwarded=lambda options, member:
                                         self.owners.forwarded(options, member))
        self.actors.current_term = lambda: self.cluster.term
        self.actors.node_incarnation = lambda: self.cluster.incarnation
        # Placement groups: held by the node of the driver that made them,
        # their bundles by the nodes they are placed on (pmetal.node.groups).
        self._listed_dead: set[str] = set()   # members the last list held dead
        self.groups = PlacementGroupService(self.node_id, self.actors, self.membership,
                                            self._cancellable_task)
        self.actors.bundle_for = self.groups.bundle_for
        self.owners = Owners(self.node_id, config.actors.owner_lease, self.membership,
                             self._end_owned, self._cancellable_task)
        # The cluster: heartbeats, health, election, the master's member list
        # (pmetal.cluster.service); the master places actors (pmetal.node.scheduler).
        self.discover = config.discovery.enabled if discovery is None else discovery
        self.interfaces = config.discovery.interfaces if interfaces is None else interfaces
        alone = not self.peers and not self.discover
        self.cluster = ClusterService(
            config=config, identity=identity, namespace=namespace, transport=self.transport,
            address=self.address, resources=self.resources,
            profile=machine_profile(self.node_id, measure=not alone),
            static_peers=self.peers, on_view=self._view_changed, on_fenced=self._fenced,
            on_dead=self._node_dead, on_refused=self.membership.refuse,
            bootstrap=0.0 if alone else None, gate=self.gate)
        # Refused handshakes go to the event log (pmetal.cluster.eventlog):
        # pmetal's own, and the strangers ZeroMQ's CURVE refused before it.
        self.listener.on_refused = lambda reason: self.cluster.events.record(
            EventKind.REFUSAL, "", f"handshake refused: {reason}")
        self.socket.on_refused = lambda reason: self.cluster.events.record(
            EventKind.REFUSAL, "", f"a stranger refused by ZeroMQ's CURVE handshake "
                                   f"({reason}): it lacks the namespace's keys")
        self.scheduler = Scheduler(self)
        self.compute = ComputeMeter()     # measured on first need: never at start
        # Pieces of the models this machine holds, for members that lack them.
        self.store = PieceServer(pmetal_home() / "models")
        self._stopping = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None
        self._cancellable: set[asyncio.Task[Any]] = set()
        self._counts = {"requests": 0, "failed": 0, "receive_errors": 0}
        # /metrics and the dashboard: pmetal.node.metrics, pmetal.dashboard.
        self.metrics = MetricsServer(config.metrics, self)
        # What its workers and drivers ran (pmetal.node.telemetry).
        self.telemetry = NodeTelemetry(self.pool)
        if config.metrics.enabled:   # a killed worker's counts since the last scrape
            self.pool.last_words = self.telemetry.last_words

    def statistics(self) -> NodeStatistics:
        members = self.membership.statistics()
        return NodeStatistics(len(self.pool.workers), len(self.pool.idle), self.actors.alive(),
                              self.actors.created, self.actors.restarts, members.members,
                              members.epoch, self._counts["requests"], self._counts["failed"],
                              len(self.actors.queue), self.owners.died,
                              self._counts["receive_errors"])

    # ------------------------------------------------------------- running

    def status(self) -> dict[str, Any]:
        """The node's own view (:func:`pmetal.node.status.describe`)."""
        return describe(self)

    async def run(self, on_ready: Any = None) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                self.pool.start(group, self.address, self._stopping)
                self._cancellable_task(self.pool.fill())
                self._cancellable_task(self.socket.count_refusals())
                if self.config.metrics.probe_interval > 0:   # the links' bandwidth, in turn
                    self._cancellable_task(self.cluster.probe_periodically(
                        self.config.metrics.probe_interval, self._stopping))
                self._cancellable_task(self.owners.watch.poll(self._stopping))
                self._cancellable_task(self.owners.expire_leases(self._stopping))
                self._cancellable_task(self.cluster.run(self._stopping, self._discovery()))
                if on_ready is not None:
                    on_ready(self)
                self._cancellable_task(self.metrics.start(
                    EMBEDDED_DELAY if self.embedded else 0.0, self._stopping))
                serve = group.create_task(self._serve())
                await self._stopping.wait()
                # interrupt() makes the pending arecv raise ClosedError: a
                # cancel alone can be lost when it races a completing receive.
                self.listener.interrupt()
                serve.cancel()
                for task in self._cancellable:
                    task.cancel()
                self.pool.kill_all()
                await self.metrics.close()
        finally:
            self.owners.close()
            self.listener.close()
            self.membership.close()
            self.pool.close()
            self.gate.close()

    def stop(self) -> None:
        self._stopping.set()

    async def _serve(self) -> None:
        failures = 0   # receives in a row that failed
        while True:
            try:
                incoming = await self.listener.arecv()
            except ClosedError:
                return
            except TransportError as exc:
                # A receive that fails (ZeroMQ out of descriptors, say) is
                # not the end of the node: log, count, try again. Only a
                # socket that fails every time stops it, rather than spin.
                failures += 1
                self._counts["receive_errors"] += 1
                if failures >= _MAX_RECEIVE_FAILURES:
                    log.error("the node's socket failed %d receives in a row; stopping: %s",
                              failures, exc)
                    raise
                log.warning("a receive on the node's socket failed: %s", exc)
                await asyncio.sleep(_RECEIVE_BACKOFF)
                continue
            failures = 0
            self._counts["requests"] += 1
            leases = self.owners.leases
            if leases:   # any message from a remote owner renews its lease
                leases.renew(incoming.peer, time.monotonic())
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
            log.debug("the refusal's traceback", exc_info=exc)
        else:
            log.error("a %s from %s failed", kind, incoming.peer[:8], exc_info=exc)
        return Failure(FailureKind.BAD_REQUEST, type(exc).__name__, str(exc) or repr(exc))

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
            self._later(incoming, self.scheduler.lookup(body))  # type: ignore[arg-type]
            return None
        if kind is KillActor:
            if body.worker_address:  # type: ignore[attr-defined]
                return self.pool.kill_task_worker(body.worker_address)  # type: ignore[attr-defined]
            if body.actor_id in self.actors.actors or not body.node_id:  # type: ignore[attr-defined]
                self._later(incoming, self.actors.kill(body))  # type: ignore[arg-type]
                return None
            self._later(incoming, self.actors.kill_remote(body))  # type: ignore[arg-type]
            return None
        if kind is LeaseWorkers:
            self._later(incoming, self.pool.lease(body))  # type: ignore[arg-type]
            return None
        if kind is StatusRequest:
            self._later(incoming, status_with_calls(self, probe=body.detail,  # type: ignore[attr-defined]
                                                   measure=body.measure))  # type: ignore[attr-defined]
            return None
        if kind in STORE_KINDS:
            self._later(incoming, self.store.answer(body))
            return None
        if kind is ResourcesRequest:
            if body.measure:  # type: ignore[attr-defined]
                self._later(incoming, resources_measured(self, body.actors))  # type: ignore[attr-defined]
                return None
            return resources(self, body.actors)  # type: ignore[attr-defined]
        if kind is MachineRequest:   # a member's dashboard: what this machine hosts
            from pmetal.dashboard.snapshot import hosted
            return Machine(**hosted(self))
        if kind is ReserveBundles:
            return self.groups.reserve(body)  # type: ignore[arg-type]
        if kind is PlacementGroupQuery:
            self._later(incoming, self.groups.query(body))  # type: ignore[arg-type]
            return None
        if kind is CreatePlacementGroup:
            self._later(incoming, self._create_group(body, incoming))  # type: ignore[arg-type]
            return None
        if kind is OwnerDied:
            if body.node_id != incoming.peer:  # type: ignore[attr-defined]
                raise ValueError(f"OwnerDied for node {body.node_id[:8]} came from node "  # type: ignore[attr-defined]
                                 f"{incoming.peer[:8]}; a node reports its own processes")
            return Ack(self.owners.owner_died(body.node_id, body.pid, body.client))  # type: ignore[attr-defined]
        if kind is Telemetry:
            session = self.listener.session(incoming.route)
            pid = session.peer_pid if session is not None and session.local else 0
            return self.telemetry.accept(incoming.peer, body, pid)  # type: ignore[arg-type]
        if kind is Detach:
            return Ack(self.owners.client_gone(incoming.peer, f"its owner (client "
                                                              f"{incoming.peer[:8]}) shut down"))
        if kind in _CLUSTER:
            return self.cluster.receive(incoming.peer, body)
        if kind is WatchCluster:
            self._later(incoming, self.cluster.watch(body))  # type: ignore[arg-type]
            return None
        if kind is NodeJoin:
            # Membership before the cluster service (an older static peer):
            # it is beaten like any node found.
            if body.node_id != incoming.peer:  # type: ignore[attr-defined]
                raise ValueError(f"a NodeJoin for node {body.node_id[:8]} came from node "  # type: ignore[attr-defined]
                                 f"{incoming.peer[:8]}; a node joins as itself")
            self.cluster.discovered(body.node_id, body.address)  # type: ignore[attr-defined]
            return Status(self.status())
        if kind is Shutdown:
            log.info("shutdown requested by %s: %s", incoming.peer, body.reason)  # type: ignore[attr-defined]
            asyncio.get_running_loop().call_soon(self.stop)
            return Ack()
        return Failure(FailureKind.BAD_REQUEST, "ProtocolError",
                       f"a node does not handle {kind.__name__} messages")

    # --------------------------------------------------------------- actors

    async def _create_actor(self, spec: CreateActor, incoming: Incoming) -> Message:
        check_options(spec.options)
        if spec.options.get("term") is not None:
            # Placed by the master: construct it here, unless the term is stale.
            return await self.scheduler.placed(spec, incoming.peer)
        if spec.options.get("owner_node") == incoming.peer:
            # From the creator's node (which named the owner: only that
            # node's own session can pass an owner on) to the master.
            return await self.scheduler.decide(spec, origin=incoming.peer)
        # The creator's own node names the owner (see Owners.name).
        local = bool(getattr(self.listener.session(incoming.route), "local", False))
        options = self.owners.name(spec.options, incoming.peer, local)
        if options is None:
            return Failure(FailureKind.ACTOR_DIED, "ActorDiedError",
                           f"the process that creates the actor (pid "
                           f"{spec.options.get('owner_pid')}) has exited")
        reply = await self.scheduler.place(replace(spec, options=options))
        if isinstance(reply, ActorLocation) and not local:
            reply = replace(reply, owner_lease=self.owners.leases.timeout)
        return reply

    async def _create_group(self, body: CreatePlacementGroup, incoming: Incoming) -> Message:
        """A client's new placement group: this node holds it, owned like
        an actor by the process (or remote session) that made it."""
        local = bool(getattr(self.listener.session(incoming.route), "local", False))
        options = self.owners.name(dict(body.options), incoming.peer, local)
        if options is None:
            return Failure(FailureKind.ACTOR_DIED, "ActorDiedError",
                           f"the process that creates the placement group (pid "
                           f"{body.options.get('owner_pid')}) has exited")
        reply = await self.groups.create(body, options)
        if isinstance(reply, PlacementGroups) and reply.groups and not local:
            # Another machine's client: it keeps the group by renewing a lease.
            reply.groups[0]["owner_lease"] = self.owners.leases.timeout
        return reply

    def _end_owned(self, owned_by: Any, why: str) -> int:
        """An owner went: its actors end and its placement groups are removed."""
        return self.actors.kill_owned(owned_by, why) + self.groups.remove_owned(owned_by, why)

    async def _worker_exited(self, worker: WorkerProc, code: int) -> None:
        await self.actors.worker_exited(worker, code)

    # -------------------------------------------------------------- cluster

    def _discovery(self) -> Any:
        """The mDNS announcer and browser, when this node discovers."""
        if not self.discover:
            return None
        from pmetal.cluster.discovery import Discovery, discovery_interfaces
        cluster = self.cluster
        return Discovery(
            self.node_id, self.address, self.namespace,
            interfaces=discovery_interfaces(self.interfaces, self.listener.address),
            incarnation=cluster.incarnation, resources=self.resources,
            on_peer=lambda p: cluster.discovered(p.node_id, p.address, p.incarnation,
                                                 dict(p.resources)),
            on_gone=cluster.withdrawn, max_records=self.config.discovery.max_records)

    def _view_changed(self, state: ElectionState) -> None:
        """The master's member list changed: members are its live nodes.
        Placement groups hear of the nodes it holds dead before the
        scheduler restarts their actors: a restart then waits for its
        bundle to be placed again, rather than being sent to the dead node
        (which failed it, and a detector that declared the node dead while
        it was being sent found nothing left to restart)."""
        self.membership.sync(state, self.node_id)
        listed_dead = {m.node_id for m in state.members
                       if m.state == MemberState.DEAD and m.node_id != self.node_id}
        for node_id in listed_dead - self._listed_dead:
            self.groups.node_dead(node_id)
        self._listed_dead = listed_dead
        self.scheduler.view_changed(state)
        self.groups.kick()

    def _node_dead(self, node_id: str) -> None:
        """Our detector declared ``node_id`` dead: never wait on it again."""
        self.membership.drop(node_id)
        self.groups.node_dead(node_id)
        self.scheduler.node_dead(node_id)

    def _fenced(self, why: str) -> None:
        """This node was (or may have been) declared dead: the cluster has
        restarted its actors elsewhere or holds them dead, so none may run
        here any more. Actors whose owner runs on this node and that may
        restart are restarted here (their owner's node restarts them, and
        that is this node); the others end."""
        ended = restarted = 0
        for record in list(self.actors.actors.values()):
            if record.state == ActorState.DEAD:
                continue
            local_owner = record.owner[0] == self.node_id
            if local_owner and record.restarts_left != 0 and restarted_elsewhere(record.spec):
                # This copy replaced one on a node held dead, which may have
                # been merely cut off and still runs it: the master (of the
                # side that won) looks it up before placing it again.
                self.actors.kill_record(record, True, f"fenced: {why}")
                self.scheduler.place_again(record)
                restarted += 1
            elif local_owner and record.restarts_left != 0:
                self.actors.kill_record(record, False, f"fenced: {why}")
                restarted += 1
            else:
                # One owned elsewhere that may restart: its owner's node
                # restarts it once the master's list shows this node fenced
                # (a new incarnation of it, or dead); until then a lookup
                # here says "moved", not "dead".
                record.moved = not local_owner and record.restarts_left != 0
                self.actors.kill_record(record, True, f"node {self.node_id[:8]} was fenced: "
                                                      f"{why}")
                ended += 1
        log.warning("fenced: ended %d actors, restarting %d owned here", ended, restarted)
        self.groups.fenced()

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
    parser = argparse.ArgumentParser(prog="python -m pmetal.node")
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--num-workers", type=int, default=None)
    parser.add_argument("--num-task-workers", type=int, default=None)
    parser.add_argument("--resources", default="{}", help="JSON object of extra resources")
    parser.add_argument("--peers", default="", help="comma-separated host:port of other nodes")
    parser.add_argument("--discovery", action=argparse.BooleanOptionalAction, default=None,
                        help="announce and discover nodes with mDNS")
    parser.add_argument("--interfaces", default=None,
                        help="comma-separated IPv4 addresses for mDNS")
    parser.add_argument("--embedded", action="store_true",
                        help="started by pmetal.init(): exit when stdin closes")
    args = parser.parse_args(argv)
    # Workers share the machine's cores: OpenBLAS threads that busy-wait
    # ~0.1 s after every call (its default) steal the core another worker
    # (a pipeline's next stage, another actor) is computing on. Idle BLAS
    # threads sleep at once instead; this must be in the environment before
    # any worker (or the fork server) imports numpy.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    # First, while this process has one thread and no ZeroMQ context, and
    # before it loads its key pair (workers run user code): the fork server
    # that starts workers in milliseconds (pmetal.node.zygote).
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
                            embedded=args.embedded, fork_server=fork_server,
                            discovery=args.discovery, interfaces=args.interfaces)
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
