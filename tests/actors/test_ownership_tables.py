"""The counting rules of Ray's ownership model (pmetal.actors.ownership),
driven directly: registrations, AddBorrower and Release in every order,
leases, pinning, and the borrower's one instance per object."""

from __future__ import annotations

import gc
import itertools

import pytest

from pmetal.actors.ownership import PINNED, BorrowedObjects, OwnedObjects


class Ref:
    """Stands in for an ObjectRef: the tables read only ``_oid``."""

    def __init__(self) -> None:
        self._oid = 0


def updates(owned: OwnedObjects, sender: str, *items: tuple[int, str, int],
            now: float = 0.0) -> None:
    names: dict[str, int] = {}
    who = tuple(names.setdefault(b, len(names)) for _, b, _ in items)
    owned.apply(sender, tuple(names), tuple(o for o, _, _ in items), who,
                tuple(d for _, _, d in items), now)


def test_an_object_lives_while_a_borrower_holds_it() -> None:
    owned = OwnedObjects()
    ref = Ref()
    oid = owned.oid(ref)
    assert owned.oid(ref) == oid and owned.oid(Ref()) != oid
    owned.register([(ref, oid)], "A")
    assert owned.get(oid) is ref
    updates(owned, "A", (oid, "A", -1))
    assert owned.get(oid) is None and len(owned) == 0 and owned.freed == 1


# B sends its Release after its AddBorrower, on one channel: every order
# of the three messages that keeps that.
ORDERS = [o for o in itertools.permutations(["add", "release_c", "release_b"])
          if o.index("add") < o.index("release_b")]


@pytest.mark.parametrize("order", ORDERS)
def test_add_borrower_and_releases_in_any_order_free_once_all_met(order: tuple) -> None:
    # The owner lent to B; B passed it to C (AddBorrower for C, then B's own
    # Release on the same channel); C let go. C's Release may come first.
    owned = OwnedObjects()
    ref = Ref()
    oid = owned.oid(ref)
    owned.register([(ref, oid)], "B")
    steps = {"add": ("B", (oid, "C", 1)), "release_c": ("C", (oid, "C", -1)),
             "release_b": ("B", (oid, "B", -1))}
    for i, step in enumerate(order):
        sender, item = steps[step]
        updates(owned, sender, item)
        assert (owned.get(oid) is None) == (i == 2), (order, step)


def test_one_batch_is_applied_together() -> None:
    owned = OwnedObjects()
    ref = Ref()
    oid = owned.oid(ref)
    owned.register([(ref, oid)], "B")
    # A release of B and its AddBorrower for C in one message: held for C.
    updates(owned, "B", (oid, "B", -1), (oid, "C", 1))
    assert owned.get(oid) is ref
    updates(owned, "C", (oid, "C", -1))
    assert owned.get(oid) is None


def test_a_malformed_batch_changes_nothing() -> None:
    owned = OwnedObjects()
    ref = Ref()
    oid = owned.oid(ref)
    owned.register([(ref, oid)], "B")
    with pytest.raises(ValueError, match="borrower indexes"):
        owned.apply("B", ("B",), (oid,), (), (-1,), 0.0)
    with pytest.raises(ValueError, match="borrower 3"):
        owned.apply("B", ("B",), (oid,), (3,), (-1,), 0.0)
    assert owned.get(oid) is ref


def test_updates_for_objects_gone_are_counted_stale() -> None:
    owned = OwnedObjects()
    updates(owned, "B", (99, "B", -1))
    assert owned.stale == 1 and len(owned) == 0


def test_pinned_refs_are_never_freed() -> None:
    owned = OwnedObjects()
    ref = Ref()
    oid = owned.oid(ref)
    owned.register([(ref, oid)], PINNED)
    owned.register([(ref, oid)], "A")
    updates(owned, "A", (oid, "A", -1))
    assert owned.get(oid) is ref
    assert owned.lapse(1e9, 1.0) == ["A"]   # heard once (its Release), then silent
    assert owned.get(oid) is ref


def test_a_silent_borrower_lapses_only_after_it_was_heard() -> None:
    owned = OwnedObjects()
    ref = Ref()
    oid = owned.oid(ref)
    owned.register([(ref, oid)], "A")
    # Never heard from since the registration (its call may wait in a
    # queue): it does not lapse, however long.
    assert owned.lapse(1000.0, 1.0) == []
    updates(owned, "A", now=10.0)   # a renewal
    assert owned.lapse(10.5, 1.0) == []
    assert owned.lapse(11.5, 1.0) == ["A"]
    assert owned.get(oid) is None and owned.lapsed == 1
    # A new registration for it restarts the rule: not heard since, kept.
    owned.register([(ref, oid)], "A")
    assert owned.lapse(100.0, 1.0) == []
    assert owned.wait_empty(0.0) is False


def test_our_own_ref_coming_back_undoes_its_registration() -> None:
    owned = OwnedObjects()
    ref = Ref()
    oid = owned.oid(ref)
    owned.register([(ref, oid)], "B")
    updates(owned, "B", (oid, "me", 1))   # B returned it to us
    owned.adjust(oid, "me", -1)          # ... and we rebuilt it
    updates(owned, "B", (oid, "B", -1))
    assert owned.get(oid) is None


class Instance:
    def __init__(self, table: BorrowedObjects, key: tuple[str, int]) -> None:
        self._table = table
        self._owner = type("Owner", (), {"owner_id": key[0]})()
        self._oid = key[1]
        self._count = 0

    def __del__(self) -> None:
        self._table.finalized(self)


def test_a_borrower_has_one_instance_per_object_and_releases_what_it_received() -> None:
    released: list[tuple[tuple[str, int], int]] = []
    table = BorrowedObjects(lambda key, n: released.append((key, n)))

    def receive(key: tuple[str, int], counted: bool = True) -> Instance:
        return table.receive(key, counted, Instance, table, key)

    a = receive(("O", 1))
    assert receive(("O", 1)) is a and receive(("O", 1), counted=False) is a
    b = receive(("P", 1))
    assert table.owners() == ["O", "P"] and len(table) == 2
    del a
    gc.collect()
    assert released == [(("O", 1), 2)] and table.owners() == ["P"]
    # Received again after it went: a new instance, counted afresh.
    c = receive(("O", 1), counted=False)
    del b, c
    gc.collect()
    assert released == [(("O", 1), 2), (("P", 1), 1)] and len(table) == 0


def test_a_borrower_known_dead_goes_after_a_grace_for_its_last_messages() -> None:
    owned = OwnedObjects()
    ref = Ref()
    oid = owned.oid(ref)
    owned.register([(ref, oid)], "B")
    owned.drop("B", now=10.0, grace=0.5)
    # Its AddBorrower for C, sent before it died, lands within the grace.
    updates(owned, "B", (oid, "C", 1), now=10.1)
    assert owned.lapse(10.4, 30.0) == [] and owned.get(oid) is ref
    assert owned.lapse(10.6, 30.0) == ["B"]
    assert owned.get(oid) is ref   # held for C
    updates(owned, "C", (oid, "C", -1), now=11.0)
    assert owned.get(oid) is None
    owned.drop("nobody", now=0.0)   # a process we lent nothing: nothing to do
    assert "nobody" not in owned.lapse(100.0, 30.0)
