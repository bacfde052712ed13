"""The sockets of object ownership (see :mod:`pmetal.actors.objects`):

* :class:`ObjectServer`, an owner's: a :class:`~pmetal.endpoint.SecureListener`
  served by the thread ``pmetal-object-server``, which answers
  :class:`~pmetal.wire.FetchObject` (a pending object once its call's reply
  arrives: that thread reads the client's links for it, in 10 ms slices of
  the client lock), applies :class:`~pmetal.wire.BorrowUpdates`, and lapses
  borrowers whose lease ran out;
* :class:`OwnerLink`, a borrower's channel to one owner, shared under its
  lock by the threads that fetch and the updates thread, which tells the
  owner's death (its address refuses connections, the connection dropped
  and nothing listens there, its node was declared dead, or another process
  answers there) from its silence.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import zmq

from pmetal.actors.links import listening
from pmetal.actors.ownership import OwnerInfo, pack_to
from pmetal.actors.refs import ObjectRef
from pmetal.actors.serialization import load_exception, pack_exception, unpack_value
from pmetal.channel import Channel, refusal
from pmetal.endpoint import Incoming, SecureListener
from pmetal.errors import (
    ClosedError,
    GetTimeoutError,
    ObjectLostError,
    OwnerDiedError,
    PeerError,
    PMetalError,
    PMetalTimeoutError,
    ProtocolError,
    TransportError,
)
from pmetal.values import Address, FailureKind, host_of
from pmetal.wire import BorrowUpdates, Failure, FetchObject, Result

if TYPE_CHECKING:
    from pmetal.actors.objects import BorrowedRef, ObjectManager

__all__ = ["ObjectServer", "OwnerLink"]

log = logging.getLogger(__name__)

_SLICE = 0.01          # s a fetch or a pending object's wait holds a lock at a time
_BATCH_MAX = 50_000    # updates per BorrowUpdates
_FETCH_WAIT = 10.0     # s an owner holds a fetch of a pending object before "ask again"
_SUSPECT_FOR = 5.0    # s an owner's address is probed after its connection dropped
_PROBE_EVERY = 0.2    # s between two probes
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def _died(ref: BorrowedRef, why: str) -> OwnerDiedError:
    owner = ref._owner
    return OwnerDiedError(
        f"{ref._on_death} (object {ref._oid}) is lost: its owner, process "
        f"{owner.owner_id[:8]} at {owner.address}, died ({why}). pmetal keeps an object "
        f"only in the process that made it and does not rebuild lost objects; make the "
        f"value again, or keep its owner alive while others use it")


class OwnerLink:
    """A borrower's channel to one owner's object server, used under its
    lock by the threads that fetch and by the updates thread."""

    def __init__(self, manager: ObjectManager, owner: OwnerInfo) -> None:
        self.manager = manager
        self.owner = owner
        self.lock = threading.Lock()
        self.channel: Channel | None = None
        self._monitor: Any = None
        self.dead = ""
        self._fetching: dict[int, tuple[int, BorrowedRef]] = {}   # oid -> (corr, ref)
        self._oids: dict[int, int] = {}   # corr -> oid
        # After the connection drops, the address is probed every
        # _PROBE_EVERY until _SUSPECT_FOR has passed (a killed process's
        # port may accept for a moment while it exits).
        self._suspect_until = 0.0
        self._next_probe = 0.0

    # ------------------------------------------------------------- liveness

    def _node_dead(self) -> bool:
        client = self.manager.client
        node = self.owner.node_id
        return bool(node) and node != client.node_id and node in client.watch.dead

    def _open(self) -> Channel:
        """The open channel (lock held); sets ``dead`` instead when the
        owner is known to be gone."""
        channel = self.channel
        if channel is not None:
            return channel
        client = self.manager.client
        if self._node_dead():
            self.dead = f"its node {self.owner.node_id[:8]} was declared dead"
        elif not listening(self.owner.address):
            self.dead = "nothing listens at its address any more"
        if self.dead:
            raise PeerError(self.dead)
        dialer = client.transport.dial(self.owner.address)
        channel = Channel(dialer, client.identity, client.namespace, client.config)
        try:
            peer = channel.open(timeout=client.config.transport.handshake_timeout)
        except PMetalError as exc:
            channel.close()
            if not listening(self.owner.address):
                self.dead = "nothing listens at its address any more"
            raise PeerError(f"cannot reach the owner at {self.owner.address}: {exc}") from exc
        if peer != self.owner.owner_id:
            channel.close()
            self.dead = f"another process ({peer[:8]}) listens at its address now"
            raise PeerError(self.dead)
        self._monitor = dialer.monitor_disconnects()
        self.channel = channel
        return channel

    def _check(self) -> None:
        """Read connection events: a drop with nothing listening any more,
        or the owner's node declared dead, marks the owner dead."""
        if self.dead:
            return
        if self._node_dead():
            self.dead = f"its node {self.owner.node_id[:8]} was declared dead"
        monitor = self._monitor
        now = time.monotonic()
        while monitor is not None and not self.dead and monitor.getsockopt(_EVENTS) & _POLLIN:
            frames = monitor.recv_multipart()
            if frames and int.from_bytes(frames[0][:2], "little") == zmq.EVENT_DISCONNECTED:
                self._suspect_until, self._next_probe = now + _SUSPECT_FOR, now
        if self._suspect_until and not self.dead and now >= self._next_probe:
            self._next_probe = now + _PROBE_EVERY
            if not listening(self.owner.address):
                self.dead = "the connection to it dropped and nothing listens at its address"
            elif now > self._suspect_until:
                self._suspect_until = 0.0   # a live owner: ZeroMQ reconnects
        if self.dead:
            self._fail_all()

    def _fail_all(self) -> None:
        for _corr, ref in self._fetching.values():
            if not ref.done():
                ref._error = _died(ref, self.dead)
        self._fetching.clear()
        self._oids.clear()
        if self.channel is not None:
            self.channel.abandon()

    # --------------------------------------------------------------- fetch

    def fetch(self, ref: BorrowedRef, deadline: float | None, timeout: float | None) -> None:
        while not ref.done():
            with self.lock:
                if ref.done():
                    return
                self._step(ref, deadline)
            if not ref.done():
                if deadline is not None and time.monotonic() >= deadline:
                    raise GetTimeoutError(
                        f"{ref._on_death} not ready within {timeout:.3g} s (its owner, "
                        f"process {self.owner.owner_id[:8]}, does not have it yet); call "
                        f"pmetal.get again to keep waiting")
                time.sleep(0)   # let a thread queued on the lock in

    def _step(self, ref: BorrowedRef, deadline: float | None) -> None:
        """Ask for ``ref`` if not asked yet, then read replies for one slice
        (lock held)."""
        if self.dead:
            ref._error = _died(ref, self.dead)
            return
        try:
            channel = self._open()
            if ref._oid not in self._fetching:
                wait = _FETCH_WAIT if deadline is None else min(
                    _FETCH_WAIT, max(0.0, deadline - time.monotonic()) + 1.0)
                self._submit(channel, ref, wait)
            remaining = _SLICE if deadline is None else min(
                _SLICE, max(0.0, deadline - time.monotonic()))
            try:
                channel.pump(remaining)
            except PMetalTimeoutError:
                self._check()
                return
            self._settle(channel)
        except (PeerError, TransportError) as exc:
            if not self.dead and not listening(self.owner.address):
                self.dead = "nothing listens at its address any more"
            if self.dead:
                self._fail_all()
                ref._error = ref._error or _died(ref, self.dead)
            else:
                # Not kept in the ref: a later get tries again.
                self._forget_channel()
                raise PeerError(f"{ref._on_death}: cannot fetch it from its owner at "
                                f"{self.owner.address} now: {exc}; call pmetal.get again "
                                f"to retry") from exc

    def _forget_channel(self) -> None:
        """Drop the channel after an error that is not the owner's death (a
        later fetch opens a new one and asks again)."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
            self._monitor = None
        self._fetching.clear()
        self._oids.clear()

    def _submit(self, channel: Channel, ref: BorrowedRef, wait: float) -> None:
        corr = channel.submit(FetchObject(ref._oid, wait),
                              timeout=self.manager.client.config.transport.send_timeout)
        self._fetching[ref._oid] = (corr, ref)
        self._oids[corr] = ref._oid

    def request(self, refs: list[BorrowedRef]) -> None:
        """Ask for every ref of ``refs`` not asked for yet, without waiting
        (a get of many: one round trip for all). Errors are left to the
        fetch of each ref, which meets them again."""
        with self.lock:
            if self.dead:
                return
            try:
                channel = self._open()
                for ref in refs:
                    if ref._oid not in self._fetching and not ref.done():
                        self._submit(channel, ref, _FETCH_WAIT)
            except (PeerError, TransportError) as exc:
                log.debug("asking %s for %d objects: %s", self.owner.address, len(refs), exc)

    def _settle(self, channel: Channel) -> None:
        for corr in channel.arrived():
            env = channel.take(corr, check=False)
            oid = self._oids.pop(corr, None)
            if env is None or oid is None:
                continue
            _corr, ref = self._fetching.pop(oid)
            body = env.body
            if type(body) is Result:
                try:
                    ref._set(unpack_value(body.value))
                except Exception as exc:  # noqa: BLE001 - unpickling user values raises anything
                    ref._error = exc
            elif isinstance(body, Failure):
                if body.kind == FailureKind.TIMEOUT:
                    continue   # still pending at the owner: ask again
                if body.kind == FailureKind.OBJECT:
                    ref._error = (load_exception(body.exception)
                                  or PMetalError(f"{body.error_type}: {body.message}"))
                elif body.kind == FailureKind.NOT_FOUND:
                    ref._error = ObjectLostError(f"{ref._on_death} (object {ref._oid}): "
                                                 f"{body.message}")
                else:
                    ref._error = PeerError(f"{ref._on_death}: its owner answered "
                                           f"{body.error_type}: {body.message}")
            else:
                ref._error = refusal(body) or PeerError(
                    f"unexpected answer {type(body).__name__} to a fetch")

    # ------------------------------------------------------------- updates

    def send_updates(self, items: list[tuple[int, str, int]]) -> None:
        """Send ``items`` ((oid, borrower, delta), in order) in batches; an
        empty list renews our lease. Dropped when the owner is gone."""
        with self.lock:
            if self.dead:
                return
            try:
                channel = self._open()
                timeout = self.manager.client.config.transport.send_timeout
                for start in range(0, max(1, len(items)), _BATCH_MAX):
                    chunk = items[start:start + _BATCH_MAX]
                    names: dict[str, int] = {}
                    who = tuple(names.setdefault(b, len(names)) for _, b, _ in chunk)
                    channel.send(BorrowUpdates(tuple(names), tuple(o for o, _, _ in chunk), who,
                                               tuple(d for _, _, d in chunk)), timeout=timeout)
            except (PeerError, TransportError) as exc:
                log.debug("could not send %d borrower updates to %s: %s", len(items),
                          self.owner.address, exc)
                self._check()

    def close(self) -> None:
        with self.lock:
            self._forget_channel()


class _Waiter(NamedTuple):
    incoming: Incoming
    ref: ObjectRef
    until: float


class ObjectServer:
    """Serves this process's objects to its borrowers (see the module
    docstring); its thread alone uses its socket."""

    def __init__(self, manager: ObjectManager) -> None:
        client = manager.client
        self.manager = manager
        host = host_of(client.self_address or client.node_address, "127.0.0.1")
        self.listener = SecureListener(client.transport.listen(Address(host, 0).url()),
                                       client.identity, client.namespace, client.config)
        self.address = self.listener.address
        self._waiting: list[_Waiter] = []
        self._closing = False
        self.served = 0
        self._thread = threading.Thread(target=self._run, name="pmetal-object-server",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        listener = self.listener
        lease = self.manager.lease
        every = min(lease / 4, 0.25)   # also how soon a borrower known dead goes
        next_lapse = time.monotonic() + every
        try:
            while not self._closing:
                try:
                    incoming = listener.recv(_SLICE if self._waiting else every)
                except PMetalTimeoutError:
                    incoming = None
                except ClosedError:
                    return
                if incoming is not None:
                    try:
                        self._handle(incoming)
                    except Exception as exc:
                        log.error("a %s from %s failed", type(incoming.body).__name__,
                                  incoming.peer[:8], exc_info=exc)
                        self._reply(incoming, Failure(FailureKind.BAD_REQUEST, type(exc).__name__,
                                                      str(exc)))
                if self._waiting:
                    self._serve_waiting()
                now = time.monotonic()
                if now >= next_lapse:
                    next_lapse = now + every
                    for borrower in self.manager.owned.lapse(now, lease):
                        log.info("borrower %s of our ObjectRefs is gone (its process died, "
                                 "or it was silent for %.3g s): its counts are dropped",
                                 borrower[:8], lease)
        finally:
            listener.close()

    def _handle(self, incoming: Incoming) -> None:
        body = incoming.body
        owned = self.manager.owned
        if type(body) is BorrowUpdates:
            owned.apply(incoming.peer, body.borrowers, body.oids, body.who, body.deltas,
                        time.monotonic())
            return
        if type(body) is FetchObject:
            owned.heard(incoming.peer, time.monotonic())
            ref = owned.get(body.oid)
            if ref is None:
                self._reply(incoming, Failure(
                    FailureKind.NOT_FOUND, "ObjectLostError",
                    f"its owner holds no object {body.oid} any more (every reference to it "
                    f"was released, or its borrower's lease lapsed)"))
            elif ref.done():
                self._answer(incoming, ref)
            else:
                self._waiting.append(_Waiter(incoming, ref, time.monotonic() + body.wait))
            return
        self._reply(incoming, Failure(FailureKind.BAD_REQUEST, "ProtocolError",
                                      f"an object server does not handle "
                                      f"{type(body).__name__} messages"))

    def _serve_waiting(self) -> None:
        """Let the pending objects asked for progress for one slice (their
        replies arrive on this client's links), then answer those done."""
        pending = list({id(w.ref): w.ref for w in self._waiting if not w.ref.done()}.values())
        if pending:
            try:
                self.manager.client.wait(pending, 1, _SLICE)
            except PMetalError as exc:   # the client is closing
                log.debug("waiting for objects to serve: %s", exc)
        now = time.monotonic()
        kept = []
        for w in self._waiting:
            if w.ref.done():
                self._answer(w.incoming, w.ref)
            elif now >= w.until:
                self._reply(w.incoming, Failure(FailureKind.TIMEOUT, "GetTimeoutError",
                                                "the object is still pending; ask again"))
            else:
                kept.append(w)
        self._waiting = kept

    def _answer(self, incoming: Incoming, ref: ObjectRef) -> None:
        self.served += 1
        try:
            value = ref.result()
            reply: Any = Result(pack_to(value, incoming.peer))
        except Exception as exc:  # noqa: BLE001 - the object's error, or its value's packing
            reply = Failure(FailureKind.OBJECT, type(exc).__qualname__, str(exc), "",
                            pack_exception(exc))
        self._reply(incoming, reply)

    def _reply(self, incoming: Incoming, body: Any) -> None:
        if not incoming.envelope.corr:
            return
        try:
            try:
                self.listener.reply(incoming, body)
            except (TypeError, ProtocolError) as exc:
                self.listener.reply(incoming, Failure(FailureKind.OBJECT, type(exc).__name__,
                                                      f"the value cannot be sent: {exc}"))
        except (TransportError, PMetalTimeoutError) as exc:
            log.warning("could not answer %s: %s", incoming.peer[:8], exc)

    def close(self) -> None:
        self._closing = True
        self.listener.interrupt()
        self._thread.join(timeout=5.0)
