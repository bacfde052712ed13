"""Worker process: runs user code (one actor, or remote-function tasks).

A node daemon pre-starts workers so that creating an actor costs one message,
not a process start: forks of its fork server (:mod:`pmetal.node.zygote`),
which calls :func:`main` in the child, or ``python -m pmetal.actors.worker``. A worker listens on
its own ROUTER socket; callers reach it directly, peer to peer. It announces
itself to its node with :class:`~pmetal.wire.WorkerReady`, then serves:

* a synchronous actor (``max_concurrency`` 1): a blocking receive, execute,
  reply loop with no event loop on the path (the fastest call path);
* an async actor (any ``async def`` method) or ``max_concurrency`` > 1: an
  asyncio loop (uvloop when installed); up to ``max_concurrency`` calls run at
  once (an async actor's default: 1000, as in Ray), coroutines on the loop,
  plain methods in a pool of ``max_concurrency`` threads. Each call holds one
  slot, whether it came alone or in a CallBatch; control messages (ping,
  status, shutdown) hold none, so a saturated actor still answers them
  (that loop and cancellation: :mod:`pmetal.actors.asyncserve`);
* a task worker: remote functions, one at a time.

The worker exits when its node goes away: it reads its stdin, a pipe from the
node (or, in a forked worker, one end of a socket pair the node holds the other
end of), and end-of-file means the node died.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import os
import sys
import threading
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from pmetal.actors import context, strategies, workdir
from pmetal.actors.answers import (_BAD_ENTRY, _MAX_REFUSALS, _unsendable, _user_traceback,
                                   _well_formed, failure_from)
from pmetal.actors.asyncserve import AsyncServing
from pmetal.actors.client import CoreClient
from pmetal.actors.objects import pack_to
from pmetal.actors.runtime_env import SETUP_HOOK, restore_env, run_setup_hook, set_env
from pmetal.actors.serialization import load_code, pack_value, unpack_value, unpack_values
from pmetal.actors.streams import StreamServer
from pmetal.cluster.clock import GateView
from pmetal.config import PMetalConfig, load_config, setup_process_logging
from pmetal.endpoint import Channel, Incoming, ListenerStatistics, SecureListener
from pmetal.errors import PeerError, PMetalError, PMetalTimeoutError, ProtocolError, TransportError
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.tally import CALL_SECONDS, TALLY
from pmetal.transport import ZmqTransport
from pmetal.values import Address, FailureKind
from pmetal.wire import (Ack, Call, CallBatch, CancelCall, Failure, InitActor, Message, Ping, Pong, Result,
                         RunTask, Shutdown, Status, StatusRequest, StreamCall,
                         StreamCredit, StreamStop, Telemetry, TelemetryRequest, WorkerReady)

__all__ = ["Worker", "WorkerStatistics", "failure_from", "main"]

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class WorkerStatistics:
    worker_id: str
    actor_id: str          # "" for a task worker, or an actor worker not hosting one yet
    calls: int             # calls and tasks served
    refused: int           # requests answered with a Failure for being malformed
    held: int              # calls and results that waited at the gate (a paused node)
    withheld: int          # ... refused or never delivered
    streams: int           # generator streams served
    listener: ListenerStatistics
    failed: int            # calls whose user code raised


_HOLD = 5.0
"""Seconds a call (or a result) waits for the node's gate to open after a
pause of the node before it is refused (or withheld)."""

_GATED = (Call, RunTask, InitActor)   # what executes user code (StreamCall: streams.py)

_NATIVE = frozenset({type(None), bool, int, float, str, bytes})

def _ready() -> bool:
    """An actor's ``__ray_ready__`` method (Ray's; its scripts wait on it)."""
    return True


class Worker(AsyncServing):
    def __init__(self, node_address: str, namespace: NetworkNamespace, config: PMetalConfig,
                 *, worker_id: str, host: str = "127.0.0.1",
                 gate: GateView | None = None) -> None:
        self.config = config
        # The node's gate (pmetal.cluster.clock): no call starts and no
        # result leaves while the node's membership is unconfirmed.
        self.gate = gate
        self._generation: int | None = None   # of the node, when this actor was built
        self.held = 0       # calls and results that waited at the gate
        self.withheld = 0   # ... refused or never delivered
        self.worker_id = worker_id
        self.node_address = node_address
        self.identity = NodeIdentity.generate()
        self.namespace = namespace
        self.transport = ZmqTransport(config.transport, curve=namespace.curve_keys())
        self.listener = SecureListener(self.transport.listen(Address(host, 0).url()), self.identity,
                                       namespace, config)
        self.node = Channel(self.transport.dial(node_address), self.identity, namespace, config)
        self.actor_id = ""
        self.instance: Any = None
        self.max_concurrency = 1
        self._functions: dict[str, Any] = {}
        self._stop = False
        self.needs_loop = False   # set once the actor is built: serve it from asyncio
        self.calls = 0
        self.refused = 0   # requests answered with a Failure for being malformed
        self.failed = 0    # calls whose user code raised (counted off the success path)
        # Calls by duration (pmetal.tally.CALL_SECONDS buckets), and their sum.
        self.latency = [0] * (len(CALL_SECONDS) + 1)
        self.latency_sum = 0.0
        # Async methods running, by (caller's route, call's corr): CancelCall.
        self._running: dict[tuple[bytes, int], asyncio.Future[Any]] = {}
        self._cancelled: dict[tuple[bytes, int], None] = {}   # ... cancelled before they ran
        self.streams = StreamServer(self)   # num_returns="streaming" calls
        self._route = b""   # the caller of the sync call running (its result's receiver)
        self._corr = 0      # ... and its call id (is_canceled)
        self._serving = 0   # the thread that serves (and runs a sync actor's calls)
        # An actor whose __init__ is a coroutine: (instance, coroutine, undo),
        # awaited on the loop before it serves anything (_construct_async).
        self._constructing: tuple[Any, Any, Callable[[], None]] | None = None
        self._constructing_for: Incoming | None = None

    @property
    def address(self) -> str:
        return self.listener.address

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(self.worker_id, self.actor_id or "", self.calls, self.refused,
                                self.held, self.withheld, self.streams.served,
                                self.listener.statistics(), self.failed)

    def telemetry(self) -> Telemetry:
        """This worker's counters for its node's metrics (pmetal.node.telemetry)."""
        objects = context.current_or_none()
        objects = objects._objects if objects is not None else None
        stats = objects.statistics() if objects is not None else None
        rows = TALLY.report()
        return Telemetry(os.getpid(), "worker", self.calls, self.failed, tuple(self.latency),
                         self.latency_sum, stats.owned if stats else 0,
                         stats.borrowed if stats else 0, tuple(rows["collectives"]),
                         tuple(rows["pipelines"]), tuple(rows["stages"]))

    def _timed(self, started: float) -> None:
        """Count a call that began at ``started`` in the duration histogram."""
        took = perf_counter() - started
        self.latency[bisect_left(CALL_SECONDS, took)] += 1
        self.latency_sum += took

    # ------------------------------------------------------------- serving

    def client(self) -> CoreClient:
        """A client to this worker's node, for pmetal calls made by user
        code here (installed as the context's worker factory by run)."""
        core = CoreClient(self.node_address, self.namespace, self.config, self.identity)
        core.self_address = self.address
        return core

    def run(self) -> None:
        context.set_worker_factory(self.client)
        context.set_cancel_probe(self.is_canceled)
        self._serving = threading.get_ident()
        self.node.open()
        self.node.request(WorkerReady(self.worker_id, self.address, os.getpid()))
        try:
            self._serve_sync()
            if not self._stop:
                from pmetal.aio import run
                run(self._serve_async())
        finally:
            self.listener.close()
            self.node.close()

    def _serve_sync(self) -> None:
        """Blocking loop; returns when stopped or when the actor needs asyncio."""
        listener = self.listener
        backlog = self.streams.backlog   # what came while a stream waited
        while not self._stop:
            incoming = backlog.popleft() if backlog else listener.recv()
            self._route = incoming[0]
            self._corr = incoming.envelope.corr
            kind = type(incoming.body)
            if kind is CallBatch:
                self._call_batch(incoming)
                continue
            if kind is StreamCall:
                self.streams.serve(incoming)
                continue
            if kind in _GATED:
                reply = self._admit()
                if reply is None:
                    reply = self._deliverable(self._handle_safely(incoming))
            else:
                reply = self._handle_safely(incoming)
            if incoming.envelope.corr and reply is not None:
                self._reply(incoming, reply)
            if self.needs_loop:
                if self._constructing is not None:   # answered from the loop
                    self._constructing_for = incoming
                return

    # ------------------------------------------------------------------ gate

    def _hold(self) -> str:
        """Wait while the gate is shut (up to ``_HOLD`` s): "" when it opens
        (or was open), else why not ("fenced", or the gate stayed shut)."""
        gate = self.gate
        if gate is None or not gate.check(self._generation):
            return ""
        self.held += 1
        reason = gate.wait(self._generation, _HOLD)
        self.withheld += bool(reason)
        return reason

    def _admit(self) -> Failure | None:
        """None if a call may start now; else the refusal (retryable: the
        call did not run) once the gate stayed shut for ``_HOLD`` s or the
        node was fenced."""
        reason = self._hold()
        if not reason:
            return None
        return Failure(FailureKind.ACTOR_DIED, "ActorDiedError",
                       "this copy's node was fenced after a pause (it was declared dead); the "
                       "call did not run here" if reason == "fenced" else
                       f"this actor's node lost touch with a quorum of the cluster (cut off "
                       f"from the others?) and was not confirmed a member within {_HOLD:g} s; "
                       f"the actor may restart on their side, so the call did not run here"
                       if reason == "lapsed" else
                       f"this actor's node has not confirmed its membership within {_HOLD:g} s "
                       f"after a pause; the call did not run")

    def _deliverable(self, reply: Message | None) -> Message | None:
        """``reply`` if it may leave now; else what replaces it: a copy on a
        fenced node, or one still unconfirmed after ``_HOLD`` s, never
        delivers a result (another copy may have run the call)."""
        reason = self._hold() if reply is not None else ""
        if not reason:
            return reply
        if reason == "fenced":
            return Failure(FailureKind.ACTOR_DIED, "ActorDiedError",
                           "this copy's node was fenced after a pause (it was declared dead, "
                           "the actor restarted elsewhere); the result of this copy is not "
                           "delivered")
        if reason == "lapsed":
            return Failure(FailureKind.TIMEOUT, "PMetalTimeoutError",
                           f"the call ran, but its node then lost touch with a quorum of the "
                           f"cluster and was not confirmed a member within {_HOLD:g} s, so the "
                           f"result is withheld (the actor may have restarted on the others' "
                           f"side)")
        return Failure(FailureKind.TIMEOUT, "PMetalTimeoutError",
                       f"the call ran, but its node did not confirm its membership within "
                       f"{_HOLD:g} s after a pause, so the result is withheld (the actor may "
                       f"have restarted elsewhere)")

    async def _admit_async(self) -> Failure | None:
        if self.gate is None or not self.gate.check(self._generation):
            return None
        return await asyncio.to_thread(self._admit)

    async def _deliverable_async(self, reply: Message) -> Message:
        if self.gate is None or not self.gate.check(self._generation):
            return reply
        return await asyncio.to_thread(self._deliverable, reply)  # type: ignore[return-value]

    def _reply(self, incoming: Incoming, reply: Message) -> None:
        try:
            self.listener.reply(incoming, reply)
        except (TypeError, ProtocolError) as exc:  # a result that cannot be packed or sent
            self.listener.reply(incoming, _unsendable(exc))
        except (PeerError, PMetalTimeoutError) as exc:
            log.warning("could not reply to %s: %s", incoming.peer, exc)

    def _wants_loop(self) -> bool:
        """Whether the actor just constructed needs the asyncio loop."""
        if self.max_concurrency > 1:
            return True
        return any(inspect.iscoroutinefunction(m)
                   for _, m in inspect.getmembers(type(self.instance), inspect.isfunction))

    def _handle_safely(self, incoming: Incoming) -> Message | None:
        """``_handle``, with whatever it raises (a bug of ours that a crafted
        request found: user code's errors are Failures already) answered as
        a Failure, logged and counted: no request ends the worker."""
        try:
            return self._handle(incoming.body)
        except Exception as exc:  # noqa: BLE001 - no request may end the worker
            self.refused += 1
            log.error("a %s from %s failed", type(incoming.body).__name__, incoming.peer[:8],
                      exc_info=exc)
            return Failure(FailureKind.BAD_REQUEST, type(exc).__name__, str(exc) or repr(exc))

    def _handle(self, body: Message) -> Message | None:
        kind = type(body)
        if kind is Call:
            return self._call(body)  # type: ignore[arg-type]
        if kind is RunTask:
            return self._task(body)  # type: ignore[arg-type]
        if kind is InitActor:
            return self._init(body)  # type: ignore[arg-type]
        if kind is CancelCall or kind is StreamCredit or kind is StreamStop:
            return None   # nothing runs while a sync worker reads: the call is done
        if kind is Ping:
            return Pong(body.payload)  # type: ignore[attr-defined]
        if kind is Shutdown:
            self._stop = True
            return Ack()
        if kind is StatusRequest:
            return Status({"worker_id": self.worker_id, "actor_id": self.actor_id,
                           "calls": self.calls, "failed": self.failed})
        if kind is TelemetryRequest:
            return self.telemetry()
        return Failure(FailureKind.BAD_REQUEST, "ProtocolError",
                       f"a worker does not handle {kind.__name__} messages")

    def _init(self, body: InitActor) -> Message | None:
        if self.instance is not None:
            return Failure(FailureKind.BAD_REQUEST, "ActorError",
                           f"worker already hosts actor {self.actor_id}")
        env_before: dict[str, str | None] = {}
        leave_dir = None
        try:
            # Ray's runtime_env working_dir: the actor's current directory and
            # first on sys.path for its life, before its class is loaded
            # (it may live in a module of the folder).
            working_dir = (body.options.get("runtime_env") or {}).get("working_dir")
            if working_dir:
                leave_dir = workdir.enter(workdir.ensure(working_dir))
            cls = load_code(body.cls_ref)
            self.actor_id = body.actor_id
            # Before the constructor: it may join a collective group.
            context.set_actor_id(body.actor_id)
            strategies.set_current(body.options)   # its placement group, if any
            if self.gate is not None:
                self.gate.adopt()
                self._generation = self.gate.generation
                # A copy that may restart elsewhere obeys the node's lease
                # (pmetal.cluster.clock): it must not run on beside its successor.
                options = body.options
                self.gate.leased = int(options.get("restarts_left",
                                                   options.get("max_restarts") or 0)) != 0
            self.max_concurrency = int(body.options.get("max_concurrency") or 1)
            # Ray's runtime_env env_vars: set for the actor's life, before
            # its constructor (the node checked them: str to str).
            env_vars = (body.options.get("runtime_env") or {}).get("env_vars") or {}
            env_before = set_env(env_vars)
            hook = (body.options.get("runtime_env") or {}).get(SETUP_HOOK)
            if hook:   # the job's worker_process_setup_hook, once per process
                run_setup_hook(hook)
            args = unpack_values(body.args)
            kwargs = {k: unpack_value(v) for k, v in body.kwargs.items()}
            if inspect.iscoroutinefunction(getattr(cls, "__init__", None)):
                # Ray's async def __init__: awaited on the actor's loop, where
                # its methods run; the InitActor is answered after it.
                instance = cls.__new__(cls)
                undo_env, undo_dir = env_before, leave_dir

                def undo() -> None:
                    restore_env(undo_env)
                    if undo_dir is not None:
                        undo_dir()
                self._constructing = (instance, instance.__init__(*args, **kwargs), undo)
                self.needs_loop = True
                return None
            self.instance = cls(*args, **kwargs)
        except Exception as exc:
            # Still hosting nothing: a failed (or malformed) InitActor must
            # not leave its actor id behind for the next one to inherit.
            self.instance = None
            self.actor_id = ""
            context.set_actor_id("")
            restore_env(env_before)
            if leave_dir is not None:
                leave_dir()
            return failure_from(_user_traceback(exc))
        # Decided once here, not per call: inspecting the class costs more
        # than a whole call of a small method.
        self.needs_loop = self._wants_loop()
        return Ack(os.getpid())

    def _method(self, actor_id: str, name: str) -> Any:
        if self.instance is None or actor_id != self.actor_id:
            return Failure(FailureKind.ACTOR_DIED, "ActorDiedError",
                           f"actor {actor_id} does not live in this worker (it was "
                           f"killed or restarted elsewhere)")
        if name == "__ray_ready__":   # Ray's: True once the constructor ran (it has)
            return _ready
        try:
            method = getattr(self.instance, name, None) if not name.startswith("__") else None
        except Exception as exc:  # noqa: BLE001 - a property of user code raised
            return failure_from(_user_traceback(exc))
        if method is None or not callable(method):
            return Failure(FailureKind.NO_SUCH_METHOD, "AttributeError",
                           f"{type(self.instance).__name__} has no method {name!r}")
        return method

    def _call(self, body: Call) -> Message:
        return self._invoke(body.actor_id, body.method, body.args, body.kwargs)

    def _invoke(self, actor_id: str, name: str, args: list[Any],
                kwargs: dict[str, Any]) -> Message:
        method = self._method(actor_id, name)
        if isinstance(method, Failure):
            return method
        self.calls += 1
        context.current_task.set(self.calls)
        started = perf_counter()
        try:
            value = method(*unpack_values(args),
                           **({k: unpack_value(v) for k, v in kwargs.items()} if kwargs else {}))
            return self._result(value, self._route)
        except Exception as exc:
            self.failed += 1
            return failure_from(_user_traceback(exc))
        finally:
            self._timed(started)

    def _result(self, value: Any, route: bytes) -> Result:
        """``value`` packed for the caller at ``route``: refs inside it are
        lent to that process (pmetal.actors.objects)."""
        if type(value) in _NATIVE:
            return Result(pack_value(value))
        session = self.listener.session(route)
        return Result(pack_to(value, session.peer if session is not None else None))

    def _call_batch(self, incoming: Incoming) -> None:
        """Run a batch in order, answering each call as soon as it is done."""
        body: CallBatch = incoming.body  # type: ignore[assignment]
        if len(body.corrs) != len(body.calls):
            self._refuse_batch(incoming)
            return
        for entry, corr in zip(body.calls, body.corrs):
            self._corr = corr   # the call running (is_canceled)
            reply: Message | None = self._admit()
            if reply is None:
                reply = self._deliverable(self._invoke(body.actor_id, *entry)
                                          if _well_formed(entry) else _BAD_ENTRY)
            assert reply is not None
            self._send_reply(incoming, reply, corr)

    def _mismatched_batch(self, incoming: Incoming) -> Failure:
        body: CallBatch = incoming.body  # type: ignore[assignment]
        self.refused += 1
        log.warning("refused a CallBatch from %s with %d calls and %d correlation ids",
                    incoming.peer[:8], len(body.calls), len(body.corrs))
        return Failure(FailureKind.BAD_REQUEST, "ProtocolError",
                       f"a CallBatch with {len(body.calls)} calls and {len(body.corrs)} "
                       f"correlation ids; none of it ran")

    def _refuse_batch(self, incoming: Incoming) -> None:
        """Answer every id of a batch whose calls and ids do not pair up:
        its caller waits on each of them."""
        failure = self._mismatched_batch(incoming)
        for corr in incoming.body.corrs[:_MAX_REFUSALS]:  # type: ignore[attr-defined]
            self._send_reply(incoming, failure, corr)

    def _send_reply(self, incoming: Incoming, reply: Message, corr: int) -> None:
        try:
            try:
                self.listener.send(incoming.route, reply, corr=corr)
            except (TypeError, ProtocolError) as exc:  # a result that cannot be packed or sent
                self.listener.send(incoming.route, _unsendable(exc), corr=corr)
        except (TransportError, PMetalTimeoutError) as exc:
            log.warning("could not reply to %s: %s", incoming.peer, exc)

    def _task(self, body: RunTask) -> Message:
        fn = self._functions.get(body.fn_id)
        if fn is None:
            if body.fn_ref is None:
                return Failure(FailureKind.UNKNOWN_FUNCTION, "KeyError", body.fn_id)
            try:
                fn = self._functions[body.fn_id] = load_code(body.fn_ref)
            except Exception as exc:
                return failure_from(_user_traceback(exc))
        self.calls += 1
        context.current_task.set(self.calls)
        started = perf_counter()
        try:
            if type(fn) is workdir.WorkingDirTask:   # runs in its runtime_env working_dir
                value = fn.run(body.args, body.kwargs)
            else:
                value = fn(*unpack_values(body.args),
                           **{k: unpack_value(v) for k, v in body.kwargs.items()})
            return self._result(value, self._route)
        except Exception as exc:
            self.failed += 1
            return failure_from(_user_traceback(exc))
        finally:
            self._timed(started)

def _exit_with_node() -> None:
    """Exit at once when the node that started us goes away (stdin EOF)."""
    try:
        while os.read(0, 1 << 16):  # the raw fd: see node._watch_stdin
            pass
    except OSError:
        pass
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pmetal.actors.worker")
    parser.add_argument("--node", required=True, help="address of the node daemon")
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--no-watch-stdin", action="store_true")
    parser.add_argument("--gate", default="", help="the node's gate page (shared memory)")
    parser.add_argument("--gate-stale", type=float, default=0.4,
                        help="seconds without a tick of the node after which calls wait")
    args = parser.parse_args(argv)
    try:
        setup_process_logging("worker")
    except PMetalError as exc:
        print(f"pmetal worker: {exc}", file=sys.stderr, flush=True)
        return 2
    if not args.no_watch_stdin:
        threading.Thread(target=_exit_with_node, name="pmetal-node-watch", daemon=True).start()
    try:
        config = load_config()
        namespace = NetworkNamespace.resolve(config.security)
        gate = GateView(args.gate, args.gate_stale) if args.gate else None
        Worker(args.node, namespace, config, worker_id=args.worker_id, host=args.host,
               gate=gate).run()
    except PMetalError as exc:
        print(f"pmetal worker: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # Run main() of the imported module, so that this process has one Worker
    # class (pmetal.actors.worker's), not a second one in __main__.
    from pmetal.actors import worker as _worker
    sys.exit(_worker.main())
