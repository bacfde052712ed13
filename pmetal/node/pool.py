"""A node's worker processes: the pre-started pool.

The node starts ``num_actor`` actor workers and ``num_task`` task workers as
soon as it serves, and keeps both counts up: taking an idle actor worker
starts its replacement, a creation that finds no idle worker starts one of
its own at once, and a task worker that dies is replaced. Workers are forked
by the node's fork server (:mod:`pmetal.node.zygote`: a few milliseconds
each) or, where there is none or it died, started as interpreters
(``python -m pmetal.actors.worker``: a few hundred). Each worker announces
itself with ``WorkerReady``; until then it is "starting". The node's channel
to a worker is opened once, by whoever needs it first (actor construction, a
status ask), and shared.

When a worker process exits, the pool forgets it and then calls the node's
``on_exit`` (which restarts the actor it hosted, if it may).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pmetal import shm
from pmetal.node.zygote import ForkedProcess, ForkServer, ForkServerError
from pmetal.config import PMetalConfig
from pmetal.endpoint import Channel
from pmetal.errors import PMetalError, PMetalTimeoutError
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.wire import (Ack, Failure, LeaseWorkers, Message, Status, StatusRequest, WorkerList,
                         WorkerReady)

__all__ = ["PoolStatistics", "WorkerPool", "WorkerProc"]

log = logging.getLogger(__name__)

_POOL_DELAY = 0.15   # s after the node is ready before the pool starts interpreters
_LEASE_GRACE = 1.0   # s a lease waits for task workers that are still starting
_STATUS_WAIT = 0.5   # s a worker may take to report its calls to `pmetal status`
_LAST_WORDS = 0.05   # s a worker being killed may take to give its last report


@dataclass
class WorkerProc:
    worker_id: str
    role: str                      # "actor", "task", or "lent" (a task's own worker)
    proc: asyncio.subprocess.Process | ForkedProcess
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    address: str = ""
    channel: Channel | None = None   # set only once its handshake has completed
    opening: asyncio.Lock = field(default_factory=asyncio.Lock)
    actor_id: str = ""
    killed: bool = False


@dataclass(frozen=True)
class PoolStatistics:
    workers: int          # processes alive now, any role
    idle: int             # actor workers ready and free
    starting: int         # started, not ready yet
    started: int          # processes started since the node started
    forked: int           # of which forked by the fork server (the others: interpreters)
    exited: int           # processes that exited (killed, crashed, or at shutdown)
    spawn_failures: int   # starts refused by the OS (no processes, memory or descriptors left)


class WorkerPool:
    def __init__(self, *, node_id: str, host: str, identity: NodeIdentity,
                 namespace: NetworkNamespace, config: PMetalConfig, transport: ZmqTransport,
                 num_actor: int, num_task: int,
                 on_exit: Callable[[WorkerProc, int], Awaitable[None]],
                 fork_server: ForkServer | None = None,
                 gate: tuple[str, float] | None = None) -> None:
        self._node_id = node_id
        self._gate = gate   # (path, stale): the node's gate (pmetal.cluster.clock)
        self._host = host
        self._identity = identity
        self._namespace = namespace
        self._config = config
        self._transport = transport
        self.num_actor = num_actor
        self.num_task = num_task
        self._on_exit = on_exit
        self._fork_server = fork_server
        self._spawning = {"actor": 0, "task": 0}   # asked for, not yet in ``workers``
        self._settled = 0                 # workers that became ready, or exited before
        self._settled_changed = asyncio.Event()
        self._waiting = 0        # creations waiting for an idle actor worker
        self.workers: dict[str, WorkerProc] = {}
        self.idle: list[str] = []
        self.idle_changed = asyncio.Event()
        self.task_ready = asyncio.Event()
        self._ids = itertools.count()
        self._group: asyncio.TaskGroup | None = None
        self._node_address = ""
        self._stopping = asyncio.Event()
        self._counts = {"started": 0, "exited": 0, "spawn_failures": 0}
        # Asks a worker for its last report before end() kills it (the node's telemetry).
        self.last_words: Callable[[WorkerProc], Awaitable[None]] | None = None

    def statistics(self) -> PoolStatistics:
        starting = self._starting()
        forked = self._fork_server.forked if self._fork_server is not None else 0
        return PoolStatistics(len(self.workers), len(self.idle), starting,
                              self._counts["started"], forked, self._counts["exited"],
                              self._counts["spawn_failures"])

    def start(self, group: asyncio.TaskGroup, node_address: str,
              stopping: asyncio.Event) -> None:
        """Owned by ``group``; workers dial ``node_address``; ``stopping``
        set means the node shuts down (no replacements)."""
        self._group = group
        self._node_address = node_address
        self._stopping = stopping

    async def fill(self) -> None:
        """Start the pool. Forked workers start at once (a fork costs the
        node next to nothing, and the first actor of a fresh driver waits for
        one); on two cores, the actor workers first, then the task workers,
        then the fork server's heavy imports (numpy), so that the first
        actor's worker does not share the CPUs with the rest. Starting an
        interpreter per worker takes both cores for a few hundred ms: then
        the driver that started the node gets a moment to finish its
        handshake first (pmetal.init() returns as soon as it has)."""
        server = self._fork_server
        if server is None or not server.alive:
            try:
                await asyncio.wait_for(self._stopping.wait(), _POOL_DELAY)
                return
            except asyncio.TimeoutError:
                pass
            for role, count in (("actor", self.num_actor), ("task", self.num_task)):
                for _ in range(count):
                    self.spawn(role)
            return
        deadline = time.monotonic() + self._config.transport.connect_timeout
        for role, count in (("actor", self.num_actor), ("task", self.num_task)):
            for _ in range(count):
                self.spawn(role)
            await self._until_settled(self._settled + count, deadline)
        server.preload()

    def _starting(self) -> int:
        return sum(self._spawning.values()) + sum(
            1 for w in self.workers.values() if not w.ready.is_set())

    async def _until_settled(self, count: int, deadline: float) -> None:
        """Until ``count`` workers have settled (ready, or exited before),
        or ``deadline``."""
        while self._settled < count:
            self._settled_changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(self._settled_changed.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _settle(self) -> None:
        self._settled += 1
        self._settled_changed.set()

    def spawn(self, role: str) -> None:
        assert self._group is not None
        self._spawning[role] = self._spawning.get(role, 0) + 1
        self._group.create_task(self._run(role))

    def _top_up(self) -> None:
        """Start actor workers until those idle or starting cover the pool's
        size plus every creation waiting for one."""
        unclaimed = len(self.idle) + self._spawning["actor"] + sum(
            1 for w in self.workers.values()
            if w.role == "actor" and not w.ready.is_set() and not w.actor_id and not w.killed)
        for _ in range(self.num_actor + self._waiting - unclaimed):
            self.spawn("actor")

    async def _start(self, worker_id: str) -> asyncio.subprocess.Process | ForkedProcess:
        argv = ["--node", self._node_address, "--worker-id", worker_id, "--host", self._host]
        if self._gate is not None:
            argv += ["--gate", self._gate[0], "--gate-stale", repr(self._gate[1])]
        extra = {"PMETAL_PSK_HEX": self._namespace.psk.hex(),
                 "PMETAL_SECURITY_NAMESPACE": self._namespace.name}
        if self._fork_server is not None and self._fork_server.alive:
            try:
                return await self._fork_server.spawn(argv, extra,
                                                     self._config.transport.connect_timeout)
            except ForkServerError as exc:
                log.warning("worker %s: %s; starting an interpreter instead", worker_id, exc)
        env = dict(os.environ)
        env.pop("PMETAL_PSK", None)
        env.update(extra)
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pmetal.actors.worker", *argv,
            stdin=asyncio.subprocess.PIPE, env=env)

    async def _run(self, role: str) -> None:
        worker_id = f"{self._node_id[:8]}-w{next(self._ids)}"
        try:
            proc = await self._start(worker_id)
        except OSError as exc:
            # Out of processes, memory or descriptors: the node lives on, and
            # a creation waiting for this worker times out saying the machine
            # is overloaded.
            self._counts["spawn_failures"] += 1
            self._settle()
            log.error("cannot start worker %s: %s", worker_id, exc)
            return
        finally:
            self._spawning[role] -= 1
        worker = WorkerProc(worker_id, role, proc)
        self.workers[worker_id] = worker
        self._counts["started"] += 1
        if self._stopping.is_set():  # shut down while this worker was starting
            self.kill(worker)
        code = await proc.wait()
        await self._exited(worker, code)

    async def _exited(self, worker: WorkerProc, code: int) -> None:
        self._counts["exited"] += 1
        if not worker.ready.is_set():
            self._settle()
        self.workers.pop(worker.worker_id, None)
        if worker.worker_id in self.idle:
            self.idle.remove(worker.worker_id)
        if worker.channel is not None:
            worker.channel.close()
        shm.sweep()   # what the worker was sent and never read, what it made for nobody
        if self._stopping.is_set():
            return
        if worker.role == "task" and not worker.killed:
            log.warning("task worker %s exited with code %s; starting another",
                        worker.worker_id, code)
            self.spawn("task")
        if worker.role == "actor" and not worker.actor_id and worker.ready.is_set():
            # An idle worker died: replace it. One that died before it was
            # ready is not (a worker that cannot start would be forked in a loop).
            self._top_up()
        await self._on_exit(worker, code)

    def ready(self, body: WorkerReady) -> Message:
        worker = self.workers.get(body.worker_id)
        if worker is None:
            return Failure("bad_request", "PeerError", f"unknown worker {body.worker_id}")
        if not worker.ready.is_set():
            self._settle()
        worker.address = body.address
        worker.ready.set()
        if worker.role == "task":
            self.task_ready.set()
        if worker.role == "actor" and not worker.actor_id:
            self.idle.append(worker.worker_id)
            self.idle_changed.set()
        return Ack()

    async def take_idle(self, deadline: float) -> WorkerProc:
        """The first actor worker to be idle (its replacement is started at
        once; with none idle, one is started for this caller at once)."""
        if not self.idle:
            self._waiting += 1
            try:
                self._top_up()
                while not self.idle:
                    self.idle_changed.clear()
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise PMetalTimeoutError("no idle worker became ready in time; the "
                                                 "machine may be overloaded")
                    try:
                        await asyncio.wait_for(self.idle_changed.wait(), remaining)
                    except asyncio.TimeoutError:
                        continue
            finally:
                self._waiting -= 1
        worker = self.workers[self.idle.pop(0)]
        self._top_up()  # keep the pool full
        return worker

    def end(self, worker: WorkerProc) -> None:
        """Kill ``worker``, after its last report to the node's telemetry
        (:attr:`last_words`, when set: a worker's counts since the last
        scrape would be lost with it) if it answers within
        :data:`_LAST_WORDS` seconds on the channel the node has open to it;
        at once otherwise (a sync worker busy in a call cannot answer)."""
        ask = self.last_words
        if (ask is None or self._group is None or worker.channel is None
                or not worker.ready.is_set() or worker.proc.returncode is not None):
            self.kill(worker)
            return
        worker.killed = True

        async def then_kill() -> None:
            try:
                await asyncio.wait_for(ask(worker), _LAST_WORDS)
            except (PMetalError, TimeoutError):
                pass
            finally:
                self.kill(worker)
        self._group.create_task(then_kill())

    def kill(self, worker: WorkerProc) -> None:
        worker.killed = True
        if worker.proc.returncode is None:
            try:
                worker.proc.kill()
            except ProcessLookupError:
                pass

    def kill_task_worker(self, address: str) -> Message:
        """KillActor(worker_address=...): pmetal.cancel(force=True) of a task
        running there. Not marked killed: it is replaced as a crashed one."""
        worker = next((w for w in self.workers.values()
                       if w.role == "task" and w.address == address), None)
        if worker is None:
            return Failure("not_found", "ValueError",
                           f"no task worker of this node at {address} (it exited already?)")
        log.info("killing task worker %s: a task running there was cancelled with force=True",
                 worker.worker_id)
        if worker.proc.returncode is None:
            try:
                worker.proc.kill()
            except ProcessLookupError:
                pass
        return Ack()

    def kill_all(self) -> None:
        for worker in list(self.workers.values()):
            self.kill(worker)

    def close(self) -> None:
        for worker in self.workers.values():
            if worker.channel is not None:
                worker.channel.close()
        if self._fork_server is not None:
            self._fork_server.close()

    async def channel(self, worker: WorkerProc, timeout: float) -> Channel:
        """The node's open channel to a worker; the first caller opens it and
        the others (actor construction, status) wait for that."""
        async with worker.opening:
            if worker.channel is None:
                channel = Channel(self._transport.dial(worker.address), self._identity,
                                  self._namespace, self._config)
                try:
                    await channel.aopen(timeout)
                except BaseException:
                    channel.close()
                    raise
                worker.channel = channel
            return worker.channel

    async def lease(self, body: LeaseWorkers) -> Message:
        deadline = time.monotonic() + self._config.transport.connect_timeout
        lend, avoid = body.count, set(body.avoid)
        if lend > 0:
            # A task that waits on tasks gets workers of its own from the idle
            # pool (replaced at once), so nested tasks never queue behind the
            # busy tasks that wait for them.
            lent = []
            for _ in range(min(lend, 4)):
                try:
                    worker = await self.take_idle(deadline)
                except PMetalTimeoutError as exc:
                    return Failure("placement", "PlacementError", str(exc))
                worker.role = "lent"
                lent.append(worker.address)
            return WorkerList(tuple(lent))
        # Task workers that are starting (all of them, just after the node
        # started) are waited for a little: a caller sends its tasks to the
        # workers it is given, and a burst given one worker would run in turn.
        grace = time.monotonic() + _LEASE_GRACE
        while True:
            ready = tuple(w.address for w in self.workers.values()
                          if w.role == "task" and w.ready.is_set() and w.address not in avoid)
            starting = self._spawning["task"] + sum(
                1 for w in self.workers.values() if w.role == "task" and not w.ready.is_set())
            if ready and (not starting or time.monotonic() >= grace):
                return WorkerList(ready, starting)
            remaining = (deadline if not ready else min(deadline, grace)) - time.monotonic()
            if remaining <= 0:
                if ready:
                    return WorkerList(ready, starting)
                return Failure("placement", "PlacementError",
                               "no task worker became ready on this node in time; the machine "
                               "may be overloaded")
            self.task_ready.clear()
            try:
                await asyncio.wait_for(self.task_ready.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    def describe(self) -> list[dict[str, Any]]:
        return [{"worker_id": w.worker_id, "pid": w.proc.pid, "role": w.role,
                 "address": w.address, "actor_id": w.actor_id, "ready": w.ready.is_set()}
                for w in self.workers.values()]

    async def add_calls(self, described: list[dict[str, Any]]) -> None:
        """Fill in each described worker's calls served, asked of the workers
        (a worker busy in a long call is left without a count)."""
        by_id = {w["worker_id"]: w for w in described}

        async def ask(worker: WorkerProc) -> None:
            # Timeouts of the channel's own, not a cancellation from outside:
            # the channel is shared with actor construction.
            try:
                channel = await self.channel(worker, _STATUS_WAIT)
                reply = (await channel.arequest(StatusRequest(), timeout=_STATUS_WAIT)).body
            except PMetalError:
                return
            if isinstance(reply, Status) and worker.worker_id in by_id:
                by_id[worker.worker_id]["calls"] = reply.info.get("calls")
                by_id[worker.worker_id]["calls_failed"] = reply.info.get("failed")

        ready = [w for w in self.workers.values() if w.ready.is_set() and w.address]
        # return_exceptions: a worker that dies meanwhile has its channel
        # closed under the ask (which ends cancelled); the others still count.
        await asyncio.gather(*(ask(w) for w in ready), return_exceptions=True)
