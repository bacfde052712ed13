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
from dataclasses import dataclass, field
from typing import Any

from pmetal.actors.membership import Membership
from pmetal.actors.pool import WorkerPool, WorkerProc
from pmetal.actors.zygote import ForkServer
from pmetal.config import PMetalConfig, load_config, pmetal_home, setup_process_logging
from pmetal.endpoint import Incoming, SecureListener
from pmetal.errors import ClosedError, PeerError, PMetalError, PMetalTimeoutError
from pmetal.hardware import gpu_count
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.wire import (Ack, ActorLocation, CreateActor, Failure, InitActor, KillActor,
                         LeaseWorkers, LookupActor, Message, NodeJoin, Ping, Pong,
                         Shutdown, Status, StatusRequest, WorkerReady)

__all__ = ["NodeDaemon", "NodeStatistics", "main"]

log = logging.getLogger(__name__)

READY_LINE = "PMETAL_NODE_READY"


@dataclass
class ActorRecord:
    spec: CreateActor
    state: str = "pending"         # pending, alive, restarting, dead
    worker_id: str = ""
    incarnation: int = 0
    restarts_left: int = 0
    reason: str = ""
    no_restart: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def location(self, node_id: str, address: str) -> ActorLocation:
        o = self.spec.options
        return ActorLocation(self.spec.actor_id, self.state, address, node_id, self.incarnation,
                             o.get("name") or "", self.reason, o.get("class_name") or "",
                             tuple(o.get("methods") or ()), bool(o.get("is_async")))

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


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
        self.resources = {**default_resources(), **(resources or {})}
        self.available = dict(self.resources)
        self.peers = list(peers or [])
        cpus = os.cpu_count() or 1
        self.pool = WorkerPool(
            node_id=self.node_id, host=host, identity=identity, namespace=namespace,
            config=config, transport=self.transport,
            num_actor=max(1, num_workers if num_workers is not None else max(2, cpus)),
            num_task=max(1, num_task_workers if num_task_workers is not None else cpus),
            on_exit=self._worker_exited, fork_server=fork_server)
        self.actors: dict[str, ActorRecord] = {}
        self.names: dict[str, str] = {}
        self._claiming: set[str] = set()   # names being looked up on the peers
        self.membership = Membership(identity, namespace, config, self.transport)
        self._stopping = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None
        self._cancellable: set[asyncio.Task[Any]] = set()
        self._counts = {"created": 0, "restarts": 0, "requests": 0}

    @property
    def address(self) -> str:
        return self.listener.address

    def statistics(self) -> NodeStatistics:
        alive = sum(1 for a in self.actors.values() if a.state == "alive")
        members = self.membership.statistics()
        return NodeStatistics(len(self.pool.workers), len(self.pool.idle), alive, self._counts["created"],
                              self._counts["restarts"], members.members, members.epoch,
                              self._counts["requests"])

    # ------------------------------------------------------------- running

    async def run(self, on_ready: Any = None) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                self.pool.start(group, self.address, self._stopping)
                self._cancellable_task(self.pool.fill())
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
            reply = self._handle_now(incoming)
            if reply is not None:
                await self._reply(incoming, reply)

    async def _reply(self, incoming: Incoming, reply: Message) -> None:
        if not incoming.envelope.corr:
            return
        try:
            await self.listener.areply(incoming, reply)
        except (PeerError, PMetalTimeoutError) as exc:
            log.warning("could not reply to %s: %s", incoming.peer, exc)

    def _later(self, incoming: Incoming, work: Any) -> None:
        """Run a slow request in its own task so the loop keeps serving."""
        async def run() -> None:
            try:
                reply = await work
            except (PMetalError, OSError) as exc:  # OSError: out of descriptors, processes
                reply = Failure("bad_request", type(exc).__name__, str(exc))
            await self._reply(incoming, reply)
        self._cancellable_task(run())

    def _cancellable_task(self, coro: Any) -> None:
        """A task that shutdown cancels (requests, peer joins, restarts)."""
        assert self._group is not None
        task = self._group.create_task(coro)
        self._cancellable.add(task)
        task.add_done_callback(self._cancellable.discard)

    def _handle_now(self, incoming: Incoming) -> Message | None:
        body = incoming.body
        kind = type(body)
        if kind is Ping:
            return Pong(body.payload)  # type: ignore[attr-defined]
        if kind is WorkerReady:
            return self.pool.ready(body)  # type: ignore[arg-type]
        if kind is CreateActor:
            self._later(incoming, self._create_actor(body))  # type: ignore[arg-type]
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
        if record is None or record.worker_id != worker.worker_id:
            return
        self._release(record)
        why = ("killed by pmetal.kill" if record.no_restart else
               f"its worker process (pid {worker.proc.pid}) exited with code {code}")
        if record.no_restart or record.restarts_left == 0:
            record.state, record.reason = "dead", why
            record.notify()
            return
        if record.restarts_left > 0:
            record.restarts_left -= 1
        record.state, record.reason = "restarting", why
        record.incarnation += 1
        self._counts["restarts"] += 1
        record.notify()
        log.info("restarting actor %s (incarnation %d): %s", record.spec.actor_id,
                 record.incarnation, why)
        self._cancellable_task(self._construct(record))

    # --------------------------------------------------------------- actors

    def _fits(self, need: dict[str, float], pool: dict[str, float]) -> bool:
        return all(pool.get(k, 0.0) >= v for k, v in need.items() if v)

    @staticmethod
    def _needs(options: dict[str, Any]) -> dict[str, float]:
        need = {k: float(v) for k, v in (options.get("resources") or {}).items()}
        if options.get("num_cpus"):
            need["CPU"] = float(options["num_cpus"])
        return need

    def _release(self, record: ActorRecord) -> None:
        if record.state in ("alive", "pending", "restarting") and record.worker_id:
            for k, v in self._needs(record.spec.options).items():
                self.available[k] = self.available.get(k, 0.0) + v
        record.worker_id = ""

    async def _create_actor(self, spec: CreateActor) -> Message:
        options = spec.options
        target = options.get("node") or ""
        need = self._needs(options)
        if target and target != self.node_id:
            return await self._forward(target, spec)
        if not target and not self._fits(need, self.resources):
            for member in self.membership.members.values():
                if self._fits(need, member.resources):
                    return await self._forward(member.node_id, spec)
            return Failure("placement", "PlacementError",
                           f"no node has resources {need}; this cluster's nodes have "
                           f"{self.membership.total_resources(self.resources)}")
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
        if not self._fits(need, self.available):
            return Failure("placement", "PlacementError",
                           f"node {self.node_id[:8]} has {self.available} free, the actor "
                           f"needs {need}; kill an actor or add a node")
        record = ActorRecord(spec, restarts_left=int(options.get("max_restarts") or 0))
        self.actors[spec.actor_id] = record
        if name:
            self.names[name] = spec.actor_id
        self._counts["created"] += 1
        return await self._construct(record)

    async def _construct(self, record: ActorRecord) -> Message:
        spec = record.spec
        deadline = time.monotonic() + self.config.transport.connect_timeout
        for k, v in self._needs(spec.options).items():
            self.available[k] = self.available.get(k, 0.0) - v
        try:
            worker = await self.pool.take_idle(deadline)
        except PMetalTimeoutError as exc:
            record.worker_id = "none"
            self._release(record)
            record.state, record.reason = "dead", str(exc)
            record.notify()
            return Failure("placement", "PlacementError", str(exc))
        worker.actor_id = spec.actor_id
        record.worker_id = worker.worker_id
        init = InitActor(spec.actor_id, spec.cls_id, spec.cls_ref, spec.args, spec.kwargs,
                         spec.options, record.incarnation)
        try:
            channel = await self.pool.channel(worker, self.config.transport.handshake_timeout)
            reply = (await channel.arequest(init)).body
        except PMetalError as exc:
            reply = Failure("actor_died", "ActorDiedError",
                            f"the worker died while constructing the actor: {exc}")
        if isinstance(reply, Failure):
            self._release(record)
            self.pool.kill(worker)
            record.state = "dead"
            record.reason = f"constructor failed: {reply.error_type}: {reply.message}"
            record.notify()
            return reply
        record.state, record.reason = "alive", ""
        record.notify()
        return record.location(self.node_id, worker.address)

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
        record.no_restart = body.no_restart
        worker = self.pool.workers.get(record.worker_id)
        if worker is not None:
            self.pool.kill(worker)
        elif record.state != "dead":
            record.state, record.reason = "dead", "killed by pmetal.kill"
            record.notify()
        return Ack()

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

    # ------------------------------------------------------------ membership

    async def _forward(self, node_id: str, spec: CreateActor) -> Message:
        member = self.membership.find(node_id)
        if member is None:
            return Failure("placement", "PlacementError",
                           f"no node {node_id} in this cluster; members: "
                           f"{[self.node_id, *self.membership.members]}")
        options = dict(spec.options)
        options["node"] = member.node_id
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
            "workers": self.pool.describe(),
            "actors": [{"actor_id": a.spec.actor_id, "name": a.spec.options.get("name") or "",
                        "class_name": a.spec.options.get("class_name") or "",
                        "state": a.state, "incarnation": a.incarnation, "reason": a.reason}
                       for a in self.actors.values()],
            "statistics": self.statistics().__dict__,
            "pool": self.pool.statistics().__dict__,
            "membership": self.membership.statistics().__dict__,
        }


# ----------------------------------------------------------------- process

def read_ready_line(proc: Any, timeout: float) -> str:
    """The ``PMETAL_NODE_READY <address> <node id>`` line a node process prints
    on stdout when it serves, read byte by byte (what follows is user output)
    with a deadline. Kills the process when it does not come."""
    import selectors
    deadline = time.monotonic() + timeout
    line = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                proc.kill()
                proc.wait()
                raise PMetalTimeoutError(f"the pmetal node did not report ready within "
                                         f"{timeout:.3g} s")
            chunk = os.read(proc.stdout.fileno(), 1)
            if not chunk:
                raise PMetalError(f"the pmetal node exited at start (code {proc.wait()}); its "
                                  f"error is printed above")
            line += chunk
    text = line.decode(errors="replace").strip()
    if not text.startswith(READY_LINE + " "):
        proc.kill()
        proc.wait()
        raise PMetalError(f"unexpected output from the pmetal node: {text!r}")
    return text


def node_file(home: Any = None) -> Any:
    """``~/.pmetal/node.json``: where ``address="auto"`` and ``pmetal stop``
    find the daemon running on this machine."""
    return (pmetal_home() if home is None else home) / "node.json"


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
    except (PMetalError, ValueError) as exc:
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
