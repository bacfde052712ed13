"""What happened to the cluster, as one node saw it: a bounded log of typed events.

The node's dashboard shows it (``/api/cluster``, :mod:`pmetal.dashboard`).
The places where things happen feed it with one call each:

* :class:`~pmetal.cluster.service.ClusterService`: members joining and
  leaving the master's list (a diff of each new view), a peer its failure
  detector declares dead and one that answers again, a new master (an
  election's outcome) and the loss of one, this node fenced, a join or a
  peer refused;
* the node's listener (:class:`~pmetal.endpoint.SecureListener`): a
  handshake it refused (a failed PSK proof, a broken protocol), and its
  socket (:class:`~pmetal.transport.ZmqListener`): a stranger ZeroMQ's
  CURVE handshake refused (no namespace keys).

Bounded: the newest :data:`CAPACITY` events are kept. A repeat (the same
kind, node and detail as one of the last :data:`COALESCE` events, such as a
misconfigured static peer refused at every heartbeat) does not take a new
slot: that event moves to the end with its ``count`` raised and its time
updated, so a noisy peer cannot push the rest out.

Pure and synchronous (the caller's loop and clock); ``seq`` rises with every
change, so a reader knows whether anything is new.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

__all__ = ["CAPACITY", "COALESCE", "ClusterEvent", "EventKind", "EventLog"]

CAPACITY = 200
COALESCE = 16


class EventKind(enum.Enum):
    JOIN = "join"            # a node entered the master's member list
    LEAVE = "leave"          # a node left it (removed, or held dead by the master)
    DEATH = "death"          # this node's failure detector declared a peer dead
    RECOVERY = "recovery"    # a peer held dead answers again
    ELECTION = "election"    # a master is known (an election's outcome), or lost
    FENCE = "fence"          # this node was fenced: its actors were stopped
    REFUSAL = "refusal"      # a handshake, a join or a peer refused


@dataclass(frozen=True)
class ClusterEvent:
    seq: int
    kind: EventKind
    at: float        # wall clock (time.time()) of the last occurrence
    node: str        # the node it is about ("" when unknown: a stranger)
    detail: str
    count: int = 1   # occurrences coalesced into this one

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kind"] = self.kind.value
        return out


class EventLog:
    """See the module docstring."""

    def __init__(self, capacity: int = CAPACITY,
                 clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError(f"an event log keeps at least one event, not {capacity}")
        self._events: collections.deque[ClusterEvent] = collections.deque(maxlen=capacity)
        self._clock = clock
        self._members: set[str] | None = None
        self.seq = 0

    def record(self, kind: EventKind, node: str = "", detail: str = "") -> ClusterEvent:
        """Add an event (or count a repeat of a recent one); the event."""
        detail = detail[:300]
        self.seq += 1
        now = self._clock()
        recent = list(self._events)[-COALESCE:]
        for old in reversed(recent):
            if (old.kind, old.node, old.detail) == (kind, node, detail):
                self._events.remove(old)
                event = replace(old, seq=self.seq, at=now, count=old.count + 1)
                break
        else:
            event = ClusterEvent(self.seq, kind, now, node, detail)
        self._events.append(event)
        return event

    def members(self, entries: Iterable[dict[str, Any]], epoch: int) -> None:
        """A new member list (entries as in the election's state): a JOIN for
        each live node not in the previous list, a LEAVE for each gone."""
        live = {m["node_id"] for m in entries
                if m.get("node_id") and m.get("state", "alive") != "dead"}
        before = self._members if self._members is not None else set()
        for node_id in sorted(live - before):
            self.record(EventKind.JOIN, node_id, f"joined the member list (epoch {epoch})")
        for node_id in sorted(before - live):
            self.record(EventKind.LEAVE, node_id, f"left the member list (epoch {epoch})")
        self._members = live

    def events(self) -> tuple[ClusterEvent, ...]:
        """Oldest first."""
        return tuple(self._events)

    def since(self, seq: int) -> tuple[ClusterEvent, ...]:
        return tuple(e for e in self._events if e.seq > seq)
