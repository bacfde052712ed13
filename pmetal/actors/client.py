"""The caller side of the actor runtime: what drivers and workers use to
create actors, call them, run remote functions and collect results.

A :class:`CoreClient` holds one authenticated channel to its node (control:
placement, lookups) and one :class:`PeerLink` per worker it calls (data: calls
and results go straight to the worker, never through a node). Each link
watches its TCP connection: when the worker's process dies the connection
drops, and every call pending on that link fails with
:class:`~pmetal.errors.ActorDiedError` within one wait slice (10 ms)
instead of waiting for a timeout. The next call on the handle asks the node where the actor lives
now (it may have been restarted) and carries on.

Sockets are used under one lock, so a client may be shared by threads; a
``get`` that waits holds it for one 10 ms slice at a time. Finding an actor
again (a lookup that waits for its restart, a session with a worker that
does not answer yet) happens without it, under a lock of that actor's own:
it holds up later calls to that actor, never calls to other actors.

The control channel to the node (requests, telling the node's death from
its silence, the lease a client on another machine holds on its actors) is
a :class:`~pmetal.actors.links.NodeLink`; the client's flush thread
renews the lease. At ``pmetal.shutdown()`` a client that created actors sends ``Detach``, and
its node ends those that are not detached, as Ray does when a driver leaves.

Getting, waiting for and cancelling results is :mod:`pmetal.actors.results`
(the :class:`~pmetal.actors.results.Results` part of the client).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from pmetal.actors.deferred import Deferrals, Retry
from pmetal.actors.ownership import OwnershipStatistics
from pmetal.channel import ChannelStatistics
from pmetal.actors.links import _TASKS, NodeLink, PeerLink
from pmetal.actors.locate import ActorCall, ActorLocator
from pmetal.actors.objects import ObjectManager, pack_collecting
from pmetal.actors.watch import ClusterWatch, peers_missing
from pmetal.actors.reporter import Reporter
from pmetal.actors.results import Results
from pmetal.actors.refs import ObjectRef, call_name, failure_error
from pmetal.actors.serialization import pack_value
from pmetal.config import PMetalConfig
from pmetal.errors import ActorDiedError, PeerError, PMetalError, PlacementError
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.wire import (ActorLocation, Call, CallBatch, CreateActor, Detach,
                         Failure, KillActor, LeaseWorkers, LookupActor, Message, RunTask, Shutdown, Status,
                         StatusRequest, WorkerList)

# PeerLink lives in pmetal.actors.links and stays importable from here.
__all__ = ["ClientStatistics", "CoreClient", "ObjectRef", "PeerLink"]

# Argument types sent as they are (no packing step needed).
_PLAIN = frozenset({type(None), bool, float, str, bytes})


def _plain(args: list[Any]) -> bool:
    """True when every argument travels as it is (no refs, nothing to pickle)."""
    for a in args:
        t = type(a)
        if t is int:
            if not -(1 << 63) <= a < (1 << 64):
                return False
        elif t not in _PLAIN:
            return False
    return True


_BATCH_MAX = 256          # calls per CallBatch
_LEASE_AGAIN_AFTER = 0.2  # s before asking again for task workers that were starting
_FLUSH_DELAY = 0.0005     # s a queued call may wait for company when nobody waits for it
_STREAM_LOAD = 1 << 20     # a task worker serving a stream runs nothing else until it ends


@dataclass(frozen=True, slots=True)
class ClientStatistics:
    calls: int                       # actor calls this client sent
    links: int                       # sessions open with workers
    node_channel: ChannelStatistics  # the session with its node
    objects: OwnershipStatistics | None   # objects it owns and borrows (None: none yet)


class CoreClient(Results):
    """One process's connection to the cluster."""

    def __init__(self, node_address: str, namespace: NetworkNamespace, config: PMetalConfig,
                 identity: NodeIdentity | None = None) -> None:
        self.config = config
        self.namespace = namespace
        self.identity = identity or NodeIdentity.generate()
        self.transport = ZmqTransport(config.transport, curve=namespace.curve_keys())
        self.node_address = node_address
        self.lock = threading.RLock()
        self.node_link = NodeLink(self.transport, self.identity, namespace, config, node_address,
                                  threading.RLock(), self._SLICE_MS / 1000)
        self.locator = ActorLocator(self)
        self.closed = False
        self.node = self.node_link.channel
        self.node_id = self.node_link.node_id
        self.links: dict[str, PeerLink] = {}
        self._task_workers: list[str] = []
        self._lease_again = 0.0   # when to ask for task workers again (some were starting)
        self._next_worker = itertools.count()
        self._actor_ids = itertools.count()
        self.calls = 0
        self._send_timeout = config.transport.send_timeout
        self.self_address = ""   # set in a worker: its own listener's address
        self._flusher: threading.Thread | None = None
        self._flush_wanted = threading.Event()
        self._closing = threading.Event()
        self._deferrals = Deferrals(self)
        self._created = False     # whether this client created actors (they die at detach)
        self._watch: ClusterWatch | None = None   # started with the first remote actor
        self._objects: ObjectManager | None = None   # made with the first ref in a value
        self.reporter: Reporter | None = None   # a driver's pushes to its node (report())

    @property
    def watch(self) -> ClusterWatch:
        """The cluster's dead nodes as our node tells them (a long poll in a
        thread of its own), started on first use: a client of one machine
        never needs it."""
        with self.lock:
            if self._watch is None:
                self._watch = ClusterWatch(self.transport, self.identity, self.namespace,
                                           self.config, self.node_address)
            return self._watch

    @property
    def objects(self) -> ObjectManager:
        """This process's owned and borrowed objects (refs inside values),
        made on first use."""
        objects = self._objects
        if objects is None:
            with self.lock:
                if self._objects is None:
                    self._objects = ObjectManager(self)
                objects = self._objects
        return objects

    def report(self) -> None:
        """Push what this process runs (collectives, pipelines) to our node
        from now on (a driver's; pmetal.actors.reporter), unless
        ``metrics.report_interval`` is 0."""
        interval = self.config.metrics.report_interval
        if interval > 0 and self.reporter is None:
            self.reporter = Reporter(self, interval)

    def worker_gone(self, process: str) -> None:
        """A link to the worker whose process id is ``process`` died (its
        process exited, or is being killed): the objects we lent it are no
        longer held for it (pmetal.actors.ownership)."""
        if self._objects is not None:
            self._objects.owned.drop(process, time.monotonic())

    def statistics(self) -> ClientStatistics:
        return ClientStatistics(self.calls, len(self.links), self.node.statistics(),
                                None if self._objects is None else self._objects.statistics())

    # ---------------------------------------------------------------- links

    def link(self, address: str) -> PeerLink:
        link = self.links.get(address)
        if link is None or link.dead:
            if link is not None:
                link.close()
            link = self.links[address] = PeerLink(self.transport, self.identity, self.namespace,
                                                  self.config, address, self.node_link,
                                                  self.worker_gone)
            # A worker busy in a long call answers the handshake only after
            # it: wait as long as for a request, not the short handshake time.
            try:
                link.channel.open(timeout=self.config.transport.request_timeout)
            except PMetalError as exc:
                link.die(f"cannot open a session with {address}: {exc}")
        return link

    def request_node(self, body: Message, timeout: float | None = None) -> Message:
        """``body``'s answer from our node (see :meth:`NodeLink.request`)."""
        return self.node_link.request(body, timeout)

    @property
    def node_dead(self) -> str:
        return self.node_link.dead

    def node_gone(self) -> bool:
        """Whether our node has died (see :meth:`NodeLink.gone`)."""
        return self.node_link.gone()

    # --------------------------------------------------------------- actors

    def new_actor_id(self) -> str:
        return f"{self.identity.node_id[:12]}-{os.getpid()}-{next(self._actor_ids)}"

    def create_actor(self, spec: CreateActor, timeout: float) -> ActorLocation:
        # This process owns the actor (it dies with us unless detached), and
        # the node answers before our deadline, also when it must queue it.
        spec.options.setdefault("owner_pid", os.getpid())
        spec.options["timeout"] = timeout
        self._created = True
        reply = self.request_node(spec, timeout=timeout)
        if isinstance(reply, Failure):
            raise failure_error(reply, f"creating actor {spec.options.get('class_name')}")
        if not isinstance(reply, ActorLocation):
            raise PeerError(f"node answered CreateActor with {type(reply).__name__}")
        if reply.owner_lease > 0 and not self.node_link.renew_every:
            # Our node cannot watch our process: keep our lease on the actor
            # (the flush thread renews it).
            self.node_link.hold_lease(reply.owner_lease)
            self._start_flusher()
        return reply

    def detach(self, timeout: float) -> int:
        """Tell our node that this client is leaving (``pmetal.shutdown()``):
        it ends the actors we created that are not detached. How many it
        ended there (0 when we created none)."""
        if not self._created:
            return 0
        reply = self.request_node(Detach("pmetal.shutdown()"), timeout=timeout)
        if isinstance(reply, Failure):
            raise failure_error(reply, "detaching from the node")
        self._created = False
        return int(getattr(reply, "info", 0) or 0)

    def lookup(self, actor_id: str = "", name: str = "", min_incarnation: int = 0,
               wait: float = 0.0) -> ActorLocation:
        reply = self.request_node(LookupActor(actor_id, name, min_incarnation, wait),
                                  timeout=wait + self.config.transport.request_timeout)
        if isinstance(reply, Failure):
            raise failure_error(reply)
        assert isinstance(reply, ActorLocation)
        return reply

    def kill(self, actor_id: str, no_restart: bool = True, node_id: str = "") -> None:
        """Kill an actor; ``node_id`` (its host) lets our node pass the
        request on when the actor lives elsewhere."""
        reply = self.request_node(KillActor(actor_id, no_restart, node_id))
        if isinstance(reply, Failure):
            raise failure_error(reply)
        # Its process is being killed: calls made from now on must not go to
        # it (and fail when it dies) but ask the node for the actor's next
        # incarnation (or learn that it is dead), as Ray's kill promises.
        with self.lock:
            for link in list(self.links.values()):
                if link.owner == actor_id:
                    link.die(f"actor {actor_id} was killed by pmetal.kill")

    def call(self, handle: Any, method: str, args: list[Any], kwargs: dict[str, Any]) -> ObjectRef:
        """Submit ``handle.method(*args, **kwargs)``. A call with ObjectRef
        arguments not ready yet waits for them in the background (so does a
        later call to the same actor: calls keep their order)."""
        deferrals = self._deferrals
        plain = not kwargs and _plain(args)
        retry = None
        if handle._max_task_retries:   # resubmitted if the actor dies (deferred.Retry)
            retry = Retry(ActorCall(self, handle, method), args, kwargs,
                          handle._actor_id, handle._max_task_retries)
        if ((deferrals.actors and handle._actor_id in deferrals.actors)
                or (not plain and Deferrals.unready(args, kwargs))):
            return deferrals.add(ActorCall(self, handle, method),
                                 args, kwargs, handle._actor_id, (handle, method), retry)
        if not plain:
            # Refs nested in the arguments are registered for the worker
            # once the link (the receiver) is known, in _submit.
            (args, kwargs), nested = pack_collecting(self._resolve_args, args, kwargs)
            return self._call_now(handle, method, args, kwargs, retry, nested=nested)
        return self._call_now(handle, method, args, kwargs, retry)

    def _call_now(self, handle: Any, method: str, args: list[Any],
                  kwargs: dict[str, Any], retry: Retry | None = None,
                  locate: bool = True, nested: list[ObjectRef] | None = None) -> ObjectRef:
        """Send a call whose arguments are packed (or queue it behind calls in
        flight). A call whose actor must be found again (its process or node
        died, or we have no link to it yet) waits for that without the
        client's lock: calls to other actors go on meanwhile."""
        with self.lock:
            link = self.locator.ready(handle)
            if link is not None:
                return self._submit(link, handle, method, args, kwargs, retry, nested)
            if not locate:   # the caller holds the lock: never wait for a location under it
                return ObjectRef.of_error(ActorDiedError(
                    f"{call_name(handle, method)}: its worker went away while the call was "
                    f"being sent"))
        found = self.locator.find(handle)
        if isinstance(found, BaseException):
            return ObjectRef.of_error(found)
        with self.lock:
            return self._submit(found, handle, method, args, kwargs, retry, nested)

    def _submit(self, link: PeerLink, handle: Any, method: str, args: list[Any],
                kwargs: dict[str, Any], retry: Retry | None,
                nested: list[ObjectRef] | None = None) -> ObjectRef:
        """Send (or queue) a call on ``link`` (lock held); ``nested``: the
        refs pickled inside its arguments, lent to the worker first."""
        if link.dead:   # died since it was found: fail the call as its calls failed
            ref = ObjectRef(self, None, 0, (handle, method), retry)
            ref._fail_link(link.dead)
            return ref
        if nested:
            self.objects.lend(nested, link.channel.peer or "")
        if link.outbox or link.channel.pending():
            # Calls in flight already: queue this one; queued calls leave
            # together (at get/wait, when the batch is full, or within
            # _FLUSH_DELAY), in order. A lone call is never delayed.
            ref = ObjectRef(self, None, 0, (handle, method), retry)
            ref._link = link
            link.outbox.append((ref, [method, args, kwargs]))
            link.outbox_actor = handle._actor_id
            self.calls += 1
            if len(link.outbox) >= _BATCH_MAX:
                self._flush(link)
            else:
                self._wake_flusher()
            return ref
        body = Call(handle._actor_id, method, args, kwargs)
        try:
            corr = link.channel.submit(body, timeout=self._send_timeout)
        except PeerError as exc:
            link.die(str(exc))
            return ObjectRef.of_error(ActorDiedError(f"{call_name(handle, method)}: {exc}"))
        self.calls += 1
        return ObjectRef(self, link, corr, (handle, method), retry)

    def _flush(self, link: PeerLink) -> None:
        """Send the calls queued on ``link`` (lock held)."""
        entries, link.outbox = link.outbox, []
        if not entries or link.dead:
            return
        refs = [ref for ref, _ in entries]
        try:
            if len(entries) == 1:
                method, args, kwargs = entries[0][1]
                corr = link.channel.submit(Call(link.outbox_actor, method, args, kwargs),
                                           timeout=self._send_timeout)
                refs[0]._corr = corr
                link.refs[corr] = refs[0]
            else:
                corrs = link.channel.reserve(len(entries))
                link.channel.send(CallBatch(link.outbox_actor, [call for _, call in entries],
                                            tuple(corrs)), timeout=self._send_timeout)
                for ref, corr in zip(refs, corrs):
                    ref._corr = corr
                    link.refs[corr] = ref
        except PeerError as exc:
            link.outbox = entries
            link.die(str(exc))

    def flush(self) -> None:
        """Send every queued call now."""
        with self.lock:
            for link in list(self.links.values()):
                if link.outbox:
                    self._flush(link)

    def _wake_flusher(self) -> None:
        self._start_flusher()
        self._flush_wanted.set()

    def _start_flusher(self) -> None:
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="pmetal-flush",
                                             daemon=True)
            self._flusher.start()

    def _flush_loop(self) -> None:
        """Sends queued calls that no get/wait has sent within _FLUSH_DELAY,
        so that fire-and-forget calls run even if nobody waits for them; and
        renews our lease on our actors when we hold one."""
        while not self._closing.is_set():
            wanted = self._flush_wanted.wait(timeout=min(1.0, self.node_link.renew_every or 1.0))
            if wanted:
                self._flush_wanted.clear()
                if self._closing.wait(_FLUSH_DELAY):
                    return
                self.flush()
            self.node_link.renew()

    def _on(self, link: PeerLink, handle: Any) -> PeerLink:
        """``link`` serves an actor of node ``handle._node_id``: on another
        node, the link fails its calls as soon as that node is declared dead."""
        link.node_id = handle._node_id
        if link.node_id and link.node_id != self.node_id:
            link.watch = self.watch
        return link

    def _link_for(self, address: str, owner: str) -> PeerLink | None:
        """Our link to ``address`` if it serves ``owner`` (an actor id, or
        _TASKS). A link opened for another owner is to a worker that is gone:
        a new worker was given its port (a port is reused once its process
        exits). ZeroMQ would reconnect that link to the new worker, with the
        old worker's session, so the link is dropped and a new one opened."""
        link = self.links.get(address)
        if link is not None and link.owner and link.owner != owner:
            link.die(f"the worker at {address} is gone; another worker has its address now")
            link.close()
            del self.links[address]
            return None
        return link

    @staticmethod
    def _own(link: PeerLink, owner: str) -> PeerLink:
        if not link.owner:
            link.owner = owner
        return link

    # ------------------------------------------------------------------ tasks

    def run_task(self, fn_id: str, fn_ref: Any, args: list[Any], kwargs: dict[str, Any],
                 name: str, max_retries: int = 0,
                 retry_exceptions: bool | tuple[type[BaseException], ...] = False,
                 where: Any = None) -> ObjectRef:
        """Submit a remote function; with ObjectRef arguments not ready yet,
        it is sent once they are (tasks keep no order). It is sent again, up
        to ``max_retries`` times (-1: without limit), when its worker dies or
        it raises one of ``retry_exceptions`` (True: any). ``where(what)``
        (lock held) gives the link to a task worker elsewhere (a scheduling
        strategy: pmetal.actors.routing); None: one of our node's."""
        def submit(a: list[Any], kw: dict[str, Any],
                   nested: list[ObjectRef] | None = None) -> ObjectRef:
            return self._run_task_now(fn_id, fn_ref, a, kw, name, nested=nested, where=where)
        retry = (Retry(submit, args, kwargs, "", max_retries, retry_exceptions)
                 if max_retries else None)
        if not kwargs and _plain(args):
            return self._run_task_now(fn_id, fn_ref, args, kwargs, name, retry, where=where)
        if Deferrals.unready(args, kwargs):
            return self._deferrals.add(submit, args, kwargs, "", f"remote function {name}",
                                       retry)
        (args, kwargs), nested = pack_collecting(self._resolve_args, args, kwargs)
        return self._run_task_now(fn_id, fn_ref, args, kwargs, name, retry, nested, where)

    def _run_task_now(self, fn_id: str, fn_ref: Any, args: list[Any],
                      kwargs: dict[str, Any], name: str,
                      retry: Retry | None = None,
                      nested: list[ObjectRef] | None = None, where: Any = None) -> ObjectRef:
        what = f"remote function {name}"
        with self.lock:
            link = self._task_link(what) if where is None else where(what)
            if isinstance(link, BaseException):
                return ObjectRef.of_error(link)
            if nested:   # lent to the worker before they reach it
                self.objects.lend(nested, link.channel.peer or "")
            ref_body = None if fn_id in link.functions else fn_ref
            corr = link.channel.submit(RunTask(fn_id, ref_body, args, kwargs),
                                       timeout=self._send_timeout)
            link.functions.add(fn_id)
            self.calls += 1
            return ObjectRef(self, link, corr, what, retry)

    def _task_link(self, what: str) -> PeerLink | BaseException:
        """A live link to one of this node's task workers (round robin). A
        dead worker makes us ask the node again: it starts replacements, and
        we tell it which workers we saw die (it may not have noticed yet)."""
        dead: set[str] = set()
        if self._lease_again and time.monotonic() >= self._lease_again:
            self._task_workers = []   # workers that were starting are ready by now
        for _ in range(8):   # each failed try adds an address to avoid
            if not self._task_workers:
                # Inside a worker, ask for a worker of our own (see node._lease).
                reply = self.request_node(LeaseWorkers(1 if self.self_address else 0,
                                                       tuple(sorted(dead))))
                if isinstance(reply, Failure):
                    return failure_error(reply)
                assert isinstance(reply, WorkerList)
                # A task that starts a task must not queue it behind itself.
                self._task_workers = [a for a in reply.addresses if a != self.self_address]
                self._lease_again = time.monotonic() + _LEASE_AGAIN_AFTER if reply.starting else 0.0
                if not self._task_workers:
                    return PlacementError(
                        f"{what}: no other task worker is free on this node to run a task "
                        f"started from inside a task; start the node with more task workers")
            address = self._least_busy(self._task_workers)
            known = self._link_for(address, _TASKS)
            if known is not None:
                known.check()
                if known.dead:
                    dead.add(address)
                    self._task_workers = []
                    continue
            link = self._own(self.link(address), _TASKS)
            if not link.dead:
                return link
            dead.add(address)
            self._task_workers = []
        return ActorDiedError(f"{what}: no task worker of this node answers")

    def _least_busy(self, addresses: list[str]) -> str:
        """The task worker with the fewest of our tasks pending (taking
        turns among equals), so a long task does not hold up the next one
        while another worker is free."""
        start = next(self._next_worker)
        best, best_load = "", -1
        for i in range(len(addresses)):
            address = addresses[(start + i) % len(addresses)]
            link = self.links.get(address)
            load = 0 if link is None else (link.channel.pending() + len(link.outbox)
                                           + link.streams * _STREAM_LOAD)
            if load == 0:
                return address
            if best_load < 0 or load < best_load:
                best, best_load = address, load
        return best

    def check_placement(self, need: dict[str, float], what: str) -> None:
        """Raise PlacementError now if no node could ever run this."""
        if not need:
            return
        info = self.status()
        nodes = [info["resources"], *(m["resources"] for m in info["members"])]
        if not any(all(n.get(k, 0.0) >= v for k, v in need.items()) for n in nodes):
            raise PlacementError(f"{what} needs {need}, but no node has that much; the "
                                 f"nodes have {nodes}")

    def _resolve_args(self, args: Any, kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        out = []
        for a in args:
            if isinstance(a, ObjectRef):
                a = self.get([a], None)[0]
            out.append(pack_value(a))
        kw = {}
        for k, v in kwargs.items():
            if isinstance(v, ObjectRef):
                v = self.get([v], None)[0]
            kw[k] = pack_value(v)
        return out, kw

    # --------------------------------------------------------------- cluster

    def status(self, probe: bool = False, measure: bool = False) -> dict[str, Any]:
        """The node's status; ``probe`` first measures its links' bandwidth;
        ``measure`` adds each member's ``capacity`` (compute rate, free
        memory and links now: pipeline placement)."""
        reply = self.request_node(StatusRequest(detail=probe, measure=measure))
        if not isinstance(reply, Status):
            raise PeerError(f"node answered StatusRequest with {type(reply).__name__}")
        return reply.info

    def wait_for_peers(self, n: int, timeout: float) -> list[str]:
        """See :func:`pmetal.wait_for_peers`."""
        own = self.node_id
        if self.watch.wait(lambda s: len([m for m in s.members if m != own]) >= n,
                           time.monotonic() + timeout):
            assert self.watch.state is not None
            return [m for m in self.watch.state.members if m != own]
        try:
            cluster = self.status().get("cluster", {})
        except PMetalError as exc:
            cluster = {"error": str(exc)}
        raise peers_missing(cluster, own, n, timeout)

    def shutdown_node(self, timeout: float = 5.0) -> None:
        self.request_node(Shutdown("driver shut down"), timeout=timeout)

    def close(self) -> None:
        if self.reporter is not None:   # the last report, while the node link is open
            self.reporter.close()
        self.closed = True
        self._deferrals.close()
        if self._objects is not None:   # our last releases go out first
            self._objects.close()
        self._closing.set()
        self._flush_wanted.set()
        if self._flusher is not None:
            self._flusher.join(timeout=2.0)
        if self._watch is not None:
            self._watch.close()
        with self.lock:
            for link in self.links.values():
                link.close()
            self.links.clear()
            self.node_link.close()
