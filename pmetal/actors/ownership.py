"""The bookkeeping of Ray's ownership model: who holds which object.

The process that made an ObjectRef (the caller of the call, or the process
that called ``pmetal.put``) *owns* it: the value lives there. A process that
receives the ref inside a value *borrows* it. These two tables are the pure
part of the protocol (no sockets, no threads of their own; ``now`` is
passed in), driven by :mod:`pmetal.actors.objects`:

* :class:`OwnedObjects`, in an owner: object id -> the ObjectRef and, per
  borrower process, a count of registrations. The sender of a ref knows the
  receiver when it packs it (the worker of the link for call arguments, the
  caller for a return value, the fetcher for a fetched value): an owner that
  sends adds +1 for that receiver here; a borrower that passes the ref on
  sends the owner an AddBorrower (+1 for the receiver) before any Release of
  its own, on one ordered channel. A borrower whose last local instance of
  the ref is garbage-collected sends Release (-n: the n registrations it
  received). An entry holds its ObjectRef (and so the value) while any count
  is not exactly zero: a Release that overtakes its AddBorrower (they come
  from different processes) leaves a negative count until the two meet.
  With every count at zero the entry goes, and the value lives on only as
  long as the owner's own Python references to the ref do.
* :class:`BorrowedObjects`, in a borrower: (owner, object id) -> the one
  live local ObjectRef instance for it and the registrations it received.

Borrowers that die: an owner whose link to a worker dies (the worker's
process exited or is being killed) drops that worker's counts after a short
grace for its last messages (:meth:`OwnedObjects.drop`). Any borrower also renews a lease with each owner
it holds refs of (any message counts; ``actors.borrower_lease``, every quarter
of it). An owner that has heard from a borrower and then hears nothing for a
lease drops that borrower's counts (:meth:`OwnedObjects.lapse`). A registration for a
process the owner has not heard from since (it may wait in a worker's queue
for a long call) is kept: the lapse clock starts at the borrower's first
message after it. Refs pickled outside a pmetal send (no receiver known: a
remote function's closure, which is pickled once and sent to any worker;
an actor's constructor arguments, placed by a node; ``pickle.dumps``) are
registered for :data:`PINNED`, which never releases: they live as long as
their owner, as in Ray. Who receives a value being packed is this thread's
:data:`packing` context (:func:`pack_to`, :func:`pack_collecting`).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from pmetal.actors.serialization import pack_value

__all__ = ["PINNED", "BorrowedObjects", "OwnedObjects", "OwnerInfo", "OwnershipStatistics",
           "pack_collecting", "pack_to", "packing"]

PINNED = "*"
"""The borrower of refs pickled with no receiver known: never released."""

DROP_GRACE = 0.5
"""Seconds a borrower known dead keeps its counts, for its last messages."""


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
    nested: list[Any] | None = None


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


def pack_collecting(pack: Any, *args: Any) -> tuple[Any, list[Any]]:
    """``pack(*args)``, and the refs pickled inside (not registered yet:
    the caller lends them once it knows the receiver)."""
    outer = packing.receiver, packing.nested
    nested: list[Any] = []
    packing.receiver, packing.nested = None, nested
    try:
        return pack(*args), nested
    finally:
        packing.receiver, packing.nested = outer


class _Entry:
    __slots__ = ("counts", "ref")

    def __init__(self, ref: Any) -> None:
        self.ref = ref
        self.counts: dict[str, int] = {}


@dataclass(frozen=True, slots=True)
class OwnershipStatistics:
    owned: int          # objects with borrowers (held for them)
    borrowed: int       # live local instances of refs owned elsewhere
    borrowers: int      # processes with counts here
    freed: int          # entries dropped because every count reached zero
    lapsed: int         # borrowers dropped because their lease lapsed
    stale: int          # updates for objects no longer held (sent by a borrower that
                        # was dropped as dead meanwhile: killed with Releases in flight)


class OwnedObjects:
    """Objects this process owns that other processes borrow (see the
    module docstring). Thread-safe; :attr:`changed` is notified whenever an
    entry goes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self._entries: dict[int, _Entry] = {}
        self._next = itertools.count(1)
        self._held: dict[str, set[int]] = {}     # borrower -> oids it has counts for
        self._heard: dict[str, float] = {}       # borrower -> last message (confirmed ones)
        self._doomed: dict[str, float] = {}      # borrower known dead -> when to drop it
        self.freed = self.lapsed = self.stale = 0

    def oid(self, ref: Any) -> int:
        """``ref``'s object id, the same for as long as ``ref`` lives (kept
        in its ``_oid`` slot, 0 until it is first sent)."""
        oid: int = ref._oid
        if not oid:
            with self._lock:
                oid = ref._oid
                if not oid:
                    oid = ref._oid = next(self._next)
        return oid

    def get(self, oid: int) -> Any:
        """The ObjectRef held for ``oid``, or None."""
        entry = self._entries.get(oid)
        return None if entry is None else entry.ref

    def register(self, refs: Iterable[tuple[Any, int]], receiver: str) -> None:
        """+1 for ``receiver`` on each ``(ref, oid)`` (before the ref is sent)."""
        with self._lock:
            held = self._held.setdefault(receiver, set())
            self._heard.pop(receiver, None)   # its lapse clock starts at its next message
            for ref, oid in refs:
                entry = self._entries.get(oid)
                if entry is None:
                    entry = self._entries[oid] = _Entry(ref)
                self._add(entry, oid, receiver, 1, held)

    def _add(self, entry: _Entry, oid: int, borrower: str, delta: int, held: set[int],
             free: bool = True) -> None:
        count = entry.counts.get(borrower, 0) + delta
        if count:
            entry.counts[borrower] = count
            held.add(oid)
            return
        del entry.counts[borrower]
        held.discard(oid)
        if free and not entry.counts:
            del self._entries[oid]
            self.freed += 1

    def apply(self, sender: str, borrowers: tuple[str, ...], oids: tuple[int, ...],
              who: tuple[int, ...], deltas: tuple[int, ...], now: float) -> None:
        """A borrower's updates (one BorrowUpdates), applied together; they
        also renew ``sender``'s lease. Raises ValueError for a malformed one
        (nothing applied)."""
        if not len(oids) == len(who) == len(deltas):
            raise ValueError(f"BorrowUpdates with {len(oids)} objects, {len(who)} borrower "
                             f"indexes and {len(deltas)} deltas")
        if who and not 0 <= min(who) <= max(who) < len(borrowers):
            raise ValueError(f"BorrowUpdates names borrower {max(who)} of {len(borrowers)}")
        with self._lock:
            self._heard[sender] = now
            helds = [self._held.setdefault(b, set()) for b in borrowers]
            entries = self._entries
            before = len(entries)
            for oid, w, delta in zip(oids, who, deltas):
                entry = entries.get(oid)
                if entry is None:
                    self.stale += 1
                    continue
                self._add(entry, oid, borrowers[w], delta, helds[w], free=False)
            # Freed only once the whole batch is in: a Release and an
            # AddBorrower of one message never free the object between them.
            for oid in oids:
                entry = entries.get(oid)
                if entry is not None and not entry.counts:
                    del entries[oid]
                    self.freed += 1
            for b, held in zip(borrowers, helds):
                if not held:
                    self._held.pop(b, None)
            if len(entries) != before:
                self.changed.notify_all()

    def adjust(self, oid: int, borrower: str, delta: int) -> None:
        """One count changed here (our own ref came back to us)."""
        with self._lock:
            entry = self._entries.get(oid)
            if entry is None:
                self.stale += 1
                return
            self._add(entry, oid, borrower, delta, self._held.setdefault(borrower, set()))
            if not self._held[borrower]:
                del self._held[borrower]
            if oid not in self._entries:
                self.changed.notify_all()

    def heard(self, sender: str, now: float) -> None:
        """A message from ``sender`` (a fetch): it is alive."""
        if sender in self._held:
            with self._lock:
                self._heard[sender] = now

    def lapse(self, now: float, lease: float) -> list[str]:
        """Drop the counts of every borrower silent for ``lease`` since its
        last message, and of those known dead whose grace has passed (see
        :meth:`drop`); the borrowers dropped."""
        with self._lock:
            gone = [b for b, t in self._heard.items() if now - t > lease]
            for b in gone:
                del self._heard[b]
                self._drop(b)
            if gone:
                self.lapsed += len(gone)
            doomed = [b for b, t in self._doomed.items() if now >= t]
            for b in doomed:
                del self._doomed[b]
                self._heard.pop(b, None)
                self._drop(b)
            if gone or doomed:
                self.changed.notify_all()
            return gone + doomed

    def drop(self, borrower: str, now: float, grace: float = DROP_GRACE) -> None:
        """Forget ``borrower``, whose process is known to be gone, ``grace``
        seconds from ``now`` (at a :meth:`lapse` after that): the messages
        it sent before it died, which travel on another connection than the
        news of its death, land first (an AddBorrower for a process it
        passed refs to among them)."""
        with self._lock:
            if borrower in self._held:
                self._doomed.setdefault(borrower, now + grace)

    def _drop(self, borrower: str) -> None:
        for oid in self._held.pop(borrower, ()):
            entry = self._entries.get(oid)
            if (entry is not None and entry.counts.pop(borrower, None) is not None
                    and not entry.counts):
                del self._entries[oid]
                self.freed += 1

    def wait_empty(self, timeout: float, left: int = 0) -> bool:
        """Wait until at most ``left`` objects are held for borrowers."""
        with self.changed:
            return self.changed.wait_for(lambda: len(self._entries) <= left, timeout)

    def held(self, refs: Iterable[Any]) -> int:
        """How many of ``refs`` are held here for borrowers."""
        entries = self._entries
        return sum(1 for r in refs if r._oid in entries and entries[r._oid].ref is r)

    def wait_released(self, refs: Iterable[Any], timeout: float) -> bool:
        """Wait until none of ``refs`` is held for a borrower (tests)."""
        refs = list(refs)
        with self.changed:
            return self.changed.wait_for(lambda: not self.held(refs), timeout)

    def __len__(self) -> int:
        return len(self._entries)

    def borrowers(self) -> int:
        return len(self._held)


class BorrowedObjects:
    """Refs this process borrows: one live instance per (owner, object),
    and the registrations it received (see the module docstring).
    ``release(key, n)`` is called (under no lock of ours) when an instance
    that received ``n`` registrations is garbage-collected, to queue its
    Release."""

    def __init__(self, release: Callable[[tuple[str, int], int], None]) -> None:
        # Re-entrant: a garbage collection that runs while the lock is held
        # (an allocation in receive) may finalize another instance here.
        self._lock = threading.RLock()
        self._refs: dict[tuple[str, int], weakref.ref[Any]] = {}
        self._release = release
        self.live: dict[str, int] = {}   # owner -> live instances of its refs

    def receive(self, key: tuple[str, int], counted: bool, make: Callable[..., Any],
                *args: Any) -> Any:
        """The local instance for ``key`` (``make(*args)`` if there is none),
        with one more registration when ``counted``."""
        with self._lock:
            found = self._refs.get(key)
            ref = found() if found is not None else None
            if ref is None or ref._count < 0:   # none, or one being finalized
                ref = make(*args)
                self._refs[key] = weakref.ref(ref)
                self.live[key[0]] = self.live.get(key[0], 0) + 1
            if counted:
                ref._count += 1
            return ref

    def finalized(self, ref: Any) -> None:
        """``ref`` (an instance made by ``make``) is being garbage-collected."""
        key = (ref._owner.owner_id, ref._oid)
        with self._lock:
            count, ref._count = ref._count, -1
            if count < 0:
                return
            found = self._refs.get(key)
            if found is not None and found() in (None, ref):
                del self._refs[key]
            left = self.live.get(key[0], 1) - 1
            if left > 0:
                self.live[key[0]] = left
            else:
                self.live.pop(key[0], None)
        if count:
            self._release(key, count)

    def owners(self) -> list[str]:
        """The owners we hold live refs of (we renew our lease with them)."""
        with self._lock:
            return list(self.live)

    def __len__(self) -> int:
        return len(self._refs)
