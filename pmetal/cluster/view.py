"""The member list the master owns, and the quorum rule over it.

A member entry travels as a map (see the comment above
:class:`pmetal.wire.Beat`): ``node_id``, ``address``, ``incarnation``,
``resources``, ``profile`` and, in a master's view, ``state`` (a
:class:`MemberState`: "alive" or "dead"). :class:`MemberList` keeps them
by node id, as those maps, together with the ``epoch`` that versions the
list; the election (pmetal.cluster.election and roster) is the only writer,
and what it hands the rest of the node (``ElectionState.members``) are
frozen :class:`MemberEntry` values.

Quorum: more than half of the members (dead or alive: a member counts as a
voter until the master removes it), or exactly half when that half holds
the member with the smallest node id. The tie-breaker decides even splits,
so that one side of a 2-2 partition keeps a master.

Two members are the exception: both, or one alone once its failure
detector holds the other dead. Either machine of a two-machine cluster
survives the other's loss; the price (two masters, in different terms,
while the two are merely cut off from each other) and how a healed split
resolves are in :mod:`pmetal.cluster.election`.

The lease: :func:`vouched_since` tells a node since when a quorum has
certainly heard it (its Beats that they echoed). Its restartable actors
run only within ``health.dead_after`` times :data:`LEASE_SHARE` of that
time, so a node cut off from the quorum stops them before any master can
have held it dead and restarted them elsewhere (pmetal.cluster.service).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ALIVE", "DEAD", "MemberEntry", "MemberList", "MemberState", "entry", "has_quorum",
           "vouched_since"]


class MemberState(enum.StrEnum):
    """A member's state in the master's list (its string on the wire)."""

    ALIVE = "alive"
    DEAD = "dead"    # held dead by the master, until it removes the entry


ALIVE = MemberState.ALIVE
DEAD = MemberState.DEAD

LEASE_SHARE = 0.6
"""A node's lease lasts this share of ``health.dead_after`` past the send
time of the Beat a quorum echoed last. A master declares a silent node dead
``dead_after`` after it last heard it, which is no earlier than that send
time; the rest of ``dead_after`` is the margin (a Beat's way, a tick)."""


def has_quorum(granted: Collection[str], voters: Collection[str],
               dead: Collection[str] = ()) -> bool:
    """Whether ``granted`` is a quorum of ``voters`` (see the module
    docstring); ``dead``: the voters the deciding node's detector holds
    dead (they matter only to a list of two)."""
    if not voters:
        return False
    if len(voters) == 2:
        return all(v in granted or v in dead for v in voters) and any(
            v in granted for v in voters)
    count = sum(1 for v in voters if v in granted)
    twice = 2 * count
    return twice > len(voters) or (twice == len(voters) and min(voters) in granted)


def vouched_since(me: str, voters: Collection[str], echoes: Mapping[str, float]) -> float:
    """The latest send time ``t`` such that this node (``me``) and the
    voters that echoed a Beat of ours sent at ``t`` or later make a quorum
    of ``voters``: since then, no quorum can have taken this node for dead.
    ``-inf`` when no such time exists, ``inf`` when there is nothing to
    vouch for (this node alone, or a list of two: either machine of a pair
    may carry on alone, see the module docstring)."""
    others = [v for v in voters if v != me]
    if len(voters) <= 2 or me not in voters:
        return float("inf")
    for t in sorted({echoes[v] for v in others if v in echoes}, reverse=True):
        if has_quorum({me, *(v for v in others if echoes.get(v, float("-inf")) >= t)},
                      voters):
            return t
    return float("-inf")


def entry(member: Mapping[str, Any], state: str = ALIVE) -> dict[str, Any]:
    """A clean member entry from whatever map describes a node (a discovery
    record, a JoinCluster entry, a view entry): unknown keys dropped."""
    return {
        "node_id": str(member["node_id"]),
        "address": str(member.get("address", "")),
        "incarnation": int(member.get("incarnation", 0)),
        "resources": dict(member.get("resources") or {}),
        "profile": dict(member.get("profile") or {}),
        "state": MemberState(state),
    }


@dataclass(frozen=True, slots=True)
class MemberEntry:
    """One member of the cluster, as the election hands it out.
    ``resources`` and ``profile`` are the maps the node announced (not to
    be changed: they are shared with the election's list)."""

    node_id: str
    address: str = ""                 # tcp://host:port
    incarnation: int = 0              # changes whenever the node starts or is fenced
    resources: Mapping[str, float] = field(default_factory=dict)
    profile: Mapping[str, Any] = field(default_factory=dict)   # see NodeProfile
    state: MemberState = MemberState.ALIVE

    @classmethod
    def from_wire(cls, member: Mapping[str, Any]) -> MemberEntry:
        """From an entry map (a view's, a join's, a discovery record's);
        a ValueError when it cannot be one (see :func:`valid`)."""
        if not valid(member):
            raise ValueError(f"not a member entry: {member!r}")
        e = entry(member, member.get("state", ALIVE))
        return cls(e["node_id"], e["address"], e["incarnation"], e["resources"],
                   e["profile"], MemberState(e["state"]))

    def to_wire(self) -> dict[str, Any]:
        """The entry map, as a ClusterView or JoinCluster carries it."""
        return entry({"node_id": self.node_id, "address": self.address,
                      "incarnation": self.incarnation, "resources": self.resources,
                      "profile": self.profile}, self.state)

    @property
    def alive(self) -> bool:
        return self.state is MemberState.ALIVE


def valid(member: Any) -> bool:
    """Whether a received map can be a member entry."""
    return (isinstance(member, Mapping) and isinstance(member.get("node_id"), str)
            and bool(member["node_id"]) and isinstance(member.get("incarnation", 0), int)
            and isinstance(member.get("address", ""), str)
            and isinstance(member.get("state", ALIVE), str)
            and member.get("state", ALIVE) in _STATES)


_STATES = frozenset(s.value for s in MemberState)


class MemberList:
    """Member entries by node id, and the epoch that versions them."""

    __slots__ = ("epoch", "_entries")

    def __init__(self, entries: Iterable[Mapping[str, Any]] = (), epoch: int = 0) -> None:
        self._entries: dict[str, dict[str, Any]] = {}
        for e in entries:
            self._entries[e["node_id"]] = entry(e, e.get("state", ALIVE))
        self.epoch = epoch

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, node_id: str) -> dict[str, Any] | None:
        return self._entries.get(node_id)

    def ids(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> tuple[dict[str, Any], ...]:
        """Copies, sorted by node id (the order of every view on the wire)."""
        return tuple(dict(self._entries[k]) for k in sorted(self._entries))

    def values(self) -> tuple[MemberEntry, ...]:
        """The entries as frozen values, sorted by node id."""
        return tuple(MemberEntry(e["node_id"], e["address"], e["incarnation"], e["resources"],
                                 e["profile"], e["state"])
                     for e in (self._entries[k] for k in sorted(self._entries)))

    def put(self, member: Mapping[str, Any], state: str = ALIVE) -> bool:
        """Add or replace a member; True (and epoch + 1) if that changed the list."""
        new = entry(member, state)
        if self._entries.get(new["node_id"]) == new:
            return False
        self._entries[new["node_id"]] = new
        self.epoch += 1
        return True

    def mark(self, node_id: str, state: str) -> bool:
        e = self._entries.get(node_id)
        if e is None or e["state"] == state:
            return False
        e["state"] = state
        self.epoch += 1
        return True

    def remove(self, node_id: str) -> bool:
        if self._entries.pop(node_id, None) is None:
            return False
        self.epoch += 1
        return True

    def replace(self, entries: Iterable[Mapping[str, Any]], epoch: int) -> None:
        """Adopt a master's view."""
        self._entries = {}
        for e in entries:
            self._entries[e["node_id"]] = entry(e, e.get("state", ALIVE))
        self.epoch = epoch

    def same_incarnation(self, node_id: str, incarnation: int) -> bool:
        e = self._entries.get(node_id)
        return e is not None and e["incarnation"] == incarnation
