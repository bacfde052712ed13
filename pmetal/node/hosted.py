"""The bundles of placement groups a node holds (the *host* role of
:mod:`pmetal.node.groups`).

A held bundle's resources leave the node's free pool (the
:class:`~pmetal.node.placement.PlacementQueue` of its actors) and become a
pool of its own, from which the actors placed in that bundle take theirs,
waiting in the bundle's queue when it is full. A reserve takes a group's
whole share at once or refuses it (:class:`~pmetal.wire.ReserveBundles`);
a release gives bundles back and ends the actors placed in them. Releases
carry the attempt they end; the newest released attempt of each group is
remembered (:data:`TOMBSTONES` groups at most), and a reserve of an attempt
released already is refused, so a release that overtakes its reserve
leaves nothing held.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pmetal.node.placement import PlacementQueue, check_resources, fits, resources_text
from pmetal.values import ActorState, FailureKind
from pmetal.wire import Ack, Failure, Message, ReserveBundles

if TYPE_CHECKING:
    from pmetal.node.lifecycle import ActorLifecycle

__all__ = ["HeldBundle", "HostedBundles", "TOMBSTONES"]

log = logging.getLogger(__name__)

TOMBSTONES = 4096
"""Groups whose newest released attempt a node remembers."""


@dataclass(eq=False)
class HeldBundle:
    """A bundle this node holds for a group; its actors take from ``queue``."""

    group_id: str
    index: int
    resources: dict[str, float]
    attempt: int
    owner_node: str
    queue: PlacementQueue


class HostedBundles:
    """The bundles one node holds, by (group id, index)."""

    def __init__(self, node_id: str, actors: ActorLifecycle,
                 on_release: Callable[[], None]) -> None:
        self.node_id = node_id
        self.actors = actors
        self._on_release = on_release   # resources came back: pending groups may fit now
        self.held: dict[tuple[str, int], HeldBundle] = {}
        self._released: OrderedDict[str, int] = OrderedDict()   # group -> newest attempt

    def reserve(self, body: ReserveBundles) -> Message:
        """Hold (or release) bundles of a group here: all or none."""
        released = self._released.get(body.group_id, -1)
        if body.release:
            self._released[body.group_id] = max(released, body.attempt)
            self._released.move_to_end(body.group_id)
            while len(self._released) > TOMBSTONES:
                self._released.popitem(last=False)
            # Listed bundles: those of this attempt only (a rolled-back
            # attempt); none listed: every bundle of the group up to it.
            indexes = {int(i) for i, _ in body.bundles} if body.bundles else None
            freed = self.release(lambda b: b.group_id == body.group_id and (
                b.attempt <= body.attempt if indexes is None
                else b.attempt == body.attempt and b.index in indexes),
                f"its placement group {body.group_id} was removed")
            return Ack(freed)
        if body.attempt <= released:
            return Failure(FailureKind.PLACEMENT, "PlacementError",
                           f"placement group {body.group_id}: attempt {body.attempt} was "
                           f"released already")
        share = []
        for pair in body.bundles:
            if (not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) is not int
                    or pair[0] < 0):
                raise ValueError(f"ReserveBundles: bundles must be [[index, resources], ...], "
                                 f"not {pair!r:.60}")
            share.append((pair[0], check_resources(pair[1], "ReserveBundles")))
        share = [(i, r) for i, r in share if (body.group_id, i) not in self.held]
        need: dict[str, float] = {}
        for _, resources in share:
            for k, v in resources.items():
                need[k] = need.get(k, 0.0) + v
        if not fits(need, self.actors.available):
            return Failure(FailureKind.PLACEMENT, "PlacementError",
                           f"node {self.node_id[:8]} cannot hold {resources_text(need)} for "
                           f"placement group {body.group_id}: it has "
                           f"{resources_text(self.actors.available)} free")
        self.actors.queue.take(need)
        for index, resources in share:
            self.held[(body.group_id, index)] = HeldBundle(
                body.group_id, index, resources, body.attempt, body.owner_node,
                PlacementQueue(dict(resources)))
        return Ack(len(share))

    def release(self, which: Callable[[HeldBundle], bool], why: str) -> int:
        """Give back the bundles ``which`` picks; their actors end (``why``)."""
        bundles = [b for b in self.held.values() if which(b)]
        for bundle in bundles:
            del self.held[(bundle.group_id, bundle.index)]
            for record in list(self.actors.actors.values()):
                if record.pool is bundle.queue and record.state != ActorState.DEAD:
                    self.actors.kill_record(record, True, why)
            self.actors.queue.give(bundle.resources)
        if bundles:
            self._on_release()
        return len(bundles)

    def bundle_for(self, options: dict[str, Any],
                   need: dict[str, float]) -> tuple[PlacementQueue, dict[str, float]] | Failure:
        """The pool an actor placed in a bundle takes its resources from."""
        group_id = str(options.get("placement_group"))
        index = options.get("bundle_index")
        bundle = self.held.get((group_id, index)) if type(index) is int else None
        if bundle is None:
            return Failure(FailureKind.PLACEMENT, "PlacementError",
                           f"bundle {index} of placement group {group_id} is not held on node "
                           f"{self.node_id[:8]} (the group was removed, or its node died)")
        if not fits(need, bundle.resources):
            return Failure(FailureKind.PLACEMENT, "PlacementError",
                           f"the actor needs {resources_text(need)}, more than bundle {index} of "
                           f"placement group {group_id} holds ({resources_text(bundle.resources)})")
        return bundle.queue, bundle.resources
