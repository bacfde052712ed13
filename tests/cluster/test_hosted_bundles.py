"""What a node holds for placement groups (pmetal.node.hosted): all or
none, releases by attempt, a release that overtakes its reserve, and the
pool an actor in a bundle takes from. The node's actors are a stand-in
with a real PlacementQueue (the free pool the bundles come out of)."""

from __future__ import annotations

from types import SimpleNamespace

from pmetal.node.hosted import HostedBundles
from pmetal.node.placement import PlacementQueue
from pmetal.wire import Ack, Failure, ReserveBundles

ONE = {"CPU": 1.0}


def host(cpus: float = 4.0) -> tuple[HostedBundles, dict[str, float], list[int]]:
    available = {"CPU": cpus}
    actors = SimpleNamespace(available=available, queue=PlacementQueue(available), actors={},
                             kill_record=lambda *a: None)
    kicks: list[int] = []
    return HostedBundles("n" * 32, actors, lambda: kicks.append(1)), available, kicks


def reserve(h: HostedBundles, attempt: int, *indexes: int, group: str = "g") -> object:
    return h.reserve(ReserveBundles(group, attempt, [[i, ONE] for i in indexes]))


def release(h: HostedBundles, attempt: int, *indexes: int, group: str = "g") -> object:
    return h.reserve(ReserveBundles(group, attempt, [[i, {}] for i in indexes], True))


def test_a_share_is_held_all_or_none() -> None:
    h, available, _ = host(cpus=2.0)
    refused = reserve(h, 1, 0, 1, 2)
    assert isinstance(refused, Failure) and "cannot hold CPU 3" in refused.message
    assert available == {"CPU": 2.0} and not h.held
    assert reserve(h, 2, 0, 1) == Ack(2) and available == {"CPU": 0.0}
    assert reserve(h, 2, 0, 1) == Ack(0)   # asked twice: held once


def test_a_rollback_releases_its_own_attempt_only() -> None:
    h, available, kicks = host()
    assert reserve(h, 1, 0, 1) == Ack(2)
    assert reserve(h, 2, 2) == Ack(1)          # bundle 2 placed again by attempt 2
    assert release(h, 2, 0, 1, 2) == Ack(1)    # rolling back attempt 2: bundles 0, 1 stay
    assert sorted(i for _, i in h.held) == [0, 1] and available == {"CPU": 2.0}
    assert kicks == [1]                        # resources came back: pending groups retry
    assert release(h, 2) == Ack(2) and available == {"CPU": 4.0}   # removal: all up to 2


def test_a_release_that_overtakes_its_reserve_leaves_nothing_held() -> None:
    h, available, _ = host()
    assert release(h, 3, 0) == Ack(0)
    late = reserve(h, 3, 0)
    assert isinstance(late, Failure) and "released already" in late.message
    assert reserve(h, 4, 0) == Ack(1) and available == {"CPU": 3.0}


def test_an_actor_takes_its_resources_from_its_bundle() -> None:
    h, available, _ = host()
    reserve(h, 1, 0, 1)
    queue, total = h.bundle_for({"placement_group": "g", "bundle_index": 1}, ONE)
    assert total == ONE and queue.available == ONE and available == {"CPU": 2.0}
    too_big = h.bundle_for({"placement_group": "g", "bundle_index": 1}, {"CPU": 2.0})
    assert isinstance(too_big, Failure) and "more than bundle 1" in too_big.message
    missing = h.bundle_for({"placement_group": "g", "bundle_index": 5}, ONE)
    assert isinstance(missing, Failure) and "not held on node" in missing.message
