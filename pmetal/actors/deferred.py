"""Calls and tasks whose ObjectRef arguments are not ready yet.

``g.remote(f.remote(x))`` returns at once, as in Ray: the call waits here,
in the caller's process, until ``f``'s result has arrived, and is then sent
with the value in place of the ref. Meanwhile the caller goes on submitting,
so a chain of tasks over many inputs runs its first stage in parallel
instead of one input at a time.

One thread per client (started with the first deferred call) watches the
pending arguments and submits each waiting call once its arguments are
ready. Calls from this process to one actor keep their submission order: a
call to an actor that has a call waiting here waits behind it, even when its
own arguments are ready. Tasks have no order and go as soon as they can.

A failed argument fails the call that waits on it with the same exception,
without running it (Ray does the same). Non-ref arguments are packed at the
call site, so an unpicklable argument still raises there.

Retries go the same way: a task whose worker died (``max_retries``) or that
raised one of its ``retry_exceptions``, and an actor call whose actor died
(``max_task_retries``), is queued here again by its ref (see :class:`Retry`)
and sent anew by the watcher, behind nothing and in front of later calls to
the same actor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pmetal.actors.objects import pack_collecting
from pmetal.actors.refs import ObjectRef
from pmetal.actors.serialization import pack_value
from pmetal.errors import GetTimeoutError, PMetalError

if TYPE_CHECKING:
    from pmetal.actors.client import CoreClient

__all__ = ["Deferrals", "Retry"]

log = logging.getLogger(__name__)

# submit(args, kwargs, nested): ``nested`` are the refs pickled inside the
# arguments, lent to the receiver once the call's link is known.
Submit = Callable[[list[Any], dict[str, Any], list[ObjectRef]], ObjectRef]

# How long the watcher holds the client lock while waiting for arguments:
# short, so the thread that submits calls is never kept waiting for long.
_SLICE = 0.005


@dataclass(eq=False)   # identity: a call waits here once
class _Waiting:
    ref: ObjectRef            # handed to the caller; adopts the real call's state
    submit: Submit            # sends the call (client lock held), returns its ObjectRef
    args: list[Any]           # packed, ObjectRefs in place
    kwargs: dict[str, Any]
    actor_id: str             # "" for a task
    deps: list[ObjectRef]     # the ref arguments not yet done at the call
    nested: list[ObjectRef]   # refs pickled inside the packed arguments


@dataclass(eq=False)
class Retry:
    """How to send a call again, kept on its ObjectRef until it is done."""

    submit: Submit            # as for _Waiting
    args: list[Any]           # as the caller gave them (refs are done by now)
    kwargs: dict[str, Any]
    actor_id: str             # "" for a task
    left: int                 # retries left; -1: without limit
    exceptions: bool | tuple[type[BaseException], ...] = False   # user errors that retry
    what: str = ""

    def again(self, ref: ObjectRef, error: BaseException | None) -> bool:
        """Queue ``ref``'s call again if this failure allows it: ``error``
        None for a system failure (the worker or actor died), else the user
        exception it raised. False: let the failure stand."""
        if self.left == 0:
            return False
        if error is not None and not (self.exceptions is True or (
                isinstance(self.exceptions, tuple) and isinstance(error, self.exceptions))):
            return False
        client = ref._client
        if client is None:
            return False
        if self.left > 0:
            self.left -= 1
        log.info("%s failed (%s); sending it again (%s)", ref._what(),
                 "its process died" if error is None else type(error).__name__,
                 "retries without limit" if self.left < 0 else f"{self.left} retries left")
        return client._deferrals.resubmit(ref, self)


def _pack_unresolved(args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The arguments packed, top-level ObjectRefs left in place."""
    return ([a if isinstance(a, ObjectRef) else pack_value(a) for a in args],
            {k: v if isinstance(v, ObjectRef) else pack_value(v) for k, v in kwargs.items()})


def _pack_resolved(args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Packed arguments with their top-level ObjectRefs (done) replaced by
    their packed values."""
    return ([pack_value(a.result()) if isinstance(a, ObjectRef) else a for a in args],
            {k: pack_value(v.result()) if isinstance(v, ObjectRef) else v
             for k, v in kwargs.items()})


class Deferrals:
    def __init__(self, client: CoreClient) -> None:
        self._client = client
        self._items: list[_Waiting] = []
        self.actors: dict[str, int] = {}   # actor id -> its calls waiting here
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.deferred = 0

    @staticmethod
    def unready(args: list[Any], kwargs: dict[str, Any]) -> bool:
        """Whether any top-level argument is an ObjectRef not done yet."""
        for a in args:
            if isinstance(a, ObjectRef) and not a.done():
                return True
        for v in kwargs.values():
            if isinstance(v, ObjectRef) and not v.done():
                return True
        return False

    def add(self, submit: Submit, args: list[Any], kwargs: dict[str, Any], actor_id: str,
            what: Any, retry: Retry | None = None) -> ObjectRef:
        """Queue a call; its ObjectRef now, its submission once its ref
        arguments are done."""
        ref = ObjectRef(self._client, None, 0, what, retry)
        self._queue(ref, submit, args, kwargs, actor_id)
        return ref

    def resubmit(self, ref: ObjectRef, retry: Retry) -> bool:
        """Queue the call of a failed ``ref`` again (see :class:`Retry`);
        False when the client is closing."""
        try:
            self._queue(ref, retry.submit, retry.args, retry.kwargs, retry.actor_id)
        except PMetalError:
            return False
        return True

    def _queue(self, ref: ObjectRef, submit: Submit, args: list[Any], kwargs: dict[str, Any],
               actor_id: str) -> None:
        (packed, packed_kw), nested = pack_collecting(_pack_unresolved, args, kwargs)
        deps = [a for a in [*args, *kwargs.values()] if isinstance(a, ObjectRef) and not a.done()]
        with self._cond:
            if self._closed:
                raise PMetalError("the client is closed (pmetal.shutdown was called)")
            ref._deferred = True
            self._items.append(_Waiting(ref, submit, packed, packed_kw, actor_id, deps, nested))
            if actor_id:
                self.actors[actor_id] = self.actors.get(actor_id, 0) + 1
            self.deferred += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pmetal-deferred",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def await_submitted(self, ref: ObjectRef, deadline: float | None,
                        timeout: float | None) -> None:
        """Block until ``ref``'s call has been sent (or failed)."""
        with self._cond:
            while ref._deferred:
                if deadline is None:
                    self._cond.wait(1.0)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise GetTimeoutError(
                        f"result not ready within {timeout:.3g} s (the call still waits to "
                        f"be sent: for its ObjectRef arguments, or again after a failure); "
                        f"call pmetal.get again to keep waiting")
                self._cond.wait(min(remaining, 1.0))

    def drop(self, ref: ObjectRef) -> bool:
        """Take ``ref``'s call out of the queue unsent (pmetal.cancel; client
        lock held, so the watcher is not sending it). False: not queued."""
        with self._cond:
            item = next((i for i in self._items if i.ref is ref), None)
            if item is None:
                return False
            self._items.remove(item)
            self._forget(item)
            ref._deferred = False
            self._cond.notify_all()
            return True

    def _forget(self, item: _Waiting) -> None:
        """Count ``item``'s call out of its actor's (``_cond`` held)."""
        if item.actor_id:
            left = self.actors.get(item.actor_id, 1) - 1
            if left > 0:
                self.actors[item.actor_id] = left
            else:
                self.actors.pop(item.actor_id, None)

    def await_change(self, seconds: float) -> None:
        """Block until some waiting call is sent, at most ``seconds``."""
        with self._cond:
            if self._items:
                self._cond.wait(seconds)

    def close(self) -> None:
        """Fail every call still waiting; stop the watcher."""
        with self._cond:
            self._closed = True
            items, self._items = self._items, []
            self.actors.clear()
            for item in items:
                item.ref._error = PMetalError(
                    f"{item.ref._what()}: pmetal.shutdown came before its ObjectRef "
                    f"arguments were ready; it was never sent")
                item.ref._deferred = False
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    # ---------------------------------------------------------- the watcher

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait(1.0)
                if self._closed:
                    return
                items = list(self._items)
            try:
                self._step(items)
            except Exception:  # never let the watcher die: calls would wait forever
                log.exception("the deferred-call watcher failed a step; retrying")
                self.await_change(_SLICE)  # back off before retrying the same step

    def _step(self, items: list[_Waiting]) -> None:
        sent = False
        blocked: set[str] = set()
        for item in items:
            if item.actor_id and item.actor_id in blocked:
                continue   # an earlier call to this actor still waits
            if all(d.done() for d in item.deps):
                self._send(item)
                sent = True
            elif item.actor_id:
                blocked.add(item.actor_id)
        if sent:
            return
        # Read results on the links of the pending arguments; arguments that
        # are themselves waiting here are sent by this thread, not read.
        pending = {id(d): d for item in items for d in item.deps
                   if not d.done() and not d._deferred}
        if pending:
            self._client.wait(list(pending.values()), 1, _SLICE)
            time.sleep(0)   # let a thread waiting for the client lock in
        else:
            self.await_change(_SLICE)

    def _send(self, item: _Waiting) -> None:
        ref = item.ref
        # An actor call first finds its actor (it may wait for a restart)
        # without the client lock, so that other threads' calls go on.
        prepare = getattr(item.submit, "prepare", None)
        unsendable = None
        if prepare is not None and not any(d._error is not None for d in item.deps):
            try:
                unsendable = prepare()
            except Exception as exc:  # noqa: BLE001 - the caller sees why at get
                unsendable = exc
        with self._client.lock:
            with self._cond:
                if item not in self._items:
                    return   # cancelled (drop) while its actor was being found
            try:
                failed = next((d for d in item.deps if d._error is not None), None)
                if failed is not None:
                    ref._error = failed._error
                elif unsendable is not None:
                    ref._error = unsendable
                else:
                    # The resolved values may hold refs too: lent with the others.
                    (args, kwargs), nested = pack_collecting(_pack_resolved, item.args,
                                                             item.kwargs)
                    ref._adopt(item.submit(args, kwargs, item.nested + nested))
            except Exception as exc:  # e.g. the actor is gone: the caller sees why at get
                ref._error = exc
            finally:
                with self._cond:
                    if item in self._items:
                        self._items.remove(item)
                        self._forget(item)
                    ref._deferred = False
                    self._cond.notify_all()
