"""The failure detector: how long each peer has been silent, and what that means.

Pure logic, no I/O and no clock of its own: every input carries ``now``
(seconds on one monotonic clock, the caller's), so tests drive it with a
fake clock and the node's health shell drives it with ``time.monotonic()``.

What it owns: one record per watched peer (when it was last heard, its
recent round-trip times, its status). What changes it: :meth:`watch` and
:meth:`forget` (the shell, as members come and go), :meth:`heard` (any
message from the peer; a ``BeatEcho`` also gives a round-trip time) and
:meth:`tick` (the shell, every ``health.interval``). What a caller gets:
the :class:`HealthEvent` of every status change, returned by the call
that caused it and passed to every subscriber.

The contract is the fixed thresholds of :class:`~pmetal.config.HealthConfig`:
a peer silent for ``degraded_after`` seconds is Degraded, for
``suspect_after`` Suspect, for ``dead_after`` Dead, exactly (a silence equal
to the threshold crosses it). Status is a monotone function of silence, so
"Dead within ``dead_after`` of its last message, given a tick by then"
holds by construction. There is no phi-accrual adaptivity on purpose: it
would make that guarantee depend on the peer's history.
In addition, a peer that is heard but whose recent round trips are far
slower than its own baseline (the median of the last ``_RTT_WINDOW`` above
``_RTT_FACTOR`` times the smallest ever seen and above ``_RTT_FLOOR``) is
Degraded: alive, but a poor choice for a ring or a new actor.

A Dead peer heard again becomes Healthy, with an event; what a return
means (a new incarnation, fencing) is for the shell to decide. A tick that
comes late may skip states (Healthy straight to Dead): one event per
change, never a replay of the states in between. Forgetting a peer emits
nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import statistics as stats
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pmetal.config import HealthConfig
from pmetal.errors import PMetalValueError

__all__ = ["HealthEvent", "HealthMonitor", "HealthStatistics", "HealthStatus", "HealthSummary"]

log = logging.getLogger(__name__)

# Silences are differences of large clock readings; a nanosecond of slack
# keeps "silent for exactly dead_after is Dead" true in floating point.
_SLACK = 1e-9
_RTT_WINDOW = 20       # recent round trips kept per peer
_RTT_MIN_SAMPLES = 5   # fewer recent samples say nothing about a slow link
_RTT_FACTOR = 4.0      # median this many times the baseline ...
_RTT_FLOOR = 0.05      # ... and above this many seconds: Degraded


class HealthStatus(enum.Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    SUSPECT = "suspect"
    DEAD = "dead"

    @property
    def severity(self) -> int:
        """0 for Healthy up to 3 for Dead: worse is larger."""
        return _SEVERITY[self.value]


_SEVERITY = {"healthy": 0, "degraded": 1, "suspect": 2, "dead": 3}


@dataclass(frozen=True)
class HealthEvent:
    node_id: str
    previous: HealthStatus
    status: HealthStatus
    at: float           # the ``now`` of the call that saw the change
    silent_for: float   # seconds since the peer was last heard, at ``at``; when
                        # heard again, the length of the silence that just ended


@dataclass(frozen=True)
class HealthSummary:
    node_id: str
    status: HealthStatus
    silent_for: float
    rtt: float | None       # median of the recent round trips, s
    rtt_p90: float | None
    beats: int              # messages heard (watching counts as none)
    missed: int             # beats expected but not heard (estimated from gaps)
    since: float            # when the status last changed

    def to_dict(self) -> dict[str, Any]:
        """For ``pmetal status --json``: the status as its string."""
        return {**dataclasses.asdict(self), "status": self.status.value}


@dataclass(frozen=True, slots=True)
class HealthStatistics:
    watched: int
    healthy: int
    degraded: int
    suspect: int
    dead: int
    heard: int              # messages heard, all peers, since start
    events: int             # status changes
    deaths: int             # changes to Dead
    returns: int            # Dead peers heard again
    subscriber_errors: int


@dataclass
class _Peer:
    last: float
    since: float
    status: HealthStatus = HealthStatus.HEALTHY
    beats: int = 0
    missed: int = 0
    rtts: deque[float] = field(default_factory=lambda: deque(maxlen=_RTT_WINDOW))
    rtt_min: float | None = None


class HealthMonitor:
    """The failure detector of one node. Its shell calls :meth:`watch` when
    a peer becomes a member (never for itself), :meth:`heard` for every
    message a peer sends (with ``rtt=now - echo.sent`` for a ``BeatEcho``
    answering its own ``Beat``), :meth:`tick` every ``config.interval``, and
    :meth:`forget` when the member list drops a peer."""

    def __init__(self, config: HealthConfig, now: float) -> None:
        self.config = config
        self._now = now
        self._peers: dict[str, _Peer] = {}
        self._subscribers: list[Callable[[HealthEvent], None]] = []
        self._counts = {"heard": 0, "events": 0, "deaths": 0, "returns": 0, "errors": 0}

    # ------------------------------------------------------------ inputs

    def watch(self, node_id: str, now: float) -> None:
        """Start tracking ``node_id``, as if heard at ``now``. Watching a peer
        already watched changes nothing (a repeated announcement must not
        hide a silence); for a new incarnation, :meth:`forget` it first."""
        self._advance(now)
        if node_id not in self._peers:
            self._peers[node_id] = _Peer(last=now, since=now)

    def forget(self, node_id: str) -> None:
        self._peers.pop(node_id, None)

    def heard(self, node_id: str, now: float, rtt: float | None = None) -> list[HealthEvent]:
        """Any message from ``node_id`` arrived at ``now``; ``rtt`` is the
        round trip a ``BeatEcho`` measured. Peers not watched are ignored
        (a stray message from a forgotten peer must not bring it back)."""
        self._advance(now)
        peer = self._peers.get(node_id)
        if peer is None:
            log.debug("message from %s, which health does not watch: ignored", node_id)
            return []
        self._counts["heard"] += 1
        peer.beats += 1
        gap = max(0.0, now - peer.last)
        if now > peer.last:
            peer.missed += self._missed(now - peer.last)
            peer.last = now
        if rtt is not None and rtt >= 0:
            peer.rtts.append(rtt)
            peer.rtt_min = rtt if peer.rtt_min is None else min(peer.rtt_min, rtt)
        event = self._update(node_id, peer, now)
        return self._deliver([dataclasses.replace(event, silent_for=gap)] if event else [])

    def paused(self, gap: float) -> None:
        """This node did not run for ``gap`` seconds (slept, starved,
        stopped): the silence of its peers over that time is its own, not
        theirs, so it is not held against them (a node that wakes must not
        declare every other node dead). Peers already Dead stay Dead."""
        for peer in self._peers.values():
            if peer.status is not HealthStatus.DEAD:
                peer.last += gap

    def tick(self, now: float) -> list[HealthEvent]:
        """Re-judge every peer's silence at ``now`` (call every interval)."""
        self._advance(now)
        events = [e for n, p in sorted(self._peers.items()) if (e := self._update(n, p, now))]
        return self._deliver(events)

    def subscribe(self, callback: Callable[[HealthEvent], None]) -> Callable[[], None]:
        """Call ``callback`` with every event; returns the unsubscribe."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)
        return unsubscribe

    # ----------------------------------------------------------- queries

    def status(self, node_id: str) -> HealthStatus:
        return self._peer(node_id).status

    def dead(self) -> set[str]:
        return {n for n, p in self._peers.items() if p.status is HealthStatus.DEAD}

    def removable(self, now: float | None = None) -> list[str]:
        """Peers silent for ``remove_after`` or longer: the master drops
        them from the member list (they rejoin as new incarnations)."""
        now = self._now if now is None else now
        return sorted(n for n, p in self._peers.items()
                      if now - p.last + _SLACK >= self.config.remove_after)

    def __contains__(self, node_id: object) -> bool:
        """Whether ``node_id`` is watched (no sorted copy: asked per message)."""
        return node_id in self._peers

    def watched(self) -> list[str]:
        return sorted(self._peers)

    def summary(self, now: float | None = None) -> list[HealthSummary]:
        """Every watched peer, by node id; silence is measured at ``now``
        (default: the latest time any input carried)."""
        now = self._now if now is None else now
        out = []
        for node_id, p in sorted(self._peers.items()):
            silent = max(0.0, now - p.last)
            rtts = sorted(p.rtts)
            out.append(HealthSummary(
                node_id, p.status, silent,
                stats.median(rtts) if rtts else None,
                rtts[min(len(rtts) - 1, int(0.9 * len(rtts)))] if rtts else None,
                p.beats, p.missed + self._missed(silent), p.since))
        return out

    def statistics(self) -> HealthStatistics:
        by = {s: 0 for s in HealthStatus}
        for p in self._peers.values():
            by[p.status] += 1
        c = self._counts
        return HealthStatistics(len(self._peers), by[HealthStatus.HEALTHY],
                                by[HealthStatus.DEGRADED], by[HealthStatus.SUSPECT],
                                by[HealthStatus.DEAD], c["heard"], c["events"], c["deaths"],
                                c["returns"], c["errors"])

    # ---------------------------------------------------------- internals

    def _peer(self, node_id: str) -> _Peer:
        try:
            return self._peers[node_id]
        except KeyError:
            raise PMetalValueError(f"health does not watch node {node_id!r}; call "
                                   "watch() when it becomes a member") from None

    def _missed(self, gap: float) -> int:
        # Half an interval of tolerance: jitter is not a missed beat.
        return max(0, int(gap / self.config.interval - 0.5))

    def _advance(self, now: float) -> None:
        self._now = max(self._now, now)

    def _judge(self, peer: _Peer, silent: float) -> HealthStatus:
        c = self.config
        silent += _SLACK
        if silent >= c.dead_after:
            return HealthStatus.DEAD
        if silent >= c.suspect_after:
            return HealthStatus.SUSPECT
        if silent >= c.degraded_after or self._slow(peer):
            return HealthStatus.DEGRADED
        return HealthStatus.HEALTHY

    @staticmethod
    def _slow(peer: _Peer) -> bool:
        if len(peer.rtts) < _RTT_MIN_SAMPLES or peer.rtt_min is None:
            return False
        recent = stats.median(peer.rtts)
        return recent > _RTT_FACTOR * peer.rtt_min and recent > _RTT_FLOOR

    def _update(self, node_id: str, peer: _Peer, now: float) -> HealthEvent | None:
        silent = max(0.0, now - peer.last)
        status = self._judge(peer, silent)
        if status is peer.status:
            return None
        previous, peer.status, peer.since = peer.status, status, now
        self._counts["events"] += 1
        if status is HealthStatus.DEAD:
            self._counts["deaths"] += 1
            log.info("node %s is dead: silent for %.3f s", node_id, silent)
        elif previous is HealthStatus.DEAD:
            self._counts["returns"] += 1
            log.info("node %s, declared dead, is heard again", node_id)
        return HealthEvent(node_id, previous, status, now, silent)

    def _deliver(self, events: list[HealthEvent]) -> list[HealthEvent]:
        for event in events:
            for callback in list(self._subscribers):
                try:
                    callback(event)
                except Exception:   # a subscriber's bug must not stop failure detection
                    self._counts["errors"] += 1
                    log.exception("health subscriber %r failed on %s", callback, event)
        return events

