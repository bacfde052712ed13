"""The master election and the member list: a pure state machine.

:class:`ElectionManager` owns, for one node, the election state (term,
role, the master it follows, whom it voted for) and the member list the
master dictates (:mod:`pmetal.cluster.view`, versioned by ``epoch``). It
does no I/O and reads no clock: the node's shell feeds it messages
(:meth:`~ElectionManager.receive`), ticks, discoveries and the failure
detector's verdicts, each with ``now``; it answers with :class:`Outgoing`
messages to send and queues :class:`ElectionEvent` for the shell. Its
randomness comes from the ``random.Random`` it is given, so a simulation
with a seeded generator replays exactly.

The rules are Raft's leader election with pre-vote and check-quorum:

- Terms only grow; a node votes at most once per term, never for a
  candidate whose member-list epoch is older than its own, and never while
  it heard its master within ``election.timeout`` (stickiness: a node back
  from a partition cannot depose a healthy master or inflate terms).
- A follower whose master is silent for ``timeout`` plus a random part of up
  to half of it asks for pre-votes (nobody changes term); with a quorum of
  them it becomes candidate in the next term; with a quorum of votes,
  master. The master's Beat (``master`` = itself) asserts its mastership.
- A master that has not heard from a quorum of members for ``timeout``
  steps down, so a minority side never keeps a master.
- Quorum (:func:`pmetal.cluster.view.has_quorum`): over the member list,
  dead members included until removed; more than half, or exactly half
  holding the smallest node id.
- **Two nodes**: a quorum is both, or one alone once its failure detector
  holds the other dead; and a master of two never steps down for want of
  a quorum. So the survivor of either machine's loss is (or becomes) master
  within ``health.dead_after`` plus up to ``timeout / 2``, and a sitting
  master keeps its role. Two machines cannot tell a dead peer from a cut
  cable: while cut off, each side has a master, in different terms (the
  one that campaigns alone takes a random term above its own, so the two
  practically never share one). **A healed split**: each master sees the
  other's Beat; the higher term wins (Raft's rule, below) and the other
  follows it. The winner's list holds the loser dead, so the loser is
  *fenced*: every actor it hosts ends; those its own owners created that
  may restart start again, in place, or, where the copy replaced one on
  the winner's side, through the winner, which looks it up first and keeps
  the surviving copy (pmetal.node.scheduler). One copy of each actor
  remains.

What changes the member list: only the master (:mod:`pmetal.cluster.roster`).
It adds a node that asks (:class:`~pmetal.wire.JoinCluster`) or that beats
with no master, marks a member "dead" as soon as the failure detector says
so (the runtime restarts its actors on that ``view`` event), drops it after
``health.remove_after`` seconds dead, and replaces an entry when a Beat
shows a new (larger) incarnation. Every change increments ``epoch`` and
goes to every member as a :class:`~pmetal.wire.ClusterView` carrying the
master's term; followers adopt views from their master when the epoch is
newer, and refuse stale terms. A node that such a view marks dead, or
drops, is *fenced*: the shell kills its actors and calls
:meth:`ElectionManager.fence` with a new incarnation, and the node rejoins.

Bootstrap: for ``election.bootstrap`` seconds a fresh node elects no one
and votes for no one, unless it hears of a master, which it then joins.
Then its list is itself plus the nodes it heard from, at epoch 0 (a list
no master made, which loses every vote against one a master made). An
election over such a list (a *founding* election) jumps to a random term
above every term seen, so that clusters founded apart (a partition at
start, a node restarted without memory alone) practically never share a
term. Two masters that meet merge. Within one lineage (each lists the
other's incarnation) Raft's rule holds: the older term follows the newer.
Otherwise the master in the lower term (tie: the smaller node id) yields:
the term is all that both sides see alike (each may list the other or not,
under an old incarnation: a rule on list sizes had two masters of two each
waiting for the other to yield). It sends its members to the other in a
JoinCluster and becomes a follower; the winner adds them and runs an election in a
term above both, by a random jump too: two masters that take in the same
masterless nodes at once must not pick the same term. Until the winner's
view arrives the yielding side campaigns for no one and votes only for the
winner: its old list and the winner's new one may have quorums that do not
meet. If no view comes within ``bootstrap`` seconds, it gives up and holds
its old list as a founder's (epoch 0: random term, loses to master-made
lists).

A node restarted without memory may have voted, or led, in any term of
its old life. Until it is in a master's view it says so with every vote it
grants ("fresh"); a candidate that needs such votes for its quorum takes a
random term, and otherwise does not count them.

Guarantees, checked by a simulation of 10,000 random schedules of crashes,
restarts, loss, delay and partitions (tests/cluster/test_election_sim.py):
at most one master per term; one master that every node follows, with one
term and one epoch, a few seconds after the faults stop. The first rests on
a timing assumption: no message is delayed longer than ``bootstrap`` minus
the election timeout (a restarted node, having forgotten its vote, votes
again only after its bootstrap window; a joining node waits that long).
Not guaranteed: a master at every moment (there is none during an election
or on a minority side); that clusters founded or merged apart never share a
term (one chance in about 2**31 per pair of such elections).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Mapping
from typing import Any

from pmetal.cluster.events import (
    ElectionEvent,
    ElectionState,
    ElectionStatistics,
    Outgoing,
    Role,
)
from pmetal.cluster.roster import TERM_JUMP, Roster
from pmetal.cluster.view import (ALIVE, DEAD, MemberList, entry, has_quorum, valid,
                                 vouched_since)
from pmetal.config import ElectionConfig, HealthConfig
from pmetal.wire import Beat, ClusterView, JoinCluster, Message, Vote, VoteRequest

__all__ = ["ElectionEvent", "ElectionManager", "ElectionState", "ElectionStatistics",
           "Outgoing", "Role"]

log = logging.getLogger(__name__)

_FRESH = "fresh"   # the reason of a pre-vote granted by a node without memory


class ElectionManager(Roster):
    def __init__(self, me: Mapping[str, Any], config: ElectionConfig, health: HealthConfig, *,
                 now: float, rng: random.Random, peers: Iterable[Mapping[str, Any]] = ()
                 ) -> None:
        """``me``: this node's member entry (see pmetal.wire). ``peers``:
        static peers' entries (addresses to beat to; members of the founded
        list only once heard from). ``now`` starts the bootstrap window."""
        self._me = entry(me)
        self.node_id: str = self._me["node_id"]
        self._config = config
        self._health = health
        self._rng = rng
        self._term = 0
        self._role = Role.FOLLOWER
        self._master = ""
        self._master_address = ""
        self._voted_for = ""
        self._members = MemberList([self._me])
        self._view_term = 0             # term of the master whose view we hold
        # The view we hold, from our master or its lineage, lists this
        # incarnation alive: a later view that drops us fences us.
        self._in_view = False
        # Started without memory and not yet in any master's view: it may
        # have voted (or led) in any term of its old life. It says so when
        # it grants a pre-vote, and a candidate that needs such votes for
        # its quorum takes a random term, which its old life never used.
        self._fresh = True
        self._fresh_granted: set[str] = set()
        self._jumped = False   # the current candidacy took a random term
        self._fence_pending = False
        # Joining another master's cluster (a merge): until its view comes,
        # or ``bootstrap`` seconds pass, campaign for no one and vote only
        # for it, since our list and its list may have disjoint quorums.
        self._joining = ""
        self._joining_address = ""
        self._joining_until = 0.0
        self._boot_until = now + config.bootstrap
        self._booted = False
        self._master_seen = now         # last sign of life of the master we follow
        self._master_since = now
        self._deadline = now + self._jitter(config.timeout)
        self._granted: set[str] = set()  # pre-votes or votes for the current campaign
        self._pre_term = 0              # term of the pre-vote round under way (0: none)
        self._heard: dict[str, float] = {}
        self._dead_since: dict[str, float] = {}
        self._removed: dict[str, int] = {}   # node id -> the last incarnation removed dead
        self._known: dict[str, dict[str, Any]] = {}   # discovered nodes by id
        self._reachable: set[str] = set()            # ... that discovery says answer
        self._beats: dict[str, Beat] = {}            # last Beat of each node
        self._events: list[ElectionEvent] = []
        self._counts = dict.fromkeys(("elections", "pre_votes", "won", "granted", "refused",
                                      "stale", "views", "joins_refused", "fenced"), 0)
        for p in peers:
            if valid(p) and p["node_id"] != self.node_id:
                self._known[p["node_id"]] = entry(p)

    # ---------------------------------------------------------------- reading

    @property
    def state(self) -> ElectionState:
        return ElectionState(self._term, self._role, self._master, self._members.epoch,
                             self._members.values(), self._voted_for)

    def events(self) -> list[ElectionEvent]:
        """The events since the last call (drains them)."""
        events, self._events = self._events, []
        return events

    def vouched(self, echoes: Mapping[str, float]) -> float:
        """Since when a quorum of this node's member list has certainly heard
        it, from the send times of its Beats that each member echoed
        (:func:`pmetal.cluster.view.vouched_since`)."""
        return vouched_since(self.node_id, self._members.ids(), echoes)

    def statistics(self) -> ElectionStatistics:
        c = self._counts
        return ElectionStatistics(self._term, self._role, self._members.epoch,
                                  len(self._members), c["elections"], c["pre_votes"], c["won"],
                                  c["granted"], c["refused"], c["stale"], c["views"],
                                  c["joins_refused"], c["fenced"])

    def beat(self, now: float) -> dict[str, Any]:
        """The election fields of this node's next Beat."""
        if self._joining and not self._master:
            # Tells our followers where we went, so they join it too.
            return {"term": self._term, "master": self._joining, "epoch": self._members.epoch,
                    "size": len(self._members), "master_address": self._joining_address}
        return {"term": self._term, "master": self._master, "epoch": self._members.epoch,
                "size": len(self._members), "master_address": self._master_address}

    # ----------------------------------------------------------------- inputs

    def heard(self, node_id: str, now: float) -> None:
        """Any message from that node (check-quorum counts it);
        :meth:`receive` calls it itself."""
        self._heard[node_id] = now

    def discovered(self, member: Mapping[str, Any], now: float) -> list[Outgoing]:
        """A reachable node (mDNS, a static peer that answered): a member
        of the list this node founds if bootstrap ends with no master."""
        if valid(member) and member["node_id"] != self.node_id:
            self._known[member["node_id"]] = entry(member)
            self._reachable.add(member["node_id"])
        return []

    def peer_dead(self, node_id: str, dead: bool, now: float) -> list[Outgoing]:
        """The failure detector's verdict on a peer (dead, or alive again)."""
        out: list[Outgoing] = []
        if not dead:
            self._dead_since.pop(node_id, None)
            return out
        self._dead_since.setdefault(node_id, now)
        if self._role is Role.MASTER:
            e = self._members.get(node_id)
            if e is not None and e["state"] == ALIVE and self._members.mark(node_id, DEAD):
                self._view_changed(now, f"{node_id} dead", out)
        elif node_id == self._master:
            # No need to wait out the timeout: the detector already did.
            self._lose_master(now, "master declared dead")
            self._deadline = now + self._rng.uniform(0.0, self._config.timeout / 2)
        return out

    def fence(self, now: float, incarnation: int) -> list[Outgoing]:
        """This node restarts as ``incarnation`` (its actors are gone): drop
        mastership, forget admission and ask the master to take it back."""
        self._me["incarnation"] = incarnation
        self._fence_pending = False
        self._in_view = False
        if self._role is not Role.FOLLOWER:
            self._step_down(now, "fenced")
        epoch = self._members.epoch   # our own entry is not a new list
        self._members.put(self._me)
        self._members.epoch = epoch
        out: list[Outgoing] = []
        if self._master:
            out.append(self._join_message(self._master, self._master_address))
        return out

    def paused(self, gap: float) -> None:
        """This node did not run for ``gap`` seconds: the others' silence
        over it is not theirs (a master that wakes must not step down for
        want of a quorum it could not hear, a follower not campaign
        against a master it could not hear)."""
        self._heard = {n: t + gap for n, t in self._heard.items()}
        self._master_seen += gap
        self._deadline += gap

    def tick(self, now: float) -> list[Outgoing]:
        """Called every ``health.interval``: timeouts, check-quorum, removals."""
        out: list[Outgoing] = []
        if not self._booted:
            if now < self._boot_until:
                return out
            self._end_bootstrap(now)
        if self._joining and now >= self._joining_until:
            log.info("node %s gives up joining %s", self.node_id[:8], self._joining[:8])
            self._joining = ""
            # Our old list may have quorums that miss the merged cluster's,
            # which may be electing in our next term: elect as a founder
            # (random term) and lose every vote against a master-made list.
            self._members.epoch = 0
        if self._role is Role.MASTER:
            self._master_tick(now, out)
        elif self._joining:
            pass
        elif self._role is Role.FOLLOWER:
            if self._master and now - self._master_seen >= self._config.timeout:
                self._lose_master(now, "master silent")
                # The timeout already passed: only the random part is left.
                self._deadline = now + self._rng.uniform(0.0, self._config.timeout / 2)
            if not self._master and now >= self._deadline:
                self._start_pre_vote(now, out)
        elif now >= self._deadline:   # a candidacy that did not conclude
            self._role = Role.FOLLOWER
            self._start_pre_vote(now, out)
        return out

    def receive(self, sender: str, message: Message, now: float) -> list[Outgoing]:
        """A Beat, VoteRequest, Vote, ClusterView or JoinCluster from
        ``sender`` (the node id its session proved); other kinds are ignored."""
        self._heard[sender] = now
        out: list[Outgoing] = []
        if isinstance(message, Beat):
            self._on_beat(sender, message, now, out)
        elif isinstance(message, VoteRequest):
            self._on_vote_request(sender, message, now, out)
        elif isinstance(message, Vote):
            self._on_vote(sender, message, now, out)
        elif isinstance(message, ClusterView):
            self._on_view(sender, message, now, out)
        elif isinstance(message, JoinCluster):
            self._on_join(sender, message, now, out)
        return out

    # ---------------------------------------------------------------- helpers

    def _jitter(self, base: float) -> float:
        return base + self._rng.uniform(0.0, self._config.timeout / 2)

    def _event(self, kind: str, now: float, detail: str = "") -> None:
        self._events.append(ElectionEvent(kind, self._term, self._master, self._members.epoch,
                                          now, detail))

    def _address(self, node_id: str) -> str:
        e = self._members.get(node_id) or self._known.get(node_id)
        if e is not None:
            return e["address"]
        beat = self._beats.get(node_id)
        return beat.address if beat is not None else ""

    def _quorum(self, granted: set[str]) -> bool:
        return has_quorum(granted, self._members.ids(), self._dead_since)

    def _others(self) -> list[str]:
        return [n for n in self._members.ids() if n != self.node_id]

    def _next_term(self) -> int:
        if self._members.epoch == 0:
            # A founding election, over a list no master made: nodes cut off
            # from each other at start may found clusters with lists that
            # do not intersect, so their terms must not collide. Random.
            seen = max((b.term for b in self._beats.values()), default=0)
            return max(self._term, seen) + self._rng.randrange(1, TERM_JUMP)
        return self._term + 1

    def _adopt_term(self, term: int, now: float) -> None:
        """A higher term exists: follow it (no vote cast in it yet)."""
        if self._role is not Role.FOLLOWER:
            self._step_down(now, f"term {term} seen")
        elif self._master:
            self._lose_master(now, f"term {term} seen")
        self._term = term
        self._voted_for = ""
        self._pre_term = 0

    def _step_down(self, now: float, why: str) -> None:
        was_master = self._role is Role.MASTER
        self._role = Role.FOLLOWER
        self._granted = set()
        self._pre_term = 0
        if was_master:
            log.info("master %s steps down in term %d: %s", self.node_id[:8], self._term, why)
            self._master = ""
            self._master_address = ""
            self._event("no_master", now, why)
        self._deadline = now + self._jitter(self._config.timeout)

    def _lose_master(self, now: float, why: str) -> None:
        if self._master:
            self._master = ""
            self._master_address = ""
            self._event("no_master", now, why)
        self._deadline = now + self._jitter(self._config.timeout)

    def _follow(self, master: str, address: str, now: float) -> None:
        self._master_seen = now
        if self._master == master:
            return
        if self._role is not Role.FOLLOWER:
            self._role = Role.FOLLOWER
            self._granted = set()
        self._pre_term = 0
        if master not in self._members:
            # A master from another cluster: we are not in its list yet.
            self._in_view = False
        self._master = master
        self._master_address = address
        self._event("master", now)

    def _end_bootstrap(self, now: float) -> None:
        self._booted = True
        if self._master or self._term:
            return
        # Found the cluster among the nodes discovered (heard from) so far.
        for node_id, e in self._known.items():
            if ((node_id in self._heard or node_id in self._reachable)
                    and node_id not in self._members):
                self._members.put(e)
        # Epoch 0: a list no master made yet. Nodes that hold one loses every
        # vote against them, so a restarted node cannot outvote the list
        # its old cluster agreed on.
        self._members.epoch = 0
        self._deadline = now + self._rng.uniform(0.0, self._config.timeout / 2)

    # ---------------------------------------------------------------- votes

    def _start_pre_vote(self, now: float, out: list[Outgoing]) -> None:
        self._pre_term = self._next_term()
        self._granted = {self.node_id}
        self._fresh_granted = {self.node_id} if self._fresh else set()
        self._counts["pre_votes"] += 1
        self._deadline = now + self._jitter(self._config.timeout)
        if self._quorum(self._granted):
            term = self._pre_term
            if len(self._members) == 2:
                # The survivor of two, alone: the other may be cut off
                # rather than dead, and campaigning alone in our next term
                # too. A random term keeps the two masters apart.
                term += self._rng.randrange(1, TERM_JUMP)
            self._start_candidacy(now, out, term)
            return
        request = VoteRequest(self._pre_term, self.node_id, self._members.epoch, True)
        out.extend(Outgoing(n, self._address(n), request) for n in self._others())

    def _start_candidacy(self, now: float, out: list[Outgoing], term: int) -> None:
        self._jumped = True   # the default for merges and founders; see _on_vote
        was_master = self._role is Role.MASTER
        self._term = term
        self._role = Role.CANDIDATE
        self._voted_for = self.node_id
        self._granted = {self.node_id}
        self._pre_term = 0
        if was_master or self._master:
            self._master = ""
            self._master_address = ""
            self._event("no_master", now, "new election")
        self._counts["elections"] += 1
        self._deadline = now + self._jitter(self._config.timeout)
        if self._quorum(self._granted):
            self._become_master(now, out)
            return
        request = VoteRequest(term, self.node_id, self._members.epoch, False)
        out.extend(Outgoing(n, self._address(n), request) for n in self._others())

    def _become_master(self, now: float, out: list[Outgoing]) -> None:
        self._role = Role.MASTER
        self._master = self.node_id
        self._master_address = self._me["address"]
        self._master_since = now
        self._in_view = True
        self._fresh = False
        self._counts["won"] += 1
        log.info("node %s is master in term %d", self.node_id[:8], self._term)
        self._event("elected", now)
        self._event("master", now)
        # A new epoch under the new term: every member adopts this view.
        self._members.epoch += 1
        self._view_term = self._term
        for node_id in self._dead_since:
            self._members.mark(node_id, DEAD)
        self._view_changed(now, "elected", out)

    def _on_vote_request(self, sender: str, r: VoteRequest, now: float,
                         out: list[Outgoing]) -> None:
        why = self._refusal(sender, r, now)
        if not why and not r.pre:
            if r.term > self._term:
                # Raft: a real request past every lease moves us to its term
                # even when we refuse it, so the node that can win campaigns
                # above it next.
                self._adopt_term(r.term, now)
            if self._voted_for not in ("", r.candidate):
                why = f"voted for {self._voted_for} in term {self._term}"
        if not why and r.epoch < self._members.epoch:
            why = f"member list epoch {r.epoch} older than {self._members.epoch}"
        if why:
            self._counts["refused"] += 1
            out.append(Outgoing(sender, self._address(sender),
                                Vote(self._term, self.node_id, False, r.pre, why)))
            return
        if not r.pre:
            self._voted_for = r.candidate
            self._deadline = now + self._jitter(self._config.timeout)
        self._counts["granted"] += 1
        out.append(Outgoing(sender, self._address(sender),
                            Vote(r.term, self.node_id, True, r.pre,
                                 _FRESH if self._fresh else "")))

    def _refusal(self, sender: str, r: VoteRequest, now: float) -> str:
        if r.candidate != sender:
            return f"{sender} asked for a vote for {r.candidate}: a node campaigns for itself"
        if not self._booted:
            # A restarted node forgot whom it voted for: it must not vote
            # again until every election it may have voted in is over.
            return "bootstrapping"
        if self._joining and r.candidate != self._joining:
            return f"joining the cluster of {self._joining}"
        if r.candidate not in self._members and r.candidate not in (self._master, self._joining):
            # A candidate from another lineage (clusters founded apart, or
            # a master that took us in before we took its view): its term
            # must not become ours, or our lineage's next election could
            # collide with its, over lists whose quorums need not meet.
            return f"{r.candidate} is not in this node's member list"
        if r.term < self._term or (r.pre and r.term == self._term):
            self._counts["stale"] += 1
            return f"stale term {r.term} < {self._term}"
        if self._role is Role.MASTER:
            return "this node is master"
        if (self._master and self._master != r.candidate
                and now - self._master_seen < self._config.timeout):
            return f"master {self._master} is alive"
        return ""

    def _on_vote(self, sender: str, v: Vote, now: float, out: list[Outgoing]) -> None:
        if not v.granted:
            if v.term > self._term:
                self._adopt_term(v.term, now)
            return
        if v.pre:
            if self._role is Role.FOLLOWER and self._pre_term and v.term == self._pre_term:
                self._granted.add(sender)
                if v.reason == _FRESH:
                    self._fresh_granted.add(sender)
                if self._quorum(self._granted):
                    term = self._pre_term
                    jump = not self._quorum(self._granted - self._fresh_granted)
                    if jump:
                        term += self._rng.randrange(0, TERM_JUMP)
                    jump = jump or self._members.epoch == 0   # founders' terms are random
                    self._start_candidacy(now, out, term)
                    self._jumped = jump
        elif self._role is Role.CANDIDATE and v.term == self._term:
            if v.reason == _FRESH and not self._jumped:
                return   # its old life may have voted in this very term
            self._granted.add(sender)
            if self._quorum(self._granted):
                self._become_master(now, out)

    # ---------------------------------------------------------------- beats

    def _on_beat(self, sender: str, b: Beat, now: float, out: list[Outgoing]) -> None:
        self._beats[sender] = b
        if sender not in self._known:
            self._known[sender] = entry({"node_id": sender, "address": b.address,
                                         "incarnation": b.incarnation})
        if self._role is Role.MASTER:
            self._master_beat(sender, b, now, out)
            return
        if b.master == sender:
            if not self._booted or self._term == 0:
                # A fresh node joins the master it hears of, whatever its term.
                self._term = max(self._term, b.term) if self._term else b.term
                if b.term == self._term:
                    self._follow(sender, b.address, now)
            elif b.term > self._term:
                self._adopt_term(b.term, now)
                self._follow(sender, b.address, now)
            elif b.term == self._term:
                if self._master in ("", sender):
                    self._follow(sender, b.address, now)
            else:
                self._counts["stale"] += 1
                if self._joining == sender:
                    # It must learn our term to lead us above it.
                    out.append(self._join_message(sender, b.address))
                return
            if self._master == sender and not self._in_view:
                # Following a master whose list we are not in yet: we are
                # joining it, whatever lists we held before.
                if self._joining != sender:
                    self._join(sender, b.address, now)
                out.append(self._join_message(sender, b.address))
            elif self._master == sender and self._view_term < b.term:
                # We hold no view of this master's term: ask for it. Its
                # epochs may equal those of the list we hold (a deposed
                # master numbers its own), so it cannot tell from our Beat
                # that we lack its view, which may hold us dead (fenced).
                out.append(self._join_message(sender, b.address))
        elif sender == self._master:
            self._lose_master(now, f"master {sender} says it is not master")
            if b.master:
                self._join(b.master, b.master_address, now)

    def _join(self, master: str, address: str, now: float) -> None:
        self._joining = master
        self._joining_address = address
        self._joining_until = now + self._config.bootstrap
