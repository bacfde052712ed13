"""Addresses a node was told about but has not authenticated: the candidates.

An mDNS record (or a member's word: the master's address in a Beat, a
NodeJoin) says "node X answers at address A". Anyone on the LAN can say
that: the namespace tag in a record is public, and so is every live node's
id. So a hint never touches a member. :class:`Candidates` keeps the hinted
addresses until a handshake there proves an id (then the cluster service
takes the node in, at that address) or they are given up. What it bounds,
whatever a stranger announces:

* at most ``max_candidates`` addresses at once (a hint beyond that is
  counted and left out; the service offers current records again later);
* one address is one candidate, however many records name it (500 records
  at one victim port cost one dial at a time);
* a failed dial is tried again after ``backoff`` seconds, doubling up to
  ``backoff_max``, each delay drawn uniformly from its upper half (jitter:
  nodes that failed together do not retry together); ``give_up`` seconds
  after its first failure the address is given up, and rests until no hint
  has named it for ``give_up`` seconds (a record that stays current keeps
  it at rest: a stranger's records may stay in caches for an hour);
* an address that failed stays remembered (``backoff`` history, and rest
  for ``give_up`` seconds once given up) even when its records go and come
  back: withdrawing and re-announcing a record does not restart the dials;
* withdrawing every record that named an address (mDNS goodbyes) ends its
  candidate at once.

Pure logic: the caller passes ``now`` (any monotonic clock) and does the
dialling (``due`` says what to dial, ``failed`` / ``proven`` what came of
it). :class:`LogLimiter` is the rate limit for what a stranger can make a
node log.
"""

from __future__ import annotations

import collections
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pmetal.config import DiscoveryConfig

__all__ = ["Candidate", "CandidateStatistics", "Candidates", "LogLimiter"]

_MEMORY = 1024
"""Addresses that failed, remembered at most (oldest forgotten first)."""


@dataclass
class Candidate:
    """One address to prove. ``claims``: node id -> what the hint said
    (incarnation, resources), for the node the address turns out to be."""

    address: str
    claims: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: int = 0
    first_failure: float | None = None
    next_try: float = 0.0
    dialing: bool = False
    rest_until: float | None = None      # given up: no dial before then

    def given_up(self, now: float) -> bool:
        return self.rest_until is not None and now < self.rest_until


@dataclass(frozen=True, slots=True)
class CandidateStatistics:
    candidates: int          # addresses waiting to be proven now
    resting: int             # addresses given up, resting
    hints: int               # hints received (a current record is offered again every second)
    dials: int               # dials started
    failures: int            # dials that proved nothing
    proven: int              # dials that proved an id
    given_up: int            # addresses given up
    withdrawn: int           # candidates ended by the withdrawal of their records
    left_out: int            # hints left out (table full, or address at rest), every offer


class Candidates:
    """The candidate table; see the module docstring."""

    def __init__(self, config: DiscoveryConfig, rng: random.Random | None = None) -> None:
        self._config = config
        self._rng = rng or random.Random()
        self._active: dict[str, Candidate] = {}
        # Addresses that failed and have no current hint (or rest): their
        # history, so that a hint that comes back resumes it.
        self._memory: collections.OrderedDict[str, Candidate] = collections.OrderedDict()
        self._counts = dict.fromkeys(("hints", "dials", "failures", "proven", "given_up",
                                      "withdrawn", "left_out"), 0)

    def __contains__(self, address: object) -> bool:
        return address in self._active

    def __len__(self) -> int:
        return len(self._active)

    def addresses(self) -> list[str]:
        return sorted(self._active)

    def get(self, address: str) -> Candidate | None:
        return self._active.get(address)

    def statistics(self) -> CandidateStatistics:
        return CandidateStatistics(len(self._active), len(self._memory), **self._counts)

    # ------------------------------------------------------------- inputs

    def hint(self, address: str, node_id: str, now: float,
             claim: Mapping[str, Any] | None = None) -> bool:
        """A record (or a member) says ``node_id`` answers at ``address``.
        True when the address is a candidate now (new or known)."""
        self._counts["hints"] += 1
        cand = self._active.get(address)
        if cand is None:
            cand = self._recall(address, now)
            if cand is not None and cand.given_up(now):
                # It rests for as long as records name it: dials stop, even
                # while a stranger's records stay in every cache for an hour.
                cand.rest_until = now + self._config.give_up
                self._counts["left_out"] += 1
                return False
            if len(self._active) >= self._config.max_candidates:
                self._counts["left_out"] += 1
                if cand is not None:
                    self._remember(cand)
                return False
            cand = cand or Candidate(address, next_try=now)
            cand.rest_until = None
            self._active[address] = cand
        if node_id in cand.claims or len(cand.claims) < self._config.max_records:
            cand.claims[node_id] = dict(claim or {})
        return True

    def withdraw(self, address: str, node_id: str) -> bool:
        """The record that said ``node_id`` answers at ``address`` is gone.
        True when that ended the candidate (no record names it any more)."""
        cand = self._active.get(address)
        if cand is None or cand.claims.pop(node_id, None) is None or cand.claims:
            return False
        del self._active[address]
        self._counts["withdrawn"] += 1
        if cand.failures:
            self._remember(cand)
        return True

    def due(self, now: float, room: int) -> list[str]:
        """Up to ``room`` addresses to dial now (each marked as being dialled)."""
        ready = [c for c in self._active.values() if not c.dialing and c.next_try <= now]
        ready.sort(key=lambda c: c.next_try)
        for cand in ready[:max(0, room)]:
            cand.dialing = True
            self._counts["dials"] += 1
        return [c.address for c in ready[:max(0, room)]]

    def dialing(self) -> int:
        return sum(1 for c in self._active.values() if c.dialing)

    def failed(self, address: str, now: float) -> bool:
        """The dial of ``address`` proved nothing. True when the address is
        given up now (it rests; no dial until then)."""
        cand = self._active.get(address)
        if cand is None:
            return False
        self._counts["failures"] += 1
        cand.dialing = False
        cand.failures += 1
        if cand.first_failure is None:
            cand.first_failure = now
        cfg = self._config
        if now - cand.first_failure >= cfg.give_up:
            self.give_up(address, now)
            return True
        delay = min(cfg.backoff_max, cfg.backoff * 2.0 ** (cand.failures - 1))
        cand.next_try = now + self._rng.uniform(delay / 2, delay)
        return False

    def give_up(self, address: str, now: float) -> None:
        """No more dials to ``address`` for ``give_up`` seconds (also for an
        address that proved an id the cluster will not take from there)."""
        cand = self._active.pop(address, None) or self._memory.pop(address, None)
        if cand is None:
            cand = Candidate(address)
        self._counts["given_up"] += 1
        cand.dialing = False
        cand.claims.clear()
        cand.rest_until = now + self._config.give_up
        self._remember(cand)

    def proven(self, address: str) -> dict[str, dict[str, Any]]:
        """A handshake at ``address`` proved an id: the candidate ends; its
        claims are returned."""
        cand = self._active.pop(address, None)
        self._memory.pop(address, None)
        self._counts["proven"] += 1
        return cand.claims if cand is not None else {}

    def discard(self, address: str) -> None:
        """``address`` is a member's now (proven another way): forget it."""
        self._active.pop(address, None)
        self._memory.pop(address, None)

    # ------------------------------------------------------------ memory

    def _remember(self, cand: Candidate) -> None:
        cand.claims = {}
        cand.dialing = False
        self._memory[cand.address] = cand
        self._memory.move_to_end(cand.address)
        while len(self._memory) > _MEMORY:
            self._memory.popitem(last=False)

    def _recall(self, address: str, now: float) -> Candidate | None:
        cand = self._memory.pop(address, None)
        if cand is None:
            return None
        cfg = self._config
        if cand.rest_until is not None:
            if now < cand.rest_until:
                self._memory[address] = cand     # still resting
                return cand
            return None    # rested: a fresh start
        if cand.first_failure is not None and now - cand.first_failure >= 2 * cfg.give_up:
            return None    # failed long ago: a fresh start
        return cand


class LogLimiter:
    """At most ``per_source`` lines from one source (an address) and
    ``total`` lines in all per ``period`` seconds; the next line let through
    says how many were held back. Sources are remembered up to ``sources``
    (the least recent forgotten)."""

    def __init__(self, logger: logging.Logger, *, per_source: int = 2, total: int = 10,
                 period: float = 60.0, sources: int = 256) -> None:
        self._log = logger
        self.per_source = per_source
        self.total = total
        self.period = period
        self._max_sources = sources
        self._sources: collections.OrderedDict[str, list[float]] = collections.OrderedDict()
        self._window = [float("-inf"), 0.0]    # start, lines in it
        self.held = 0                             # lines held back since the last let through
        self.held_total = 0

    def log(self, now: float, source: str, level: int, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` at ``level`` unless ``source`` or everyone has
        had their lines this period. True if it was logged."""
        if not self._log.isEnabledFor(level):
            return False
        if now - self._window[0] >= self.period:
            self._window = [now, 0.0]
        window = self._sources.get(source)
        if window is None or now - window[0] >= self.period:
            window = [now, 0.0]
        self._sources[source] = window
        self._sources.move_to_end(source)
        while len(self._sources) > self._max_sources:
            self._sources.popitem(last=False)
        if window[1] >= self.per_source or self._window[1] >= self.total:
            self.held += 1
            self.held_total += 1
            return False
        window[1] += 1
        self._window[1] += 1
        if self.held:
            msg += " (%d similar lines held back)"
            args = (*args, self.held)
            self.held = 0
        self._log.log(level, msg, *args)
        return True
