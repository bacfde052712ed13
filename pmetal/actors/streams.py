"""Ray's streaming generators, the worker's side: serving a
:class:`~pmetal.wire.StreamCall` (see :mod:`pmetal.actors.generators` for the
caller's side and the protocol).

A worker runs the generator (a sync or async generator function: a remote
function, or an actor method) and sends each item on the next correlation id
its caller granted. With no id left it pulls nothing: the generator stays
suspended at its ``yield`` until the caller takes an item and grants another
id (:class:`~pmetal.wire.StreamCredit`). That is the backpressure: the
generator runs at most ``window`` items ahead of its caller.

* A task worker or a sync actor (one call at a time) serves the stream in
  its blocking loop. While it waits for ids it keeps reading: grants and
  stops for this stream are applied, pings and status requests answered,
  and every other message (the next calls) is kept in :attr:`StreamServer.backlog`
  for the worker's loop to serve, in order, once the stream has ended (one
  call at a time, as for any call). An async generator is driven by an
  event loop of its own.
* An async actor, or one with ``max_concurrency`` > 1, serves each stream as
  one call of its asyncio loop (it holds one concurrency slot until it ends):
  an async generator on the loop, its ``__anext__`` in a task of its own so
  that ``pmetal.cancel`` cancels it through asyncio; a sync generator in the
  actor's threads.

A caller that dies while its stream waits for ids never grants any: every
``_PROBE_S`` of waiting, the worker sends its caller a one-way Ping, and
ZeroMQ's refusal to route it (the caller's connection is gone) ends the
stream. A stream that ends answers the StreamCall's own correlation id with
``Result(count)``.
"""

from __future__ import annotations

import asyncio
import collections
import collections.abc
import concurrent.futures
import inspect
import logging
import time
from typing import TYPE_CHECKING, Any

from pmetal.actors import context
from pmetal.actors.serialization import (
    load_code,
    unpack_value,
    unpack_values,
)
from pmetal.actors.workdir import WorkingDirTask
from pmetal.endpoint import Incoming
from pmetal.errors import (
    ClosedError,
    PeerError,
    PMetalTimeoutError,
    ProtocolError,
    TransportError,
)
from pmetal.wire import (
    Failure,
    Message,
    Ping,
    Result,
    Shutdown,
    StatusRequest,
    StreamCall,
    StreamCredit,
    StreamStop,
)

if TYPE_CHECKING:
    from pmetal.actors.worker import Worker

__all__ = ["StreamServer"]

log = logging.getLogger(__name__)

_PROBE_S = 1.0
"""Seconds a stream waits for ids between checks that its caller is alive."""

_NO_IDS = Failure("bad_request", "ProtocolError", "a StreamCall without item ids")

_END = object()   # what a pull returns when the generator is exhausted


def _not_a_generator(name: str, value: Any) -> TypeError:
    return TypeError(f"{name} was called with num_returns='streaming' but returned a "
                     f"{type(value).__name__}, not a generator; write it as a generator "
                     f"function (with yield), or drop num_returns='streaming'")


class _Stream:
    """One stream being served: where its items go and how far it may run."""

    __slots__ = ("corrs", "count", "key", "pulling", "stopped", "wake")

    def __init__(self, key: tuple[bytes, int], corrs: tuple[int, ...]) -> None:
        self.key = key
        self.corrs = collections.deque(corrs)
        self.count = 0           # items sent
        self.stopped = ""        # why it stops early ("cancel", "drop", "caller gone", ...)
        self.wake: asyncio.Event | None = None       # async streams: an id or a stop came
        self.pulling: asyncio.Future[Any] | None = None   # async: the __anext__ running

    def control(self, body: Message) -> None:
        if type(body) is StreamCredit:
            self.corrs.extend(body.corrs)   # type: ignore[attr-defined]
        else:
            self.stopped = "cancel" if body.cancel else "drop"   # type: ignore[attr-defined]
            if self.pulling is not None and body.cancel:   # type: ignore[attr-defined]
                self.pulling.cancel()
        if self.wake is not None:
            self.wake.set()


class StreamServer:
    """Serves a worker's StreamCalls (see the module docstring)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.backlog: collections.deque[Incoming] = collections.deque()
        self._open: dict[tuple[bytes, int], _Stream] = {}   # async streams, by (route, corr)
        self.served = 0

    def control(self, incoming: Incoming) -> None:
        """A StreamCredit or StreamStop outside a stream's own wait (async
        streams); one for a stream that ended is ignored."""
        stream = self._open.get((incoming.route, incoming.body.stream))  # type: ignore[attr-defined]
        if stream is not None:
            stream.control(incoming.body)

    # ------------------------------------------------------------- starting

    def _callable(self, body: StreamCall) -> Any:
        """The generator function to run, or the Failure that answers the call."""
        worker = self.worker
        if body.actor_id:
            return worker._method(body.actor_id, body.name)
        fn = worker._functions.get(body.name)
        if fn is None:
            if body.fn_ref is None:
                return Failure("unknown_function", "KeyError", body.name)
            try:
                fn = worker._functions[body.name] = load_code(body.fn_ref)
            except Exception as exc:  # noqa: BLE001 - the user's module failed to import
                from pmetal.actors.worker import failure_from
                return failure_from(exc)
        return fn

    def _name(self, body: StreamCall) -> str:
        return body.name if body.actor_id else f"remote function {body.name.split(':')[-1]}"

    def _item(self, value: Any, route: bytes) -> Message:
        """An item for the caller at ``route``: refs inside it are lent to
        that process, as for any result (pmetal.actors.objects)."""
        try:
            return self.worker._result(value, route)
        except TypeError as exc:   # an item that cannot be pickled
            from pmetal.actors.worker import failure_from
            return failure_from(exc)

    def _failure(self, exc: BaseException) -> Failure:
        from pmetal.actors.worker import _user_traceback, failure_from
        return failure_from(_user_traceback(exc))

    # ------------------------------------------------------- blocking loop

    def serve(self, incoming: Incoming) -> None:
        """Serve a StreamCall to its end in the blocking loop (task worker,
        sync actor)."""
        worker = self.worker
        body: StreamCall = incoming.body   # type: ignore[assignment]
        refused = worker._admit() if body.corrs else _NO_IDS
        if refused is not None:
            worker._reply(incoming, refused)
            return
        fn = self._callable(body)
        if isinstance(fn, Failure):
            worker._reply(incoming, fn)
            return
        stream = _Stream((incoming.route, incoming.envelope.corr), body.corrs)
        worker.calls += 1
        self.served += 1
        context.current_task.set(worker.calls)
        started = time.perf_counter()   # a stream is one call in the duration histogram
        gen: Any = None
        loop: asyncio.AbstractEventLoop | None = None
        leave_dir = None
        try:
            try:
                if type(fn) is WorkingDirTask:   # a task with a runtime_env working_dir
                    fn, leave_dir = fn.enter()
                gen = fn(*unpack_values(body.args),
                         **{k: unpack_value(v) for k, v in body.kwargs.items()})
            except Exception as exc:  # noqa: BLE001 - the user's error goes to the first item
                self._send_item(stream, self._failure(exc))
                return
            if inspect.isasyncgen(gen):
                loop = asyncio.new_event_loop()
            elif not inspect.isgenerator(gen) and not isinstance(gen, collections.abc.Iterator):
                if inspect.iscoroutine(gen):
                    gen.close()
                self._send_item(stream, self._failure(_not_a_generator(self._name(body), gen)))
                gen = None
                return
            while self._await_credit(stream):
                try:
                    value = (loop.run_until_complete(_anext(gen)) if loop is not None
                             else next(gen, _END))
                except Exception as exc:  # noqa: BLE001 - raised by the next get
                    self._send_item(stream, self._failure(exc))
                    return
                if value is _END:
                    return
                self._send_item(stream, self._item(value, stream.key[0]))
        finally:
            self._close_sync(gen, loop)
            if leave_dir is not None:
                leave_dir()
            self._end(incoming, stream)
            worker._timed(started)

    def _send_item(self, stream: _Stream, item: Message) -> None:
        worker = self.worker
        reply = worker._deliverable(item)
        assert reply is not None
        route, corr = stream.key[0], stream.corrs.popleft()
        stream.count += 1
        try:
            try:
                worker.listener.send(route, reply, corr=corr)
            except (TypeError, ProtocolError) as exc:   # an item too large for the wire
                from pmetal.actors.worker import _unsendable
                worker.listener.send(route, _unsendable(exc), corr=corr)
        except (TransportError, PMetalTimeoutError) as exc:
            log.warning("could not send an item of a stream: %s", exc)
            if isinstance(exc, PeerError):
                stream.stopped = "caller gone"

    def _await_credit(self, stream: _Stream) -> bool:
        """Read what came meanwhile, then read on until ``stream`` holds an
        id; False when it must stop instead (see the module docstring)."""
        listener = self.worker.listener
        wait = 0.0   # first only what has come (a StreamStop between items)
        while not stream.stopped:
            try:
                incoming = listener.recv(wait)
            except PMetalTimeoutError:
                if stream.corrs:
                    break
                if wait:
                    self._probe(stream, stream.key[0])
                wait = _PROBE_S
                continue
            except ClosedError:
                stream.stopped = "worker closing"
                break
            body = incoming.body
            kind = type(body)
            if kind is StreamCredit or kind is StreamStop:
                if (incoming.route, body.stream) == stream.key:  # type: ignore[attr-defined]
                    stream.control(body)
            elif kind is Ping or kind is StatusRequest:
                reply = self.worker._handle_safely(incoming)
                if incoming.envelope.corr and reply is not None:
                    self.worker._reply(incoming, reply)
            else:
                if kind is Shutdown:
                    stream.stopped = "worker shutting down"
                self.backlog.append(incoming)
            if stream.corrs:
                wait = 0.0   # read the rest of what came, then go on
        return not stream.stopped

    def _probe(self, stream: _Stream, route: bytes) -> None:
        try:
            self.worker.listener.send(route, Ping(), timeout=0)
        except (TransportError, PMetalTimeoutError) as exc:
            if isinstance(exc, PeerError):   # the caller's connection is gone
                stream.stopped = "caller gone"

    def _close_sync(self, gen: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        try:
            if loop is not None:
                if gen is not None:
                    loop.run_until_complete(gen.aclose())
                loop.close()
            elif gen is not None and hasattr(gen, "close"):
                gen.close()   # runs its finally blocks
        except Exception:
            log.warning("a stream's generator raised while being closed", exc_info=True)

    def _end(self, incoming: Incoming, stream: _Stream) -> None:
        if stream.stopped == "cancel":
            end: Message = Failure("cancelled", "TaskCancelledError",
                                   "the stream was cancelled by pmetal.cancel")
        else:
            end = Result(stream.count)
        if stream.stopped == "caller gone":
            return
        self.worker._reply(incoming, end)

    # ------------------------------------------------------------- asyncio

    async def serve_async(self, incoming: Incoming, limit: asyncio.Semaphore,
                          threads: concurrent.futures.Executor) -> None:
        """Serve a StreamCall as one call of the asyncio loop (holding a slot
        of ``limit``, released at the end)."""
        worker = self.worker
        body: StreamCall = incoming.body   # type: ignore[assignment]
        stream = _Stream((incoming.route, incoming.envelope.corr), body.corrs)
        stream.wake = asyncio.Event()
        gen: Any = None
        started = 0.0
        try:
            refused = await worker._admit_async() if body.corrs else _NO_IDS
            fn = refused if refused is not None else self._callable(body)
            if isinstance(fn, Failure):
                await self._areply(incoming, fn)
                return
            self._open[stream.key] = stream
            worker.calls += 1
            self.served += 1
            context.current_task.set(worker.calls)
            started = time.perf_counter()
            gen = await self._start_async(fn, body, threads)
            if isinstance(gen, Failure):
                await self._asend_item(stream, gen)
                gen = None
            else:
                await self._pull_async(stream, gen, threads)
        finally:
            self._open.pop(stream.key, None)
            try:
                await self._aclose(gen, threads)
                if stream.stopped != "caller gone":
                    await self._areply(incoming, Failure(
                        "cancelled", "TaskCancelledError",
                        "the stream was cancelled by pmetal.cancel")
                        if stream.stopped == "cancel" else Result(stream.count))
            finally:
                limit.release()
                if started:
                    worker._timed(started)

    async def _start_async(self, fn: Any, body: StreamCall,
                           threads: concurrent.futures.Executor) -> Any:
        """The generator ``fn`` returns, or the Failure for its first item."""
        args = unpack_values(body.args)
        kwargs = {k: unpack_value(v) for k, v in body.kwargs.items()}
        try:
            if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
                gen = fn(*args, **kwargs)
            elif inspect.iscoroutinefunction(fn):
                gen = await fn(*args, **kwargs)
            else:
                gen = await asyncio.get_running_loop().run_in_executor(
                    threads, lambda: fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - the user's error goes to the first item
            return self._failure(exc)
        if inspect.isasyncgen(gen) or isinstance(gen, collections.abc.Iterator):
            return gen
        return self._failure(_not_a_generator(self._name(body), gen))

    async def _pull_async(self, stream: _Stream, gen: Any,
                          threads: concurrent.futures.Executor) -> None:
        loop = asyncio.get_running_loop()
        task = context.current_task.get()
        while await self._await_credit_async(stream):
            try:
                if inspect.isasyncgen(gen):
                    # A task of its own, so that a StreamStop cancels the
                    # generator and not this stream's bookkeeping.
                    stream.pulling = asyncio.ensure_future(_anext(gen))
                    try:
                        value = await stream.pulling
                    finally:
                        stream.pulling = None
                else:
                    value = await loop.run_in_executor(
                        threads, lambda: (context.current_task.set(task), next(gen, _END))[1])
            except asyncio.CancelledError:
                if stream.stopped == "cancel":
                    return
                raise   # the worker is stopping
            except Exception as exc:  # noqa: BLE001 - raised by the next get
                await self._asend_item(stream, self._failure(exc))
                return
            if value is _END:
                return
            await self._asend_item(stream, self._item(value, stream.key[0]))

    async def _await_credit_async(self, stream: _Stream) -> bool:
        wake = stream.wake
        assert wake is not None
        while not stream.corrs and not stream.stopped:
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), _PROBE_S)
            except TimeoutError:
                self._probe(stream, stream.key[0])
        return not stream.stopped

    async def _asend_item(self, stream: _Stream, item: Message) -> None:
        reply = await self.worker._deliverable_async(item)
        corr = stream.corrs.popleft()
        stream.count += 1
        try:
            try:
                await self.worker.listener.asend(stream.key[0], reply, corr=corr)
            except (TypeError, ProtocolError) as exc:
                from pmetal.actors.worker import _unsendable
                await self.worker.listener.asend(stream.key[0], _unsendable(exc), corr=corr)
        except (TransportError, PMetalTimeoutError) as exc:
            log.warning("could not send a stream's item: %s", exc)
            if isinstance(exc, PeerError):
                stream.stopped = "caller gone"

    async def _aclose(self, gen: Any, threads: concurrent.futures.Executor) -> None:
        try:
            if inspect.isasyncgen(gen):
                await gen.aclose()
            elif gen is not None and hasattr(gen, "close"):
                await asyncio.get_running_loop().run_in_executor(threads, gen.close)
        except Exception:
            log.warning("a stream's generator raised while being closed", exc_info=True)

    async def _areply(self, incoming: Incoming, reply: Message) -> None:
        try:
            await self.worker.listener.areply(incoming, reply)
        except (TransportError, PMetalTimeoutError) as exc:
            log.warning("could not answer a stream's call: %s", exc)


async def _anext(gen: Any) -> Any:
    """The async generator's next item, or _END."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return _END
