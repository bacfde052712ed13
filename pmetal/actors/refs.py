"""Results to come: :class:`ObjectRef`, and the exception a failed call
stands for.

An ObjectRef is filled by the client that made it (``pmetal/actors/client.py``)
when the reply arrives on its link, or failed when that link dies; a ref
whose call waits for its own ref arguments is marked ``_deferred`` and takes
over the state of the call once ``pmetal/actors/deferred.py`` sends it. A ref
with a ``_retry`` (a task's ``max_retries``, an actor's ``max_task_retries``)
that fails in a way the retry allows goes back there instead of failing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pmetal.actors.serialization import load_exception, remote_error, unpack_value
from pmetal.errors import (ActorDiedError, PeerError, PlacementError, PMetalError,
                           PMetalTimeoutError, PMetalValueError, TaskCancelledError,
                           WorkerCrashedError)
from pmetal.channel import refusal
from pmetal.codec import Envelope
from pmetal.values import FailureKind
from pmetal.wire import Failure, Result

if TYPE_CHECKING:
    from pmetal.actors.client import CoreClient
    from pmetal.actors.deferred import Retry
    from pmetal.actors.links import PeerLink

__all__ = ["ItemFailed", "ItemRef", "ObjectRef", "call_name", "failure_error", "split_ref"]


TASK_WHAT = "remote function "
"""How a task's ref names its call (``on_death``): ``"remote function NAME"``."""


def _is_task(on_death: Any) -> bool:
    return isinstance(on_death, str) and on_death.startswith(TASK_WHAT)


def call_name(handle: Any, method: str) -> str:
    return f"actor {handle._class_name}({handle._actor_id[-8:]}).{method}"


class ObjectRef:
    """A future result: of an actor call, a remote function, or ``pmetal.put``.

    ``pmetal.get(ref)`` returns the value; ``await ref`` does the same in
    asyncio code. Refs are owned by the process that made them; a ref sent
    inside a value is borrowed by its receiver, whose ``get`` fetches the
    value from the owner (pmetal.actors.objects).
    """

    # _oid: the object's id, given when the ref is first sent inside a
    # value (0 until then; pmetal.actors.objects).
    __slots__ = ("_client", "_corr", "_deferred", "_error", "_has_value", "_link", "_oid",
                 "_on_death", "_retry", "_value", "__weakref__")

    def __init__(self, client: CoreClient | None, link: PeerLink | None = None, corr: int = 0,
                 on_death: Any = "", retry: Retry | None = None) -> None:
        self._client = client
        self._link = link
        self._corr = corr
        self._has_value = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._on_death = on_death
        self._deferred = False   # its call waits for ObjectRef arguments (deferred.py)
        self._retry = retry   # how to send its call again (deferred.py)
        self._oid = 0
        if link is not None:
            link.refs[corr] = self

    @classmethod
    def of_value(cls, value: Any) -> ObjectRef:
        ref = cls(None)
        ref._set(value)
        return ref

    @classmethod
    def of_error(cls, error: BaseException) -> ObjectRef:
        ref = cls(None)
        ref._error = error
        return ref

    def _adopt(self, inner: ObjectRef) -> None:
        """Take over the state of ``inner``, the ref of the call sent on this
        ref's behalf (client lock held, so no reply is filed meanwhile)."""
        self._value, self._has_value, self._error = inner._value, inner._has_value, inner._error
        link = self._link = inner._link
        self._corr = inner._corr
        if link is None:
            return
        if link.refs.get(inner._corr) is inner:
            link.refs[inner._corr] = self
            return
        for i, (queued, call) in enumerate(link.outbox):
            if queued is inner:
                link.outbox[i] = (self, call)
                return

    def _set(self, value: Any) -> None:
        self._value = value
        self._has_value = True
        self._link = None
        self._retry = None   # its arguments need not be kept any longer

    def _what(self) -> str:
        what = self._on_death
        return call_name(*what) if isinstance(what, tuple) else what

    def _fail_link(self, why: str) -> None:
        if not self.done():
            self._link = None
            if self._retry is not None and self._retry.again(self, None):
                return
            # A task's worker is no actor: Ray's name for its death is
            # WorkerCrashedError (an ActorDiedError here, so both catch it).
            died = WorkerCrashedError if _is_task(self._on_death) else ActorDiedError
            self._error = died(f"{self._what()}: {why}")

    def done(self) -> bool:
        return self._has_value or self._error is not None

    def _settle(self, env: Envelope) -> None:
        body = env.body
        self._link = None
        if type(body) is Result:
            try:
                self._set(unpack_value(body.value))  # type: ignore[attr-defined]
            except Exception as exc:  # the value arrived but cannot be unpickled here
                self._error = exc
        elif isinstance(body, Failure):
            error = failure_error(body, self._what())
            retry = self._retry
            if retry is not None and body.kind in (FailureKind.USER, FailureKind.ACTOR_DIED) \
                    and retry.again(self, error if body.kind == FailureKind.USER else None):
                return
            self._error = error
        else:
            # The worker could not decode the call (channel.refusal), or a
            # reply no call expects.
            self._error = refusal(body) or PeerError(f"unexpected reply {type(body).__name__}")

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def __await__(self) -> Any:
        if not self.done():
            import asyncio
            client = self._client
            assert client is not None   # only of_value and of_error refs lack one: done
            # get blocks: in a thread, so that the event loop goes on.
            yield from asyncio.to_thread(client.get_one, self, None).__await__()
        return self.result()

    def __reduce__(self) -> Any:
        # Inside a value: the ref travels as its object's id and owner, and
        # is registered for its receiver (pmetal.actors.objects).
        reduce = _REDUCE
        if reduce is None:
            reduce = _load_reduce()
        return reduce(self)

    def __repr__(self) -> str:
        state = "ready" if self.done() else "pending"
        return f"ObjectRef({state})"


class ItemFailed:
    """An item of a ``num_returns=N`` call that did not come (a generator
    task that raised or ended early, pmetal.actors.dynamic): the error its
    item ref raises."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __reduce__(self) -> Any:
        return (ItemFailed, (self.error,))


class ItemRef(ObjectRef):
    """Item ``index`` of what another ref (``base``) resolves to: one of the
    N refs a ``num_returns=N`` call returns, as in Ray.

    The call itself has one ref (one reply, one value: the returned tuple or
    list); the N item refs wait through it, so ``get``, ``wait``, ``await``
    and passing one as an argument work as for any ref. A value that is not
    a sequence of exactly N items fails every item ref with the same error.
    """

    __slots__ = ("_base", "_count", "_index")

    def __init__(self, base: ObjectRef, index: int, count: int) -> None:
        # No ObjectRef.__init__: the state (client, link, value) is the base's.
        self._base = base
        self._index = index
        self._count = count
        self._oid = 0

    # What the client reads to wait for a ref: the base's (get, wait and
    # the deferred-call watcher drive the base's link).
    _client = property(lambda self: self._base._client)   # type: ignore[assignment]
    _link = property(lambda self: self._base._link)   # type: ignore[assignment]
    _deferred = property(lambda self: self._base._deferred)   # type: ignore[assignment]

    def _fail_link(self, why: str) -> None:
        self._base._fail_link(why)

    @property
    def _error(self) -> BaseException | None:   # type: ignore[override]
        """What ``result`` raises, once done (the deferred-call watcher
        reads it of a call's ref arguments)."""
        base = self._base
        if base._error is not None or not base.done():
            return base._error
        return self._shape_error(base._value)

    def _what(self) -> str:
        return self._base._what()

    def done(self) -> bool:
        return self._base.done()

    def _shape_error(self, value: Any) -> BaseException | None:
        if isinstance(value, (tuple, list)) and len(value) == self._count:
            item = value[self._index]
            return item.error if type(item) is ItemFailed else None
        got = (f"a {type(value).__name__} of {len(value)} items"
               if isinstance(value, (tuple, list)) else f"a {type(value).__name__}")
        return PMetalValueError(
            f"{self._what()} was called with num_returns={self._count} but returned {got}; "
            f"it must return a tuple or list of exactly {self._count} items")

    def result(self) -> Any:
        value = self._base.result()
        error = self._shape_error(value)
        if error is not None:
            raise error
        return value[self._index]

    def __repr__(self) -> str:
        state = "ready" if self.done() else "pending"
        return f"ObjectRef({state}, item {self._index} of {self._count})"


_REDUCE: Any = None


def _load_reduce() -> Any:
    """objects.reduce_ref (imported on first use: objects imports this module)."""
    global _REDUCE
    from pmetal.actors.objects import reduce_ref
    _REDUCE = reduce_ref
    return reduce_ref


def split_ref(ref: ObjectRef, num_returns: int) -> ObjectRef | list[ObjectRef]:
    """What a call with ``num_returns`` returns: ``ref`` itself for 1 (as in
    Ray, one ref, not a list), else a list of item refs over it."""
    if num_returns == 1:
        return ref
    return [ItemRef(ref, i, num_returns) for i in range(num_returns)]


def failure_error(body: Failure, on_death: str = "") -> BaseException:
    """The exception a Failure reply stands for."""
    if body.kind == FailureKind.USER:
        original = load_exception(body.exception) if body.exception is not None else None
        return remote_error(body.error_type, body.message, body.traceback, original)
    if body.kind == FailureKind.ACTOR_DIED:
        return ActorDiedError(f"{on_death}: {body.message}" if on_death else body.message)
    if body.kind == FailureKind.NO_SUCH_METHOD:
        return AttributeError(body.message)
    if body.kind == FailureKind.PLACEMENT:
        return PlacementError(body.message)
    if body.kind == FailureKind.NOT_FOUND:
        return PMetalValueError(body.message)
    if body.kind == FailureKind.CANCELLED:   # pmetal.cancel of a running async method
        # As in Ray, RayTaskError(TaskCancelledError): the error of a task
        # that ran (RemoteError) and a TaskCancelledError at once.
        message = f"{on_death}: {body.message}" if on_death else body.message
        return remote_error("TaskCancelledError", message, body.traceback or "",
                            TaskCancelledError(message))
    if body.kind == FailureKind.TIMEOUT:   # e.g. a creation that waited in a node's queue too long
        return PMetalTimeoutError(body.message)
    builtin = _BUILTIN_ERRORS.get(body.error_type)
    if builtin is not None:
        return builtin(body.message)
    return PMetalError(f"{body.error_type}: {body.message}")


_BUILTIN_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError,
    "AttributeError": AttributeError}
