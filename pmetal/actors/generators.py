"""Ray's streaming generators, the caller's side: ``num_returns="streaming"``
(the default for a generator function or method, as in Ray 2.8 on) makes a
call return an :class:`ObjectRefGenerator` whose iteration yields one
ObjectRef per item as the worker produces it; :func:`wait` is
``pmetal.wait`` over generators and refs.

The call goes out as one :class:`~pmetal.wire.StreamCall` carrying a
correlation id for each of the first ``window`` items (Ray's
``_generator_backpressure_num_objects``). Each id has an ObjectRef waiting on
its link like any call's, so a reply, a worker's death (every pending ref of
the link fails with ActorDiedError, WorkerCrashedError for a task) and
``get``/``wait``/``await`` need nothing new. The worker pulls an item only
while it holds an unused id: a generator never runs more than ``window``
items ahead of what the caller took. Taking an item grants one more id
(:class:`~pmetal.wire.StreamCredit`); the StreamCall's own reply,
``Result(count)``, says how many items there were.

``pmetal.cancel(gen)`` sends :class:`~pmetal.wire.StreamStop` (the worker
closes the generator; an async one waiting is cancelled through asyncio) and
fails the items not arrived with TaskCancelledError; a generator dropped
unread (``break`` out of a loop) stops its worker the same way, from a
short-lived thread (``__del__`` may run in any thread, in the middle of a
send). Streaming calls are not retried (``max_retries``, ``max_task_retries``
do not apply). One with ObjectRef arguments not done yet returns its
generator at once and waits with the other such calls (pmetal.actors.deferred):
the generator's end ref stands in the queue and adopts the real one when the
call is sent, and the stream's state moves into the generator then.

A task worker serving a stream runs nothing else until it ends, so a link
counts its open streams (``PeerLink.streams``, from the StreamCall until its
end arrives or the stream is dropped) and the client's choice of task worker
weighs them: other tasks go to other workers while one is free.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from pmetal.actors.deferred import Deferrals
from pmetal.actors.ownership import pack_collecting
from pmetal.actors.refs import ObjectRef, call_name
from pmetal.errors import (
    ActorDiedError,
    GetTimeoutError,
    PeerError,
    PMetalTypeError,
    PMetalValueError,
    TaskCancelledError,
    WorkerCrashedError,
)
from pmetal.values import FailureKind
from pmetal.wire import Failure, KillActor, StreamCall, StreamCredit, StreamStop

if TYPE_CHECKING:
    from pmetal.actors.client import CoreClient
    from pmetal.actors.links import PeerLink

__all__ = ["DEFAULT_WINDOW", "STREAMING", "ObjectRefGenerator", "check_window",
           "stream_actor_call", "stream_task", "wait"]

STREAMING = "streaming"

DEFAULT_WINDOW = 32
"""Items a generator may produce ahead of its caller by default. Ray's
``_generator_backpressure_num_objects`` defaults to no limit; pmetal always
has one, since each item in flight is a result held in the caller's
memory."""

_WINDOW_OPTION = "_generator_backpressure_num_objects"


def check_window(value: Any, where: str) -> int:
    """The backpressure window for ``value`` (Ray's
    ``_generator_backpressure_num_objects``: None or -1 for the default)."""
    if value is None or value == -1 and type(value) is int:
        return DEFAULT_WINDOW
    if type(value) is not int:
        raise PMetalTypeError(f"{where}: {_WINDOW_OPTION} must be an int, not "
                              f"{type(value).__name__} {value!r:.40}")
    if value < 1:
        raise PMetalValueError(f"{where}: {_WINDOW_OPTION}={value}; it must be at least 1 "
                               f"(the items a generator may produce before the caller takes "
                               f"them), or -1 for the default ({DEFAULT_WINDOW})")
    return value


class _ItemRef(ObjectRef):
    """The ref of one item of a stream (an ObjectRef as any other)."""

    __slots__ = ()


class _TaskItemRef(_ItemRef):
    """An item of a task's stream: its worker's death is Ray's
    WorkerCrashedError."""

    __slots__ = ()

    def _fail_link(self, why: str) -> None:
        if not self.done():
            self._link = None
            self._error = WorkerCrashedError(f"{self._what()}: {why}")


class _EndRef(ObjectRef):
    """The StreamCall's own reply: ``Result(count)`` when the stream ends.
    When it comes, the item ids granted past the end will never be answered:
    the generator stops waiting for them at once (they count as calls in
    flight on the link, which steers later calls)."""

    __slots__ = ("_gen", "_open_on", "_task")

    def _opened(self, link: PeerLink, task: bool) -> None:
        """Count the stream open on ``link`` until it ends (client lock held)."""
        self._task = task
        self._open_on: PeerLink | None = link
        link.streams += 1

    def _closed(self) -> None:
        link = getattr(self, "_open_on", None)
        if link is not None:
            self._open_on = None
            link.streams -= 1

    def _settle(self, env: Any) -> None:
        super()._settle(env)
        self._closed()
        owner = getattr(self, "_gen", None)
        gen = owner() if owner is not None else None
        if gen is not None:
            gen._release(None)

    def _fail_link(self, why: str) -> None:
        self._closed()
        if not getattr(self, "_task", False):
            super()._fail_link(why)
        elif not self.done():
            self._link = None
            self._error = WorkerCrashedError(f"{self._what()}: {why}")


class ObjectRefGenerator:
    """What a ``num_returns="streaming"`` call returns (Ray's
    ``ray.ObjectRefGenerator``): iterate it (``for ref in gen``,
    ``next(gen)``, ``async for``) to get one ObjectRef per item the
    generator yields, as soon as it is produced. An exception raised by the
    generator is raised by ``get`` of the next ref, and the iteration ends
    after it. See the module docstring."""

    def __init__(self, client: CoreClient | None, link: PeerLink | None, what: Any,
                 items: collections.deque[ObjectRef], end: ObjectRef,
                 task: bool = False) -> None:
        self._client = client
        self._link = link
        self._what = what
        self._items = items     # refs waiting for items, in order (their ids were granted)
        self._end = end         # the StreamCall's own reply: Result(count) at the end
        self._task = task
        self._taken = 0         # items handed to the caller
        self._last_failed = False
        self._finished = end.done() and not items
        if isinstance(end, _EndRef):
            end._gen = weakref.ref(self)   # not the generator itself: no cycle, prompt __del__

    @classmethod
    def _failed(cls, error: BaseException, what: Any) -> ObjectRefGenerator:
        """A generator whose call could not be sent: it yields one ref, whose
        ``get`` raises ``error``."""
        return cls(None, None, what, collections.deque(), ObjectRef.of_error(error))

    # ------------------------------------------------------------ iterating

    def __iter__(self) -> ObjectRefGenerator:
        return self

    def __next__(self) -> ObjectRef:
        ref = self._next(None)
        if ref is None:
            raise StopIteration
        return ref

    def __aiter__(self) -> ObjectRefGenerator:
        return self

    async def __anext__(self) -> ObjectRef:
        # The wait blocks: in a thread, so that the event loop goes on.
        ref = await asyncio.to_thread(self._next, None)
        if ref is None:
            raise StopAsyncIteration
        return ref

    def _next_sync(self, timeout_s: float | None = None) -> ObjectRef:
        """Ray's ``_next_sync``: the next ref, waiting at most ``timeout_s``
        (GetTimeoutError after it; StopIteration at the end)."""
        ref = self._next(timeout_s)
        if ref is None:
            raise StopIteration
        return ref

    def is_finished(self) -> bool:
        """Whether every item has been handed out (the iteration is over)."""
        return self._finished

    def completed(self) -> ObjectRef:
        """A ref that is ready when the generator has ended; its value is the
        number of items, and its ``get`` raises when the call could not
        start or the worker died."""
        return self._end

    def _take_over(self, inner: ObjectRefGenerator) -> None:
        """Become the stream ``inner`` opened for this generator, whose call
        waited for its arguments (client lock held; our end adopts inner's
        next, in the deferred-call watcher)."""
        self._link, self._items = inner._link, inner._items
        end, ours = inner._end, self._end
        if isinstance(end, _EndRef) and isinstance(ours, _EndRef):
            ours._open_on, end._open_on = getattr(end, "_open_on", None), None
        inner._client = None   # its __del__ must not stop the stream it handed over
        inner._items = collections.deque()

    def _next(self, timeout: float | None) -> ObjectRef | None:
        client = self._client
        while True:
            if self._finished:
                return None
            head = self._items[0] if self._items else None
            end = self._end
            if head is not None and head.done() and (head._error is None
                                                      or end._error is None):
                self._items.popleft()
                self._taken += 1
                self._last_failed = head._error is not None
                self._grant()
                return head
            if end.done():
                if end._error is not None:
                    # The call failed as a whole (it could not start, its
                    # worker died, it was cancelled): one ref says why.
                    self._finish()
                    if self._last_failed:
                        return None
                    self._last_failed = True
                    return head if head is not None and head.done() else ObjectRef.of_error(
                        end._error)
                if self._taken >= end._value or head is None:
                    self._finish()
                    return None
            assert client is not None   # a failed generator's end is done
            if head is None and end._deferred:   # the call waits for its arguments
                deadline = None if timeout is None else time.monotonic() + timeout
                client._deferrals.await_submitted(end, deadline, timeout)
                continue
            waiting = [r for r in (head, end) if r is not None and not r.done()]
            ready, _ = client.wait(waiting, 1, timeout)
            if not ready and timeout is not None:
                raise GetTimeoutError(f"{self._describe()}: no item within {timeout:.3g} s")

    def _grant(self) -> None:
        """One more item id for the worker (the caller took one)."""
        client, link = self._client, self._link
        if client is None or link is None:
            return
        with client.lock:
            if self._end.done() or link.dead:
                return
            corr = link.channel.reserve(1)[0]
            self._items.append(self._item_ref(client, link, corr))
            try:
                link.channel.send(StreamCredit(self._end._corr, (corr,)),
                                  timeout=client._send_timeout)
            except PeerError as exc:
                link.die(str(exc))

    def _item_ref(self, client: CoreClient, link: PeerLink, corr: int) -> ObjectRef:
        return (_TaskItemRef if self._task else _ItemRef)(client, link, corr, self._what)

    def _finish(self) -> None:
        """The iteration is over: the item ids still granted will not be
        answered; stop waiting for them."""
        self._finished = True
        self._release(None)

    def _release(self, error: BaseException | None) -> None:
        """Drop the refs of items not arrived (failing them with ``error``)."""
        client, link = self._client, self._link
        if client is None or link is None:
            self._items.clear()
            return
        with client.lock:
            kept: collections.deque[ObjectRef] = collections.deque()
            unused = []
            for ref in self._items:
                if ref.done():
                    kept.append(ref)
                    continue
                if link.refs.get(ref._corr) is ref:
                    del link.refs[ref._corr]
                unused.append(ref._corr)
                if error is not None:   # the next item says why there are no more
                    ref._link = None
                    ref._error = error
                    kept.append(ref)
                    error = None
            link.channel.forget(unused)
            self._items = kept

    # ------------------------------------------------------------- stopping

    def _describe(self) -> str:
        what = self._what
        return call_name(*what) if isinstance(what, tuple) else what

    def _cancel(self, force: bool) -> None:
        """``pmetal.cancel(gen)``: the worker stops the generator; items not
        arrived fail with TaskCancelledError (the next ``next`` returns one,
        then the iteration ends)."""
        client, link, end = self._client, self._link, self._end
        if client is None or self._finished or end.done():
            return
        if link is None:   # not sent yet: it waits for its arguments
            with client.lock:
                if end._deferred and client._deferrals.drop(end):
                    end._error = TaskCancelledError(
                        f"{self._describe()} was cancelled by pmetal.cancel before it was sent")
                    return
            link = self._link
            if link is None or end.done():
                return
        if force and not self._task:
            raise PMetalValueError(
                f"pmetal.cancel(force=True) of {self._describe()}: an actor method cannot be "
                f"force-cancelled (its process is the actor's); use pmetal.kill(actor) to "
                f"end the actor, or cancel without force")
        error = TaskCancelledError(f"{self._describe()} was cancelled by pmetal.cancel")
        with client.lock:
            _send_stop(link, end._corr, True, client._send_timeout)
            self._release(error)
            if link.refs.get(end._corr) is end:
                del link.refs[end._corr]   # its reply is dropped when it comes
            end._link = None
            end._error = error
            if isinstance(end, _EndRef):
                end._closed()   # the worker stops it; our next tasks may go there
        if force:
            reply = client.request_node(KillActor("", True, "", link.address))
            if isinstance(reply, Failure) and reply.kind != FailureKind.NOT_FOUND:
                raise ActorDiedError(f"{self._describe()}: could not kill its worker: "
                                     f"{reply.message}")

    def __del__(self) -> None:
        client, link, end = self._client, self._link, self._end
        if (client is None or link is None or self._finished or link.dead or client.closed
                or sys.is_finalizing()):
            # At interpreter exit a new thread never starts (Thread.start
            # would wait for it forever): the worker sees our link close.
            return
        # Stop the worker, which may wait for ids that will never come, and
        # stop waiting for the items not taken. Not here: __del__ may run
        # in a thread holding the client lock halfway through a send.
        corrs = [r._corr for r in self._items if not r.done()]
        stream = 0 if end.done() else end._corr
        try:
            threading.Thread(target=_drop, args=(client, link, stream, corrs),
                             name="pmetal-stream-drop", daemon=True).start()
        except RuntimeError:   # the interpreter is shutting down: the worker sees us go
            pass

    def __reduce__(self) -> Any:
        raise TypeError(f"{self!r} cannot be sent to another process (as in Ray): its items "
                        f"come to this one; pass the refs it yields instead")

    def __repr__(self) -> str:
        state = "finished" if self._finished else f"{self._taken} taken"
        return f"ObjectRefGenerator({self._describe()}, {state})"


class _NextReady:
    """What ``pmetal.wait`` waits on for an ObjectRefGenerator (Ray's
    ``ray.wait([gen])``): done when ``next(gen)`` would not block (its next
    item arrived, or the stream ended). It reads as a ref to the client's
    wait: the generator's link, and a death on it fails the next item."""

    __slots__ = ("gen",)

    def __init__(self, gen: ObjectRefGenerator) -> None:
        self.gen = gen

    @property
    def _client(self) -> Any:
        return self.gen._client

    def _pending(self) -> ObjectRef | None:
        """The ref ``next`` would wait for; None when it would not wait."""
        gen = self.gen
        if gen._finished or gen._end.done():
            return None
        head = gen._items[0] if gen._items else None
        if head is None:   # not sent yet (it waits for its arguments)
            return gen._end
        return None if head.done() else head

    def done(self) -> bool:
        return self._pending() is None

    @property
    def _deferred(self) -> bool:
        pending = self._pending()
        return pending is not None and pending._deferred

    @property
    def _link(self) -> PeerLink | None:
        head = self._pending()
        return None if head is None else head._link

    def _fail_link(self, why: str) -> None:
        head = self._pending()
        if head is not None and not head._deferred:
            head._fail_link(why)
            self.gen._end._fail_link(why)


def wait(waitables: list[Any], num_returns: int,
         timeout: float | None) -> tuple[list[Any], list[Any]]:
    """``pmetal.wait`` over refs and ObjectRefGenerators (a generator is
    ready when its next item has arrived or its stream has ended)."""
    stand_ins = [_NextReady(w) if isinstance(w, ObjectRefGenerator) else w for w in waitables]
    client = next((w._client for w in stand_ins if not w.done() and w._client is not None),
                  None)
    if client is None:   # all done (or made without a client): nothing to wait for
        ready = [w for w, s in zip(waitables, stand_ins) if s.done()][:num_returns]
    else:
        done, _ = client.wait(stand_ins, num_returns, timeout)
        chosen = set(map(id, done))
        ready = [w for w, s in zip(waitables, stand_ins) if id(s) in chosen]
    picked = set(map(id, ready))
    return ready, [w for w in waitables if id(w) not in picked]


def _send_stop(link: PeerLink, stream: int, cancel: bool, timeout: float) -> None:
    if link.dead:
        return
    try:
        link.channel.send(StreamStop(stream, cancel), timeout=timeout)
    except PeerError as exc:
        link.die(str(exc))


def _drop(client: CoreClient, link: PeerLink, stream: int, corrs: list[int]) -> None:
    """A generator was dropped before its end was taken: stop its stream
    (``stream``, 0 when it ended; its answer is discarded when it comes) and
    forget the ids of the items not taken."""
    with client.lock:
        if client.closed:
            return
        if stream:
            _send_stop(link, stream, False, client._send_timeout)
            end = link.refs.pop(stream, None)
            if isinstance(end, _EndRef):
                end._closed()
        for corr in corrs:
            link.refs.pop(corr, None)
        link.channel.forget(corrs)


# ------------------------------------------------------------------ sending

def _open(client: CoreClient, link: PeerLink, body_of: Any, what: Any, window: int,
          task: bool, nested: list[ObjectRef] | None = None) -> ObjectRefGenerator:
    """Send a StreamCall on ``link`` (client lock held); ``nested``: the refs
    pickled inside its arguments, lent to the worker first."""
    if nested and not link.dead:
        client.objects.lend(nested, link.channel.peer or "")
    corrs = link.channel.reserve(window)
    cls = _TaskItemRef if task else _ItemRef
    items: collections.deque[ObjectRef] = collections.deque(
        cls(client, link, corr, what) for corr in corrs)
    try:
        corr = link.channel.submit(body_of(tuple(corrs)), timeout=client._send_timeout)
    except PeerError as exc:
        link.die(str(exc))   # fails the items too
        name = call_name(*what) if isinstance(what, tuple) else what
        end = ObjectRef.of_error((WorkerCrashedError if task else ActorDiedError)(
            f"{name}: {exc}"))
    else:
        end = _EndRef(client, link, corr, what)
        end._opened(link, task)
    client.calls += 1
    return ObjectRefGenerator(client, link, what, items, end, task)


class _Later:
    """How a stream whose call waits for its ObjectRef arguments is sent:
    the deferred-call watcher (pmetal.actors.deferred) calls it, client lock
    held, once they are done (``prepare`` first, without the lock, finds an
    actor). It opens the stream and hands it to the generator ``.remote()``
    returned at once; a generator dropped meanwhile sends nothing."""

    def __init__(self, gen: ObjectRefGenerator, send: Any, prepare: Any) -> None:
        self._gen = weakref.ref(gen)
        self._send = send
        self.prepare = prepare

    def __call__(self, args: list[Any], kwargs: dict[str, Any],
                 nested: list[ObjectRef] | None = None) -> ObjectRef:
        gen = self._gen()
        if gen is None:
            return ObjectRef.of_error(PMetalValueError("the ObjectRefGenerator was dropped "
                                                       "before its call was sent"))
        inner = self._send(args, kwargs, nested=nested)
        gen._take_over(inner)
        return inner._end


def _later(client: CoreClient, send: Any, args: list[Any], kwargs: dict[str, Any],
           actor_id: str, what: Any, task: bool, prepare: Any = None) -> ObjectRefGenerator:
    """A generator now, its stream opened by ``send`` once the arguments are
    done (calls to the same actor made later wait behind it, as for calls)."""
    end = _EndRef(client, None, 0, what)
    end._task = task
    gen = ObjectRefGenerator(client, None, what, collections.deque(), end, task)
    # The queue of deferred.py, with our own ref: the generator's end, which
    # adopts the real one when the call is sent.
    client._deferrals._queue(end, _Later(gen, send, prepare), list(args), kwargs, actor_id)
    return gen


def stream_actor_call(client: CoreClient, handle: Any, method: str, args: list[Any],
                      kwargs: dict[str, Any], window: int) -> ObjectRefGenerator:
    """``handle.method.options(num_returns="streaming").remote(...)``."""
    what = (handle, method)

    def send(a: list[Any], kw: dict[str, Any], link: PeerLink | None = None,
             nested: list[ObjectRef] | None = None) -> Any:
        """Open the stream (client lock held, the actor found)."""
        link = link or client.locator.ready(handle)
        if link is None or link.dead:
            return ObjectRefGenerator._failed(ActorDiedError(
                f"{call_name(handle, method)}: its worker went away while the call was "
                f"being sent"), what)
        if link.outbox:
            client._flush(link)   # calls queued before this one are sent first
        return _open(client, link, lambda corrs: StreamCall(handle._actor_id, method, None,
                                                            a, kw, corrs),
                     what, window, task=False, nested=nested)

    deferrals = client._deferrals
    if ((deferrals.actors and handle._actor_id in deferrals.actors)
            or Deferrals.unready(args, kwargs)):
        return _later(client, send, args, kwargs, handle._actor_id, what, task=False,
                      prepare=lambda: client.locator.prepare(handle))
    (args, kwargs), nested = pack_collecting(client._resolve_args, args, kwargs)
    with client.lock:
        link = client.locator.ready(handle)
    if link is None:
        found = client.locator.find(handle)
        if isinstance(found, BaseException):
            return ObjectRefGenerator._failed(found, what)
        link = found
    with client.lock:
        if link.dead:
            return ObjectRefGenerator._failed(
                ActorDiedError(f"{call_name(handle, method)}: {link.dead}"), what)
        return send(args, kwargs, link, nested)


def stream_task(client: CoreClient, fn_id: str, fn_ref: Any, args: list[Any],
                kwargs: dict[str, Any], name: str, window: int,
                where: Any = None) -> ObjectRefGenerator:
    """``f.options(num_returns="streaming").remote(...)``; ``where(what)``
    (client lock held) gives the link to a task worker elsewhere (a
    scheduling strategy: pmetal.actors.routing); None: one of our node's."""
    what = f"remote function {name}"

    def send(a: list[Any], kw: dict[str, Any],
             nested: list[ObjectRef] | None = None) -> ObjectRefGenerator:
        """Open the stream (client lock held)."""
        link = client._task_link(what) if where is None else where(what)
        if isinstance(link, BaseException):
            return ObjectRefGenerator._failed(link, what)
        ref_body = None if fn_id in link.functions else fn_ref
        gen = _open(client, link, lambda corrs: StreamCall("", fn_id, ref_body, a, kw, corrs),
                    what, window, task=True, nested=nested)
        link.functions.add(fn_id)
        return gen

    if Deferrals.unready(args, kwargs):
        return _later(client, send, args, kwargs, "", what, task=True)
    (args, kwargs), nested = pack_collecting(client._resolve_args, args, kwargs)
    with client.lock:
        return send(args, kwargs, nested)
