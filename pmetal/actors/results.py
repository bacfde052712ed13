"""The caller side's results: getting, waiting for and cancelling calls.

A part of :class:`pmetal.actors.client.CoreClient`, kept apart for size (as
:mod:`pmetal.cluster.hints` is of the cluster service): these methods run on
its state. A ``get`` or ``wait`` flushes the calls it waits on, then
receives on their links in slices of ``_SLICE_MS`` under the client lock,
so other threads can submit between slices; the replies that arrived are
handed to their refs by correlation id (:meth:`Results._settle`), and a
link's death fails the refs pending on it within one slice. Refs borrowed
from another process are fetched from their owner
(:mod:`pmetal.actors.objects`), a window of them ahead. ``pmetal.cancel``
(:meth:`Results.cancel`) drops a call not sent yet, or discards the reply of
one that was sent and asks an actor's worker to cancel it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import zmq
from zmq.backend import zmq_poll

from pmetal.actors.deferred import Deferrals
from pmetal.actors.links import PeerLink
from pmetal.actors.objects import BorrowedRef, ObjectManager
from pmetal.actors.refs import ItemRef, ObjectRef, failure_error
from pmetal.actors.serialization import remote_error
from pmetal.errors import (ClosedError, GetTimeoutError, PeerError, PMetalTimeoutError,
                           PMetalValueError, TaskCancelledError, TransportError)
from pmetal.values import FailureKind
from pmetal.wire import CancelCall, Failure, KillActor, Message

__all__ = ["Results"]

_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_PREFETCH = 1000          # borrowed refs a get asks their owners for at once
_CLOSED = ("the result was still pending when pmetal.shutdown() closed the client that "
           "made the call; it will never arrive")


class Results:
    # State of the CoreClient these methods are part of.
    lock: threading.RLock
    _closing: threading.Event
    _deferrals: Deferrals
    _objects: ObjectManager | None
    _send_timeout: float

    if TYPE_CHECKING:   # steps of the CoreClient these methods call
        @property
        def objects(self) -> ObjectManager: ...
        def request_node(self, body: Message, timeout: float | None = None) -> Message: ...
        def _flush(self, link: PeerLink) -> None: ...

    def cancel(self, ref: ObjectRef, force: bool) -> None:
        """Stop ``ref``'s call as far as this process can (see
        ``pmetal.cancel``): a call still waiting here (for its ObjectRef
        arguments, a retry, or in a link's outbox) is dropped and never sent;
        a call already sent has its reply discarded, and an actor's worker is
        asked to cancel it (an async method stops; anything else runs on).
        Either way the ref fails with TaskCancelledError at once."""
        if type(ref) is BorrowedRef:
            raise PMetalValueError(
                f"pmetal.cancel of {ref._on_death}, a ref this process received inside a "
                f"value: only its owner, the process that made the call "
                f"({ref._owner.owner_id[:8]}), can cancel it; cancel it there")
        base = ref._base if isinstance(ref, ItemRef) else ref
        kill = ""   # the task worker to kill (force=True on a task sent)
        with self.lock:
            if base.done():
                return   # finished (or cancelled before): nothing to stop
            what = base._what()
            if force and isinstance(base._on_death, tuple):
                raise PMetalValueError(
                    f"pmetal.cancel(force=True) of {what}: an actor method cannot be "
                    f"force-cancelled (its process is the actor's); use pmetal.kill(actor) "
                    f"to end the actor, or cancel without force")
            base._retry = None   # a failure from now on must not send it again
            if base._deferred and self._deferrals.drop(base):
                state = "before it was sent"
            else:
                link = base._link
                state = "after it was sent; it runs on in its worker, its result is discarded"
                if link is not None:
                    for i, (queued, _call) in enumerate(link.outbox):
                        if queued is base:
                            del link.outbox[i]
                            state = "before it was sent"
                            break
                    else:
                        if link.refs.get(base._corr) is base:
                            del link.refs[base._corr]   # its reply is dropped (_settle)
                            if isinstance(base._on_death, tuple):   # an actor call
                                state = ("after it was sent; an async method is cancelled "
                                         "through asyncio, a sync one runs to completion and "
                                         "its result is discarded")
                                self._cancel_sent(link, base._corr)
                            elif force:
                                kill = link.address
                                state = ("while it was sent or running; force=True killed its "
                                         "worker process (the node starts another)")
            base._link = None
            message = f"{what} was cancelled by pmetal.cancel {state}"
            if state.startswith("before"):
                base._error = TaskCancelledError(message)
            else:
                # It reached its worker: as in Ray, the error of a task that
                # ran, RayTaskError(TaskCancelledError), an instance of both.
                base._error = remote_error("TaskCancelledError", message, "",
                                           TaskCancelledError(message))
        if kill:
            # Outside the lock: other calls go on. The worker's other calls
            # fail (or are retried) as when a worker crashes.
            reply = self.request_node(KillActor("", True, "", kill))
            if isinstance(reply, Failure) and reply.kind != FailureKind.NOT_FOUND:   # gone
                raise failure_error(reply)

    def _cancel_sent(self, link: PeerLink, corr: int) -> None:
        """Ask the actor's worker to cancel call ``corr`` if it is an async
        method running (CancelCall, one-way; lock held). A link that fails
        here fails its other calls as for any send."""
        try:
            link.channel.send(CancelCall(corr), timeout=self._send_timeout)
        except PeerError as exc:
            link.die(str(exc))

    # ---------------------------------------------------------------- results

    # A waiting get/wait holds the client lock for at most this long at a
    # time, so other threads (or an async actor's other calls) can submit.
    _SLICE_MS = 10

    def get(self, refs: list[ObjectRef], timeout: float | None) -> list[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            self._flush_links(refs)
        if self._objects is not None and len(refs) > 1:
            # Borrowed refs among them: fetches are asked a window ahead,
            # a round trip per window and owner rather than one per ref
            # (a window stays below the sockets' high-water marks).
            prefetch, window = self._objects.prefetch, _PREFETCH
            for i, ref in enumerate(refs):
                if not i % window:
                    prefetch(refs[i:i + window])
                self._await(ref, deadline, timeout)
            return [ref.result() for ref in refs]
        for ref in refs:
            self._await(ref, deadline, timeout)
        return [ref.result() for ref in refs]

    def get_one(self, ref: ObjectRef, timeout: float | None) -> Any:
        """``get([ref], timeout)[0]`` without its list walks."""
        self._await(ref, None if timeout is None else time.monotonic() + timeout, timeout)
        return ref.result()

    def _await(self, ref: ObjectRef, deadline: float | None, timeout: float | None) -> None:
        """Wait until ``ref`` is done (or raise GetTimeoutError)."""
        if self._closing.is_set() and not ref.done():
            raise ClosedError(_CLOSED)
        if type(ref) is BorrowedRef:   # owned elsewhere: fetched from its owner
            if not ref.done():
                ref._manager.fetch(ref, deadline, timeout)
            return
        pending = [ref]
        while not ref.done():
            if ref._deferred:   # waits for its arguments, or to be sent again (a retry)
                self._deferrals.await_submitted(ref, deadline, timeout)
                continue
            link = ref._link
            if link is not None and link.outbox:
                with self.lock:
                    self._flush(link)
            with self.lock:
                if not ref.done():
                    self._progress(pending, deadline, timeout)
            if not ref.done():
                time.sleep(0)  # a long wait: let a thread queued on the lock in

    def wait(self, refs: list[ObjectRef], num_returns: int,
             timeout: float | None) -> tuple[list[ObjectRef], list[ObjectRef]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._closing.is_set() and sum(1 for r in refs if r.done()) < num_returns:
            raise ClosedError(_CLOSED)
        with self.lock:
            self._flush_links(refs)
        while sum(1 for r in refs if r.done()) < num_returns:
            sent = [r for r in refs if not r.done() and not r._deferred]
            try:
                borrowed = [r for r in sent if type(r) is BorrowedRef]
                if borrowed:   # owned elsewhere: their owners' links, a slice each
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    sent = [r for r in sent if type(r) is not BorrowedRef]
                    self.objects.poll(borrowed, 0.0 if sent else self._SLICE_MS / 1000)
                    if not sent:
                        continue
                if not sent:   # all wait for their arguments: wait for one to be sent
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    self._deferrals.await_change(self._SLICE_MS / 1000)
                    continue
                with self.lock:
                    self._flush_links(sent)
                    self._progress(sent, deadline, timeout)
            except GetTimeoutError:
                break
            if sum(1 for r in refs if r.done()) < num_returns:
                time.sleep(0)  # a long wait: let a thread queued on the lock in
        ready = [r for r in refs if r.done()][:num_returns]
        chosen = set(map(id, ready))
        return ready, [r for r in refs if id(r) not in chosen]

    def _flush_links(self, refs: list[ObjectRef]) -> None:
        for link in {id(r._link): r._link for r in refs if r._link is not None}.values():
            if link.outbox:
                self._flush(link)

    def _progress(self, pending: list[ObjectRef], deadline: float | None,
                  timeout: float | None) -> None:
        """Wait until at least one message or connection event arrives on the
        links of ``pending`` refs, and file it."""
        links = {id(r._link): r._link for r in pending if r._link is not None}
        if not links:
            for r in pending:
                if not r.done() and not r._deferred:  # no link, no value: its link died
                    r._fail_link("its connection was closed")
            return
        if deadline is None:
            ms = self._SLICE_MS
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GetTimeoutError(f"result not ready within {timeout:.3g} s; the call "
                                      f"goes on, call pmetal.get again to keep waiting")
            ms = min(self._SLICE_MS, max(1, int(remaining * 1000)))
        if len(links) == 1:
            self._progress_link(next(iter(links.values())), ms, pending)
            return
        items = []
        for link in links.values():
            items.append((link.socket, _POLLIN))
            items.append((link.monitor, _POLLIN))
        ready = {sock for sock, ev in zmq_poll(items, ms) if ev}
        for link in list(links.values()):
            if link.monitor in ready or link.node_dead():
                link.check()
            if link.socket in ready and not link.dead:
                sock = link.socket
                try:
                    link.channel.pump(0)
                    while sock.getsockopt(_EVENTS) & _POLLIN:
                        link.channel.pump(0)
                except PMetalTimeoutError:
                    pass
                except PeerError as exc:
                    link.die(str(exc))
                self._settle(link)

    def _progress_link(self, link: PeerLink, ms: int, pending: list[ObjectRef]) -> None:
        """_progress for refs that all wait on one link (nearly every get):
        a blocking receive on its socket alone, a third of the system calls
        of polling it with its monitor. A death shows on the monitor, read
        when a slice passes with nothing received: noticed within a slice."""
        if link.dead:
            for r in pending:
                if r._link is link:
                    r._fail_link(link.dead)
            return
        try:
            link.channel.pump(ms / 1000)
        except PMetalTimeoutError:
            link.check()
            return
        except TransportError as exc:   # PeerError, or the socket closed under us
            link.die(str(exc))
            return
        self._settle(link)

    def _settle(self, link: PeerLink) -> None:
        """Hand every reply that arrived on ``link`` to its ref (walks the
        replies, not the pending refs: thousands may be pending)."""
        channel = link.channel
        refs = link.refs
        for corr in channel.arrived():
            env = channel.take(corr, check=False)   # a refusal settles its ref (refs._settle)
            if env is None:
                continue
            ref = refs.pop(corr, None)
            if ref is not None:
                ref._settle(env)
