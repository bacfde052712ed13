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
from typing import TYPE_CHECKING, Any

from pmetal.actors import context
from pmetal.actors.objectnet import ObjectServer, OwnerLink
from pmetal.actors.ownership import (
    PINNED,
    BorrowedObjects,
    OwnedObjects,
    OwnerInfo,
    OwnershipStatistics,
    pack_collecting,
    pack_to,
    packing,
)
from pmetal.actors.refs import ItemRef, ObjectRef
from pmetal.errors import GetTimeoutError, ObjectLostError

if TYPE_CHECKING:
    from pmetal.actors.client import CoreClient

# OwnerInfo and the packing context live in pmetal.actors.ownership and
# are importable from here.
__all__ = ["BorrowedRef", "ObjectManager", "OwnerInfo", "pack_collecting", "pack_to", "packing",
           "reduce_ref"]

log = logging.getLogger(__name__)

_BATCH_DELAY = 0.002   # s queued updates wait for company before they are sent


class BorrowedRef(ObjectRef):
    """An ObjectRef owned by another process, received inside a value. One
    instance per object per process; ``get`` fetches the value from the
    owner (once: the instance keeps it). When it is garbage-collected the
    registrations it received are released to the owner."""

    __slots__ = ("_count", "_manager", "_owner")   # _oid: ObjectRef's slot

    def __init__(self, manager: ObjectManager, oid: int, owner: OwnerInfo, what: str) -> None:
        super().__init__(manager.client, on_death=what)
        self._manager = manager
        self._oid = oid
        self._owner = owner
        self._count = 0   # registrations received; -1 once finalized

    def __del__(self) -> None:
        try:
            self._manager.borrowed.finalized(self)
        except Exception:  # noqa: BLE001, S110 - at interpreter exit anything may be gone
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
        ref = self.borrowed.receive((owner.owner_id, oid), counted, BorrowedRef,
                                    self, oid, known, what)
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

    def prefetch(self, refs: list[ObjectRef]) -> None:
        """Ask the owners of the pending borrowed refs among ``refs`` for
        all of them now (their answers are read by the gets that follow)."""
        pending: dict[str, list[BorrowedRef]] = {}
        for ref in refs:
            if type(ref) is BorrowedRef and not ref.done():
                pending.setdefault(ref._owner.owner_id, []).append(ref)
        for group in pending.values():
            self._link(group[0]._owner).request(group)

    def poll(self, refs: list[BorrowedRef], seconds: float) -> None:
        """Let pending borrowed ``refs`` progress for about ``seconds`` (wait)."""
        self.prefetch(refs[:1000])   # type: ignore[arg-type]
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
