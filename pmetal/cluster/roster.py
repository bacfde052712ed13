"""The master's side of the member list: joins, merges, dead members, views.

A part of :class:`pmetal.cluster.election.ElectionManager`, kept apart for
size: these methods run on its state (see that module for the rules). The
master adds nodes that ask (``JoinCluster``) or that beat with no master,
replaces a member whose Beat shows a new incarnation, marks members dead
and drops them after ``health.remove_after`` (that incarnation may not
come back: it is sent the view that fences it), meets other masters (a merge:
the one in the lower term yields) and sends every change to every member as a
``ClusterView``. Followers adopt views in :meth:`Roster._on_view`, and learn
there when the master fenced them.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pmetal.cluster.events import ElectionEvent, Outgoing, Role
from pmetal.cluster.view import ALIVE, DEAD, MemberList, entry, has_quorum, valid
from pmetal.config import ElectionConfig, HealthConfig
from pmetal.wire import Beat, ClusterView, JoinCluster

__all__ = ["Roster", "TERM_JUMP"]

log = logging.getLogger("pmetal.cluster.election")

# Elections over lists from different lineages (founding, merging) move the
# term up by a random amount below this: see pmetal.cluster.election.
TERM_JUMP = 2 ** 31

_TOMBSTONES = 256   # removed members remembered (the oldest go first)


def _described(member: Mapping[str, Any]) -> dict[str, Any]:
    """What a member says of itself beyond its id, address and incarnation."""
    return {"resources": member.get("resources") or {}, "profile": member.get("profile") or {}}


class Roster:
    # State and steps of the ElectionManager these methods are part of.
    node_id: str
    _me: dict[str, Any]
    _config: ElectionConfig
    _health: HealthConfig
    _rng: random.Random
    _term: int
    _role: Role
    _master: str
    _members: MemberList
    _view_term: int
    _in_view: bool
    _fresh: bool
    _fence_pending: bool
    _joining: str
    _master_since: float
    _heard: dict[str, float]
    _dead_since: dict[str, float]
    _removed: dict[str, int]
    _known: dict[str, dict[str, Any]]
    _beats: dict[str, Beat]
    _events: list[ElectionEvent]
    _counts: dict[str, int]

    if TYPE_CHECKING:   # steps of the ElectionManager these methods call
        def _event(self, kind: str, now: float, detail: str = "") -> None: ...
        def _address(self, node_id: str) -> str: ...
        def _others(self) -> list[str]: ...
        def _adopt_term(self, term: int, now: float) -> None: ...
        def _step_down(self, now: float, why: str) -> None: ...
        def _follow(self, master: str, address: str, now: float) -> None: ...
        def _join(self, master: str, address: str, now: float) -> None: ...
        def _start_candidacy(self, now: float, out: list[Outgoing], term: int) -> None: ...

    def _master_beat(self, sender: str, b: Beat, now: float, out: list[Outgoing]) -> None:
        member = self._members.get(sender)
        if b.master == sender:
            self._meet_master(sender, b, now, out)
            return
        if member is None:
            if self._relist_dead(sender, b.incarnation, b.address, now):
                self._view_changed(now, f"{sender} back as a removed incarnation", out)
                return
            if b.master in ("", self.node_id):
                # A node with no master, or one that follows us unlisted: take it in.
                self._add(now, out, [entry({"node_id": sender, "address": b.address,
                                            "incarnation": b.incarnation,
                                            **self._extra(sender)})], b.term, b.epoch)
            return
        if b.incarnation > member["incarnation"]:
            self._add(now, out, [entry({"node_id": sender, "address": b.address,
                                        "incarnation": b.incarnation, **self._extra(sender)})],
                      b.term, b.epoch)
        elif b.term > self._term:
            # A member in a term above ours: it campaigned while it could
            # not hear us, follows a newer master, or took a term from
            # another lineage that also lists it. Raft: step down; and hold
            # our list as a founder's (epoch 0: random term, loses to any
            # master-made list), since that other lineage's next election
            # may be in our next term, over quorums that miss ours.
            self._adopt_term(b.term, now)
            self._members.epoch = 0
        elif b.master != self.node_id or b.epoch != self._members.epoch:
            self._send_view(sender, out)

    def _extra(self, node_id: str) -> dict[str, Any]:
        known = self._known.get(node_id) or {}
        return {"resources": known.get("resources", {}), "profile": known.get("profile", {})}

    def _meet_master(self, other: str, b: Beat, now: float, out: list[Outgoing]) -> None:
        """Two masters: Raft's rule within one cluster, the merge rule across."""
        if self._members.same_incarnation(other, b.incarnation):
            if b.term > self._term:
                # Raft: follow the newer master. Its list may not be ours
                # (it may lead another lineage that took it in): join it
                # until its view comes, as a yielding master does.
                self._adopt_term(b.term, now)
                self._follow(other, b.address, now)
                self._join(other, b.address, now)
                self._in_view = False
                out.append(self._join_message(other, b.address))
            return
        # Lists from different lineages, or one that lists the other as an
        # older incarnation: each side may list the other or not, so the
        # rule reads only what both see alike, the two terms (then ids).
        if (self._term, self.node_id) >= (b.term, other):
            return   # it yields to us when it sees our Beat
        log.info("master %s yields to master %s (term %d against %d)", self.node_id[:8],
                 other[:8], self._term, b.term)
        joining = [self._me] + [e for e in self._members.entries() if e["node_id"] != self.node_id]
        out.append(Outgoing(other, b.address, JoinCluster(self._term, joining)))
        self._step_down(now, f"merging into the cluster of {other}")
        self._join(other, b.address, now)

    # ------------------------------------------------------ membership (master)

    def _master_tick(self, now: float, out: list[Outgoing]) -> None:
        timeout = self._config.timeout
        if now - self._master_since >= timeout and len(self._members) != 2:
            # (A master of two keeps its role: see the election's docstring.)
            recent = {n for n, t in self._heard.items() if now - t < timeout}
            recent.add(self.node_id)
            if not has_quorum(recent, self._members.ids()):
                self._step_down(now, "no quorum heard")
                return
        remove_after = self._health.remove_after
        gone = [n for n, t in self._dead_since.items()
                if now - t >= remove_after and n in self._members and n != self.node_id]
        for node_id in gone:
            self._tombstone(self._members.get(node_id))
            self._members.remove(node_id)
        if gone:
            self._view_changed(now, "removed " + ",".join(gone), out)

    def _on_join(self, sender: str, j: JoinCluster, now: float, out: list[Outgoing]) -> None:
        members = [m for m in j.members if valid(m)] if isinstance(j.members, list) else []
        if not members or members[0]["node_id"] != sender:
            self._refuse(now, f"join from {sender}: the sender must be its first member")
            return
        if self._role is not Role.MASTER:
            return   # it learns the master from our Beat and asks it
        if any(m["node_id"] == self.node_id for m in members):
            self._refuse(now, f"join from {sender}: lists this master's own id "
                              f"{self.node_id} (a cloned identity?)")
            return
        beat = self._beats.get(sender)
        self._add(now, out, [entry(m) for m in members], j.term,
                  beat.epoch if beat is not None else 0, answer=sender)

    def _refuse(self, now: float, why: str) -> None:
        log.warning("refused %s", why)
        self._counts["joins_refused"] += 1
        self._event("refused", now, why)

    def _add(self, now: float, out: list[Outgoing], members: list[dict[str, Any]], term: int,
             epoch: int, answer: str = "") -> None:
        changed = False
        for m in members:
            if self._relist_dead(m["node_id"], m["incarnation"], m["address"], now):
                changed = True
                continue
            cur = self._members.get(m["node_id"])
            if cur is not None and cur["incarnation"] >= m["incarnation"]:
                if (cur["incarnation"] == m["incarnation"] and cur["state"] == ALIVE
                        and _described(m) != _described(cur)):
                    # The member itself says what it has (it was added from a Beat).
                    changed |= self._members.put({**cur, **_described(m)})
                continue   # known (an old incarnation's stale request, or a repeat)
            self._dead_since.pop(m["node_id"], None)
            changed |= self._members.put(m)
        top = max([term] + [b.term for n, b in self._beats.items()
                            if any(m["node_id"] == n for m in members)])
        if changed:
            self._members.epoch = max(self._members.epoch, epoch + 1)
        if changed and (top > self._term or len(members) > 1):
            # A merge (a master yielded its members to us), or newcomers
            # that saw a term above ours and would refuse our views as
            # stale: lead the merged list into a term above both, by a real
            # election, so that nothing either old master decided can pass
            # for a decision of the merged cluster. A random jump: another
            # master may be taking in the same masterless nodes right now,
            # over a list whose quorums need not meet ours.
            self._start_candidacy(now, out,
                                  max(top, self._term) + self._rng.randrange(1, TERM_JUMP))
            return
        if changed:
            self._view_changed(now, "joined " + ",".join(m["node_id"] for m in members), out)
        elif answer:
            self._send_view(answer, out)

    def _relist_dead(self, node_id: str, incarnation: int, address: str, now: float) -> bool:
        """A removed incarnation is back: it may have missed the view that
        dropped it and still run actors that were restarted elsewhere. List
        it dead again (removed again in due course): the view fences it,
        whatever it believes, and only a new incarnation comes back."""
        if incarnation > self._removed.get(node_id, -1) or node_id in self._members:
            return False
        self._members.put({"node_id": node_id, "address": address,
                           "incarnation": incarnation}, DEAD)
        self._dead_since.setdefault(node_id, now)
        return True

    def _tombstone(self, e: Mapping[str, Any] | None) -> None:
        """Remember a member removed while dead: that incarnation may not
        come back (its actors were restarted elsewhere); a new one may."""
        if e is None or e["node_id"] == self.node_id:
            return
        self._removed[e["node_id"]] = max(e["incarnation"], self._removed.get(e["node_id"], -1))
        while len(self._removed) > _TOMBSTONES:
            del self._removed[next(iter(self._removed))]

    def _view_changed(self, now: float, why: str, out: list[Outgoing]) -> None:
        self._event("view", now, why)
        for node_id in self._others():
            self._send_view(node_id, out)

    def _send_view(self, node_id: str, out: list[Outgoing]) -> None:
        self._counts["views"] += 1
        out.append(Outgoing(node_id, self._address(node_id),
                            ClusterView(self._term, self.node_id, self._members.epoch,
                                        list(self._members.entries()))))

    def _join_message(self, master: str, address: str) -> Outgoing:
        return Outgoing(master, address or self._address(master),
                        JoinCluster(self._term, [dict(self._me)]))

    # ----------------------------------------------------------------- views

    def _on_view(self, sender: str, v: ClusterView, now: float, out: list[Outgoing]) -> None:
        if v.master != sender or not isinstance(v.members, list):
            return
        if v.term < self._term:
            self._counts["stale"] += 1
            return
        if self._role is Role.MASTER:
            if v.term == self._term:
                return
            self._adopt_term(v.term, now)
        elif v.term > self._term:
            self._adopt_term(v.term, now)
        elif self._master not in ("", sender):
            return
        self._term = v.term
        self._follow(sender, self._address(sender), now)
        if (v.term, v.epoch) <= (self._view_term, self._members.epoch):
            return
        members = [m for m in v.members if valid(m)]
        listed = {m["node_id"] for m in members}
        for e in self._members.entries():
            if e["state"] != ALIVE and e["node_id"] not in listed:
                self._tombstone(e)   # so that we refuse it too, should we lead
        self._members.replace(members, v.epoch)
        self._view_term = v.term
        self._joining = ""
        self._event("view", now)
        mine = self._members.get(self.node_id)
        if mine is not None and mine["incarnation"] == self._me["incarnation"]:
            if mine["state"] == ALIVE:
                self._in_view = True
                self._fresh = False
                if _described(mine) != _described(self._me):
                    # Admitted from a Beat, which carries no resources or
                    # profile: tell the master what this node has.
                    out.append(self._join_message(sender, self._address(sender)))
                return
            fenced = True
        else:
            # Dropped while admitted: fenced. Listed as an older incarnation
            # (a master that missed our rejoin): just ask again.
            fenced = mine is None and self._in_view
        if mine is None or mine["incarnation"] != self._me["incarnation"]:
            self._members.put(self._me)   # keep ourselves in our own list
            self._members.epoch = v.epoch
        if fenced and not self._fence_pending:
            self._fence_pending = True
            self._counts["fenced"] += 1
            log.warning("node %s fenced by master %s in term %d", self.node_id[:8], sender[:8],
                        v.term)
            self._event("fenced", now, "the master declared this node dead or dropped it")
        elif not fenced:
            out.append(self._join_message(sender, self._address(sender)))
