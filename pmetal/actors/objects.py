"""ObjectRefs inside values: owners serve their objects, borrowers fetch
and release them (Ray's ownership model; the counting rules are in
:mod:`pmetal.actors.ownership`).

A ref pickled inside a value (a list argument, actor state, a closure, a
return value) travels as ``(object id, owner's object-server address,
owner id, owner's node id, what it is, counted)``; the receiver rebuilds it
as a :class:`BorrowedRef`, whose ``pmetal.get`` fetches the value from its
owner and keeps it. Top-level ref arguments are still resolved by the caller
before the call is sent, as in Ray.

Per process (driver or worker), one :class:`ObjectManager`, made with the
first ref that is packed or received:

* an object server, started when the process first lends a ref it owns: a
  CURVE-authenticated ROUTER (:class:`~pmetal.endpoint.SecureListener`, the
  namespace's keys, as a worker's) bound on the host its node uses (loopback
  in tests, the namespace's address on a LAN; never 0.0.0.0), served by the
  thread ``pmetal-object-server``. It answers :class:`~pmetal.wire.FetchObject`
  (a pending object: when its call's reply arrives, which that thread waits
  for in slices of the client's lock) and applies
  :class:`~pmetal.wire.BorrowUpdates`; it also lapses borrowers whose lease ran out;
* one channel per owner it borrows from (:class:`OwnerLink`): fetches (the
  caller's thread, under the link's lock) and updates (the thread
  ``pmetal-object-updates``, which batches AddBorrowers and Releases, at most
  a few milliseconds after they are queued, and renews its lease with each
  owner it holds refs of every quarter of ``actors.borrower_lease``).

An owner that died fails ``get`` of its objects with
:class:`~pmetal.errors.OwnerDiedError` as soon as that is known (its address
refuses connections, the connection drops and nothing listens there any
more, its node was declared dead, or another process has its address now),
not at a timeout. pmetal does not rebuild lost objects (no lineage).
"""

from __future__ import annotations

import collections
import copyreg
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import zmq

from pmetal.actors import context
from pmetal.actors.links import listening
from pmetal.actors.ownership import PINNED, BorrowedObjects, OwnedObjects, OwnershipStatistics
from pmetal.actors.refs import ItemRef, ObjectRef
from pmetal.actors.serialization import load_exception, pack_exception, pack_value, unpack_value
from pmetal.channel import Channel, refusal
from pmetal.endpoint import Incoming, SecureListener
from pmetal.errors import (ClosedError, GetTimeoutError, ObjectLostError, OwnerDiedError,
                           PeerError, PMetalError, PMetalTimeoutError, ProtocolError,
                           TransportError)
from pmetal.wire import BorrowUpdates, Failure, FetchObject, Result

if TYPE_CHECKING:
    from pmetal.actors.client import CoreClient

__all__ = ["BorrowedRef", "ObjectManager", "OwnerInfo", "pack_to", "packing", "reduce_ref"]

log = logging.getLogger(__name__)

_SLICE = 0.01          # s a fetch or a pending object's wait holds a lock at a time
_BATCH_DELAY = 0.002   # s queued updates wait for company before they are sent
_BATCH_MAX = 50_000    # updates per BorrowUpdates
_FETCH_WAIT = 10.0     # s an owner holds a fetch of a pending object before "ask again"
_SUSPECT_FOR = 5.0    # s an owner's address is probed after its connection dropped
_PROBE_EVERY = 0.2    # s between two probes
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


class OwnerInfo(NamedTuple):
    """Where a borrowed ref's owner is: its object server's address, its
    process id (its identity's node id) and the node it reached us through."""

    address: str
    owner_id: str
    node_id: str


class _Packing(threading.local):
    """Who receives what is being packed in this thread: ``receiver`` (a
    process id: refs register for it as they are pickled) or ``nested`` (a
    list that collects them, registered once the caller knows the receiver).
    Neither: the ref is pinned (see ownership.PINNED)."""

    receiver: str | None = None
    nested: list[ObjectRef] | None = None


packing = _Packing()


def pack_to(value: Any, receiver: str | None) -> Any:
    """``pack_value(value)`` for process ``receiver``: refs inside are
    registered for it (None: unknown, they are pinned)."""
    outer = packing.receiver, packing.nested
    packing.receiver, packing.nested = receiver, None
    try:
        return pack_value(value)
    finally:
        packing.receiver, packing.nested = outer


def pack_collecting(pack: Any, *args: Any) -> tuple[Any, list[ObjectRef]]:
    """``pack(*args)``, and the refs pickled inside (not registered yet:
    the caller lends them once it knows the receiver)."""
    outer = packing.receiver, packing.nested
    nested: list[ObjectRef] = []
    packing.receiver, packing.nested = None, nested
    try:
        return pack(*args), nested
    finally:
        packing.receiver, packing.nested = outer


class BorrowedRef(ObjectRef):
    """An ObjectRef owned by another process, received inside a value. One
    instance per object per process; ``get`` fetches the value from the
    owner (once: the instance keeps it). When it is garbage-collected the
    registrations it received are released to the owner."""

    __slots__ = ("_count", "_manager", "_oid", "_owner")

    def __init__(self, manager: ObjectManager, oid: int, owner: OwnerInfo, what: str) -> None:
        super().__init__(manager.client, on_death=what)
        self._manager = manager
        self._oid = oid
        self._owner = owner
        self._count = 0   # registrations received; -1 once finalized

    def __del__(self) -> None:
        try:
            self._manager.borrowed.finalized(self)
        except Exception:  # noqa: BLE001 - at interpreter exit anything may be gone
            pass

    def __repr__(self) -> str:
        state = "ready" if self.done() else "pending"
        return f"ObjectRef({state}, owned by {self._owner.owner_id[:8]})"


def reduce_ref(ref: ObjectRef) -> tuple[Any, tuple[Any, ...]]:
    """How ``ref`` pickles (``ObjectRef.__reduce__``), registering it for
    the receiver the packing context names."""
    if type(ref) is BorrowedRef:
        manager = ref._manager
        owner, oid = ref._owner, ref._oid
        what = ref._on_death
    else:
        client = ref._client
        if client is None or client.closed:
            client = context.current()
        manager = client.objects
        owner, oid = manager.owner_info(), manager.owned.oid(ref)
        what = ref._what() or "a pmetal.put object"
    nested = packing.nested
    if nested is not None:
        nested.append(ref)
        counted = True
    else:
        receiver = packing.receiver
        counted = receiver is not None
        manager.lend((ref,), receiver if counted else PINNED)   # type: ignore[arg-type]
    # One OwnerInfo object per owner: pickled once per value (memo), and
    # shared by every ref of that owner the receiver rebuilds.
    return _rebuild, (oid, owner, what, counted)


# Found by the pickler's dispatch table before it looks for __reduce__ (a
# miss there costs more than the rest of pickling a ref).
for _cls in (ObjectRef, ItemRef, BorrowedRef):
    copyreg.pickle(_cls, reduce_ref)


def _rebuild(oid: int, owner: OwnerInfo, what: str, counted: bool) -> ObjectRef:
    return context.current().objects.rebuild(oid, owner, what, counted)


def _died(ref: BorrowedRef, why: str) -> OwnerDiedError:
    owner = ref._owner
    return OwnerDiedError(
        f"{ref._on_death} (object {ref._oid}) is lost: its owner, process "
        f"{owner.owner_id[:8]} at {owner.address}, died ({why}). pmetal keeps an object "
        f"only in the process that made it and does not rebuild lost objects; make the "
        f"value again, or keep its owner alive while others use it")


class ObjectManager:
    """One process's owned and borrowed objects (see the module docstring)."""

    def __init__(self, client: CoreClient) -> None:
        self.client = client
        self.me: str = client.identity.node_id
        self.lease = client.config.actors.borrower_lease
        self.owned = OwnedObjects()
        self.borrowed = BorrowedObjects(self._release)
        # Re-entrant: a finalizer (BorrowedRef.__del__) may run while it is held.
        self._lock = threading.RLock()
        self._server: ObjectServer | None = None
        self._info: OwnerInfo | None = None
        self._links: dict[str, OwnerLink] = {}
        self._owners: dict[str, OwnerInfo] = {}
        # Updates to send, per owner: AddBorrowers (under _queue_lock) and
        # Releases (appended by finalizers, which must take no lock).
        self._queue_lock = threading.RLock()
        self._adds: dict[str, list[tuple[int, str, int]]] = {}
        self._releases: collections.deque[tuple[str, int, int]] = collections.deque()
        self._renewed: dict[str, float] = {}
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._busy = False
        self._closing = threading.Event()
        self._updater: threading.Thread | None = None

    # ------------------------------------------------------------- owning

    def owner_info(self) -> OwnerInfo:
        """This process as an owner; starts its object server on first use."""
        info = self._info
        if info is None:
            with self._lock:
                if self._info is None:
                    self._server = ObjectServer(self)
                    self._info = OwnerInfo(self._server.address, self.me, self.client.node_id)
                info = self._info
        return info

    def lend(self, refs: Any, receiver: str) -> None:
        """Register ``refs`` for ``receiver`` before they are sent to it:
        +1 here for refs we own, an AddBorrower queued to the owner of the
        others (see pmetal.actors.ownership)."""
        owned = []
        adds: dict[str, list[tuple[int, str, int]]] = {}
        for ref in refs:
            if type(ref) is BorrowedRef:
                adds.setdefault(ref._owner.owner_id, []).append((ref._oid, receiver, 1))
            else:
                owned.append((ref, self.owned.oid(ref)))
        if owned:
            self.owner_info()
            self.owned.register(owned, receiver)
        if adds:
            with self._queue_lock:
                for owner_id, items in adds.items():
                    self._adds.setdefault(owner_id, []).extend(items)
            self._poke()

    # ----------------------------------------------------------- borrowing

    def rebuild(self, oid: int, owner: OwnerInfo, what: str, counted: bool) -> ObjectRef:
        """The local ref for a ref received inside a value (unpickling)."""
        if owner.owner_id == self.me:
            # Our own object came back: the original ref, which holds the
            # value. Its registration for us is undone at once.
            ref = self.owned.get(oid)
            if ref is None:
                return ObjectRef.of_error(ObjectLostError(
                    f"{what} (object {oid}) came back to its owner, which no longer "
                    f"holds it"))
            if counted:
                self.owned.adjust(oid, self.me, -1)
            return ref
        known = self._owners.get(owner.owner_id)
        if known is not owner and known != owner:
            known = self._owners[owner.owner_id] = owner
        elif known is not owner:   # the same owner, another copy: share ours
            owner = known
        first = owner.owner_id not in self.borrowed.live
        ref = self.borrowed.receive((owner.owner_id, oid), counted,
                                    lambda: BorrowedRef(self, oid, known, what))
        if first:
            self._poke()   # tell the owner we hold its refs (our lease starts)
        return ref

    def _release(self, key: tuple[str, int], count: int) -> None:
        """A borrowed instance that received ``count`` registrations was
        garbage-collected: queue its Release (no lock: finalizer context)."""
        self._releases.append((key[0], key[1], count))
        if not self._wake.is_set():
            self._wake.set()
        if self._updater is None:
            self._start_updater()

    def fetch(self, ref: BorrowedRef, deadline: float | None, timeout: float | None) -> None:
        """Wait until ``ref`` has its value from its owner (or an error)."""
        self._link(ref._owner).fetch(ref, deadline, timeout)

    def poll(self, refs: list[BorrowedRef], seconds: float) -> None:
        """Let pending borrowed ``refs`` progress for about ``seconds`` (wait)."""
        first = refs[0]
        try:
            self.fetch(first, time.monotonic() + seconds, seconds)
        except GetTimeoutError:
            pass
        for ref in refs[1:]:
            if not ref.done():
                try:
                    self.fetch(ref, time.monotonic(), 0.0)
                except GetTimeoutError:
                    pass

    def _link(self, owner: OwnerInfo) -> OwnerLink:
        with self._lock:
            link = self._links.get(owner.owner_id)
            if link is None or link.owner != owner:
                if link is not None:
                    link.close()
                link = self._links[owner.owner_id] = OwnerLink(self, owner)
            return link

    # ------------------------------------------------------------- updates

    def _poke(self) -> None:
        if self._updater is None:
            self._start_updater()
        self._wake.set()

    def _start_updater(self) -> None:
        with self._lock:
            if self._updater is None and not self._closing.is_set():
                self._updater = threading.Thread(target=self._run_updates,
                                                 name="pmetal-object-updates", daemon=True)
                self._updater.start()

    def _run_updates(self) -> None:
        while not self._closing.is_set():
            self._wake.wait(self.lease / 8)
            if self._closing.wait(_BATCH_DELAY):
                break
            self._wake.clear()
            try:
                self._send_updates()
            except Exception:  # never let the updater die: releases would pile up
                log.exception("sending ObjectRef borrower updates failed; retrying")
        self._send_updates()   # the last releases, at shutdown

    def _send_updates(self) -> None:
        with self._idle:
            self._busy = True
        try:
            # Releases first, then adds (see ownership: an AddBorrower queued
            # before a Release is never sent after it).
            releases: dict[str, list[tuple[int, str, int]]] = {}
            while self._releases:
                owner_id, oid, count = self._releases.popleft()
                releases.setdefault(owner_id, []).append((oid, self.me, -count))
            with self._queue_lock:
                adds, self._adds = self._adds, {}
            now = time.monotonic()
            owners = set(adds) | set(releases)
            owners |= {o for o in self.borrowed.owners()
                       if now - self._renewed.get(o, 0.0) > self.lease / 4}
            for owner_id in owners:
                owner = self._owners.get(owner_id)
                if owner is None:
                    continue
                items = adds.get(owner_id, []) + releases.get(owner_id, [])
                self._renewed[owner_id] = now
                self._link(owner).send_updates(items)
        finally:
            with self._idle:
                self._busy = False
                self._idle.notify_all()

    def settled(self, timeout: float) -> bool:
        """Wait until every queued update has been sent (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._busy or self._releases or self._adds:
                self._poke()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(min(remaining, 0.05))
        return True

    # ------------------------------------------------------------ the rest

    def statistics(self) -> OwnershipStatistics:
        owned = self.owned
        return OwnershipStatistics(len(owned), len(self.borrowed), owned.borrowers(),
                                   owned.freed, owned.lapsed, owned.stale)

    def close(self) -> None:
        """Send the last releases, stop the threads, close the sockets (our
        borrowers' fetches fail with OwnerDiedError from now on)."""
        self._closing.set()
        self._wake.set()
        if self._updater is not None:
            self._updater.join(timeout=5.0)
        if self._server is not None:
            self._server.close()
        with self._lock:
            for link in self._links.values():
                link.close()
            self._links.clear()


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
                corr = channel.submit(FetchObject(ref._oid, wait),
                                      timeout=self.manager.client.config.transport.send_timeout)
                self._fetching[ref._oid] = (corr, ref)
                self._oids[corr] = ref._oid
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
                ref._error = PeerError(f"{ref._on_death}: cannot fetch it from its owner "
                                       f"at {self.owner.address}: {exc}")

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
                except Exception as exc:  # the value arrived but cannot be unpickled here
                    ref._error = exc
            elif isinstance(body, Failure):
                if body.kind == "timeout":
                    continue   # still pending at the owner: ask again
                if body.kind == "object":
                    ref._error = (load_exception(body.exception)
                                  or PMetalError(f"{body.error_type}: {body.message}"))
                elif body.kind == "not_found":
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
            if self.channel is not None:
                self.channel.close()
                self.channel = None


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
        host = (client.self_address or client.node_address).partition("://")[2].rpartition(":")[0]
        self.listener = SecureListener(client.transport.listen(f"tcp://{host or '127.0.0.1'}:0"),
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
        next_lapse = time.monotonic() + lease / 4
        try:
            while not self._closing:
                try:
                    incoming = listener.recv(_SLICE if self._waiting else min(1.0, lease / 4))
                except PMetalTimeoutError:
                    incoming = None
                except ClosedError:
                    return
                if incoming is not None:
                    try:
                        self._handle(incoming)
                    except Exception as exc:  # noqa: BLE001 - no request may end the server
                        log.error("a %s from %s failed", type(incoming.body).__name__,
                                  incoming.peer[:8], exc_info=exc)
                        self._reply(incoming, Failure("bad_request", type(exc).__name__,
                                                      str(exc)))
                if self._waiting:
                    self._serve_waiting()
                now = time.monotonic()
                if now >= next_lapse:
                    next_lapse = now + lease / 4
                    for borrower in self.manager.owned.lapse(now, lease):
                        log.info("borrower %s of our ObjectRefs was silent for %.3g s: its "
                                 "counts are dropped", borrower[:8], lease)
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
                    "not_found", "ObjectLostError",
                    f"its owner holds no object {body.oid} any more (every reference to it "
                    f"was released, or its borrower's lease lapsed)"))
            elif ref.done():
                self._answer(incoming, ref)
            else:
                self._waiting.append(_Waiter(incoming, ref, time.monotonic() + body.wait))
            return
        self._reply(incoming, Failure("bad_request", "ProtocolError",
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
                self._reply(w.incoming, Failure("timeout", "GetTimeoutError",
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
            reply = Failure("object", type(exc).__qualname__, str(exc), "",
                            pack_exception(exc))
        self._reply(incoming, reply)

    def _reply(self, incoming: Incoming, body: Any) -> None:
        if not incoming.envelope.corr:
            return
        try:
            try:
                self.listener.reply(incoming, body)
            except (TypeError, ProtocolError) as exc:
                self.listener.reply(incoming, Failure("object", type(exc).__name__,
                                                      f"the value cannot be sent: {exc}"))
        except (TransportError, PMetalTimeoutError) as exc:
            log.warning("could not answer %s: %s", incoming.peer[:8], exc)

    def close(self) -> None:
        self._closing = True
        self.listener.interrupt()
        self._thread.join(timeout=5.0)
