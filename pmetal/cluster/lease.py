"""The node's side of the lease its restartable actors obey.

A node cut off from a quorum of its cluster (a partition, a dropped Wi-Fi
link, a laptop on the wrong side of a switch) may be declared dead by the
others, who restart its restartable actors elsewhere. Its own copies must
have stopped by then, or two copies of one actor run at once. So they run
only within a lease: ``health.dead_after`` times
:data:`pmetal.cluster.view.LEASE_SHARE` past the send time of the last Beat
of this node that a quorum echoed (:func:`pmetal.cluster.view.vouched_since`).
The node renews it at every tick and writes it to its gate
(:mod:`pmetal.cluster.clock`), where the workers read it; it expires by
itself, even if the node is starved or stopped.

A lease that expired has *lapsed*: the others may have held the node dead
meanwhile, so fresh echoes (the partition healed) do not renew it. It stays
expired until the cluster confirms the node is still a member (then the
lease starts again from when the node asked) or the node fences itself
(pmetal.cluster.service). :class:`Lease` is the rule, pure: no I/O, no
clock of its own.
"""

from __future__ import annotations

__all__ = ["Lease"]

_INF = float("inf")


class Lease:
    def __init__(self, length: float) -> None:
        self.length = length
        self.until = _INF      # what the workers obey (inf: no limit)
        self.held = False      # a finite lease was granted since the last confirmation
        self.lapsed = False    # expired; waits for the cluster's word
        self.lapses = 0

    def renew(self, now: float, vouched: float) -> bool:
        """At a tick, with the time since when a quorum has heard this node
        (``inf``: nothing to vouch for; ``-inf``: no quorum yet). False when
        the lease lapsed now: the caller asks the cluster (:meth:`confirmed`
        or a fence ends the lapse)."""
        if self.lapsed:
            return True
        if self.held and now > self.until:
            self.lapsed = True
            self.lapses += 1
            return False
        self.until = vouched + self.length
        if self.until == _INF:
            self.held = False
        elif self.until != -_INF:
            self.held = True
        return True

    def confirmed(self, asked: float, vouched: float = -_INF) -> None:
        """The cluster holds this node a live member, in answer to a
        question sent at ``asked``: whoever answered had not held it dead
        then, so the lease runs from there, or from ``vouched`` (as in
        :meth:`renew`) when a quorum has heard a later Beat. (From ``asked``
        alone, an answer slower than the lease would leave it expired at
        the next tick: it lapsed again at once, round after round.)"""
        self.lapsed = False
        self.held = True
        self.until = max(self.until, max(asked, vouched) + self.length)

    def fenced(self) -> None:
        """The node fenced itself: the actors that obeyed the lease are gone."""
        self.lapsed = False
        self.held = False
