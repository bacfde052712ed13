"""The asyncio side of a worker: concurrent calls and their cancellation.

A worker (:mod:`pmetal.actors.worker`) serves a synchronous actor from a
blocking loop; an async actor (any ``async def`` method), one with
``max_concurrency`` > 1, or one whose ``__init__`` is a coroutine, is handed
to :meth:`AsyncServing._serve_async`: an asyncio loop that runs up to
``max_concurrency`` calls at once (coroutines on the loop, plain methods in
a pool of that many threads), each call holding one slot of a semaphore
whether it came alone or in a CallBatch, and control messages holding none.

Cancellation (``pmetal.cancel``) lives here too: a CancelCall cancels the
async method running for that call, or is remembered (the newest
``_CANCELLED_KEPT``) so that a call not started yet never starts;
:meth:`AsyncServing.is_canceled` answers user code's
``get_runtime_context().is_canceled()`` in every kind of actor.

:class:`AsyncServing` is a mixin of :class:`~pmetal.actors.worker.Worker`
and reads its state (listener, gate, counters, the actor instance); it
logs under the worker's logger.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import os
import threading
from time import perf_counter
from typing import Any

from pmetal.actors import context
from pmetal.actors.answers import (_BAD_ENTRY, _MAX_REFUSALS, _unsendable, _user_traceback,
                                   _well_formed, failure_from)
from pmetal.actors.serialization import unpack_value, unpack_values
from pmetal.endpoint import Incoming
from pmetal.errors import ClosedError, PeerError, PMetalTimeoutError, ProtocolError, TransportError
from pmetal.values import FailureKind
from pmetal.wire import (Ack, Call, CallBatch, CancelCall, Failure, Message, Ping, StatusRequest,
                         StreamCall, StreamCredit, StreamStop)

__all__ = ["AsyncServing"]

log = logging.getLogger("pmetal.actors.worker")   # the worker's messages keep its name

_CANCELLED_KEPT = 1024
"""How many CancelCalls for calls not running a worker remembers."""


class AsyncServing:
    """A worker's asyncio loop and cancellation (a mixin of ``Worker``)."""

    async def _construct_async(self, incoming: Incoming | None) -> None:
        """Await the coroutine constructor ``_init`` left, then answer its
        InitActor (``incoming``): Ack, or the constructor's error (the
        worker then hosts nothing, as after a sync constructor that raised)."""
        assert self._constructing is not None
        instance, constructor, undo = self._constructing
        self._constructing = self._constructing_for = None
        try:
            await constructor
            self.instance = instance
            reply: Message = Ack(os.getpid())
        except Exception as exc:  # noqa: BLE001 - the user's constructor: its caller sees it
            self.actor_id = ""
            context.set_actor_id("")
            undo()
            reply = failure_from(_user_traceback(exc))
        if incoming is not None and incoming.envelope.corr:
            try:
                await self.listener.areply(incoming, await self._deliverable_async(reply))
            except (PeerError, PMetalTimeoutError) as exc:
                log.warning("could not reply to %s: %s", incoming.peer, exc)

    async def _serve_async(self) -> None:
        if self._constructing is not None:   # the sync loop handed over mid-construction
            await self._construct_async(self._constructing_for)
        limit = asyncio.Semaphore(self.max_concurrency if self.max_concurrency > 1 else 1000)
        threads = concurrent.futures.ThreadPoolExecutor(max(1, self.max_concurrency),
                                                        thread_name_prefix="pmetal-actor")
        try:
            async with asyncio.TaskGroup() as group:
                while not self._stop:
                    try:
                        backlog = self.streams.backlog
                        incoming = backlog.popleft() if backlog else await self.listener.arecv()
                    except ClosedError:
                        return
                    body = incoming.body
                    if type(body) is CallBatch:
                        # One slot per call, taken here: a batch holding a
                        # slot of its own left one call fewer running at once.
                        if len(body.corrs) == len(body.calls):  # type: ignore[attr-defined]
                            for entry, corr in zip(body.calls, body.corrs):  # type: ignore[attr-defined]
                                await limit.acquire()
                                group.create_task(self._batch_entry_async(
                                    incoming, entry, corr, limit, threads))
                        else:
                            group.create_task(self._refuse_batch_async(incoming))
                    elif type(body) is CancelCall:
                        self._cancel_running(incoming.route, body.corr)  # type: ignore[attr-defined]
                    elif type(body) is StreamCall:
                        await limit.acquire()
                        group.create_task(self.streams.serve_async(incoming, limit, threads))
                    elif type(body) is StreamCredit or type(body) is StreamStop:
                        self.streams.control(incoming)
                    elif type(body) is Call:
                        await limit.acquire()
                        group.create_task(self._handle_async(incoming, limit, threads))
                    else:
                        group.create_task(self._handle_async(incoming, None, threads))
        finally:
            threads.shutdown(wait=False, cancel_futures=True)

    async def _refuse_batch_async(self, incoming: Incoming) -> None:
        failure = self._mismatched_batch(incoming)
        try:
            for corr in incoming.body.corrs[:_MAX_REFUSALS]:  # type: ignore[attr-defined]
                await self.listener.asend(incoming.route, failure, corr=corr)
        except (TransportError, PMetalTimeoutError) as exc:
            log.warning("could not reply to %s: %s", incoming.peer, exc)

    def is_canceled(self) -> bool:
        """``get_runtime_context().is_canceled()`` in user code here: whether
        a CancelCall came for the actor call running in this thread.

        A sync actor runs its calls in the thread that reads the socket, so
        nothing is read while one runs: asked from that thread, this reads
        what came meanwhile (without waiting), keeps the calls for later
        (the backlog the loop serves next, as a stream does) and answers
        pings. A threaded actor's thread looks up the CancelCalls its loop
        remembered. In an async method the cancel comes as CancelledError."""
        if not self.needs_loop and threading.get_ident() == self._serving:
            key = (self._route, self._corr)
            self._read_cancels()
        else:
            key = context.current_call.get()
        return bool(key[1]) and key in self._cancelled

    def _read_cancels(self) -> None:
        listener = self.listener
        while True:
            try:
                incoming = listener.recv(0.0)
            except (PMetalTimeoutError, ClosedError):
                return
            kind = type(incoming.body)
            if kind is CancelCall:
                self._cancel_running(incoming.route, incoming.body.corr)  # type: ignore[attr-defined]
            elif kind is Ping or kind is StatusRequest:
                reply = self._handle_safely(incoming)
                if incoming.envelope.corr and reply is not None:
                    self._reply(incoming, reply)
            else:
                self.streams.backlog.append(incoming)

    def _cancel_running(self, route: bytes, corr: int) -> None:
        """CancelCall: cancel the async method running for call ``corr`` of
        the caller at ``route`` (pmetal.cancel); nothing when none runs."""
        running = self._running.pop((route, corr), None)
        if running is not None:
            running.cancel()
            return
        # Not started yet (its task waits for the loop) or done already:
        # remembered, so that it does not start (a few, the newest).
        self._cancelled[(route, corr)] = None
        if len(self._cancelled) > _CANCELLED_KEPT:
            del self._cancelled[next(iter(self._cancelled))]

    async def _invoke_async(self, actor_id: str, name: str, args: list[Any],
                            kwargs: dict[str, Any],
                            threads: concurrent.futures.Executor,
                            key: tuple[bytes, int] = (b"", 0)) -> Message:
        if self._cancelled and self._cancelled.pop(key, 0) is None:
            return Failure(FailureKind.CANCELLED, "TaskCancelledError",
                           f"{name} was cancelled by pmetal.cancel before it started")
        method = self._method(actor_id, name)
        if isinstance(method, Failure):
            return method
        self.calls += 1
        task = self.calls
        context.current_task.set(task)   # this asyncio task's own copy
        started = perf_counter()
        try:
            a = unpack_values(args)
            kw = {k: unpack_value(v) for k, v in kwargs.items()}
            if inspect.iscoroutinefunction(method):
                # Its own asyncio task, so that a CancelCall cancels the
                # method and not the reply to it.
                running = asyncio.ensure_future(method(*a, **kw))
                self._running[key] = running
                try:
                    value = await running
                except asyncio.CancelledError:
                    if key in self._running or not running.cancelled():
                        raise   # this worker is stopping, or the method cancelled itself
                    return Failure(FailureKind.CANCELLED, "TaskCancelledError",
                                   f"{name} was cancelled by pmetal.cancel")
                finally:
                    if self._running.get(key) is running:
                        del self._running[key]
            else:
                value = await asyncio.get_running_loop().run_in_executor(
                    threads, lambda: (context.current_task.set(task),
                                      context.current_call.set(key), method(*a, **kw))[2])
            return self._result(value, key[0])
        except Exception as exc:
            self.failed += 1
            return failure_from(_user_traceback(exc))
        finally:
            self._timed(started)

    async def _batch_entry_async(self, incoming: Incoming, entry: Any, corr: int,
                                 limit: asyncio.Semaphore,
                                 threads: concurrent.futures.Executor) -> None:
        try:
            body = incoming.body
            reply: Message | None = await self._admit_async()
            if reply is None:
                reply = await self._deliverable_async(
                    await self._invoke_async(body.actor_id, *entry, threads,  # type: ignore[attr-defined]
                                             (incoming.route, corr))
                    if _well_formed(entry) else _BAD_ENTRY)
            try:
                await self.listener.asend(incoming.route, reply, corr=corr)
            except (TypeError, ProtocolError) as exc:
                await self.listener.asend(incoming.route, _unsendable(exc), corr=corr)
        except (TransportError, PMetalTimeoutError) as exc:
            log.warning("could not reply to %s: %s", incoming.peer, exc)
        finally:
            limit.release()

    async def _handle_async(self, incoming: Incoming, limit: asyncio.Semaphore | None,
                            threads: concurrent.futures.Executor) -> None:
        """Serve one Call (holding a slot of ``limit``) or control message."""
        try:
            body = incoming.body
            if type(body) is Call:
                reply: Message | None = await self._admit_async()
                if reply is None:
                    reply = await self._deliverable_async(await self._invoke_async(
                        body.actor_id, body.method, body.args, body.kwargs, threads,  # type: ignore[attr-defined]
                        (incoming.route, incoming.envelope.corr)))
            else:
                reply = self._handle_safely(incoming) or Ack()
                if self._constructing is not None:   # an async __init__ to await first
                    await self._construct_async(incoming)
                    return
            if incoming.envelope.corr:
                try:
                    await self.listener.areply(incoming, reply)
                except (TypeError, ProtocolError) as exc:
                    await self.listener.areply(incoming, _unsendable(exc))
                except (PeerError, PMetalTimeoutError) as exc:
                    log.warning("could not reply to %s: %s", incoming.peer, exc)
        finally:
            if limit is not None:
                limit.release()
