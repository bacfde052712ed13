"""What the election (pmetal.cluster.election) gives its shell: the node's
role and state, events, the messages to send, statistics. Plain frozen
values; the shell never reaches into the state machine."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pmetal.cluster.view import MemberEntry
from pmetal.wire import Message

__all__ = ["ElectionEvent", "ElectionState", "ElectionStatistics", "Outgoing", "Role"]


class Role(enum.Enum):
    FOLLOWER = "follower"
    CANDIDATE = "candidate"
    MASTER = "master"


@dataclass(frozen=True)
class ElectionState:
    term: int
    role: Role
    master: str               # "" while none is known
    epoch: int
    members: tuple[MemberEntry, ...]  # this node included, sorted by node id
    voted_for: str


@dataclass(frozen=True)
class ElectionEvent:
    """For the shell. ``kind``: "elected" (this node became master),
    "master" (a new master is known, this node included), "no_master" (the
    master was lost or stepped down), "view" (the member list changed:
    ``epoch``), "fenced" (the master declared this node dead or dropped
    it: kill every actor, call :meth:`ElectionManager.fence` with a new
    incarnation), "refused" (a join was refused: ``detail`` says why)."""

    kind: str
    term: int
    master: str
    epoch: int
    at: float
    detail: str = ""


@dataclass(frozen=True)
class Outgoing:
    to: str        # node id
    address: str   # "" when unknown: answer on the connection it came from
    message: Message


@dataclass(frozen=True, slots=True)
class ElectionStatistics:
    term: int
    role: Role
    epoch: int
    members: int
    elections: int        # candidacies started (real votes asked)
    pre_votes: int        # pre-vote rounds started
    won: int
    votes_granted: int
    votes_refused: int
    stale: int            # messages refused for a stale term
    views_sent: int
    joins_refused: int
    fenced: int
