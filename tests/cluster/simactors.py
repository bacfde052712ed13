"""Actors placed and restarted over a :class:`~tests.cluster.simnet.SimNet`.

The election is the real :class:`~pmetal.cluster.election.ElectionManager`;
placement follows the rules of :mod:`pmetal.node.scheduler`, step by
step, with every await of the real code a message delay here:

* the creator's node asks the master in its group (a hop);
* the master decides under its term: it looks the actor up on the members
  it reaches (a round trip), asks them what they have (a round trip; the
  answers must come from a quorum of its member list, with
  :func:`pmetal.cluster.view.has_quorum`, the real rule), and after each
  round trip gives up if it is no longer master in that term; decisions for
  one actor run one at a time;
* the chosen node constructs the copy unless the decision's term is older
  than the newest it knows (a hop), and the creator learns where it runs;
* the creator's node restarts (next incarnation) an actor it placed on a
  node its master's list holds dead, or no longer lists while its own
  detector holds it dead;
* a fenced node ends every copy it hosts; the restartable ones its own
  owner created are restarted in place, except those that replaced a copy
  on a node held dead (:func:`pmetal.node.scheduler.restarted_elsewhere`),
  which are placed again through the master, which looks them up first.

:meth:`SimActors.check` runs after every event of the network and raises
:class:`~tests.cluster.simnet.Violation` when two copies of one actor run
in one connected group of nodes on nodes that the group's newest member
list (highest term and epoch) holds alive. A copy on a node that list
holds dead is not counted: it is fenced when a view of that lineage
reaches its node, and clients that follow that list do not call it. That
is the guarantee's limit: fencing travels by view, not by lease, so until
the view arrives a caller on the fenced node's own side may still reach
the old copy (docs/cluster.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pmetal.cluster.election import Role
from pmetal.cluster.view import has_quorum
from tests.cluster.simnet import SimNet, Violation

_PATIENCE = 6.0   # s a creator keeps asking (the creation's deadline)


@dataclass
class Copy:
    incarnation: int
    replaced: bool            # it replaced a copy on a node held dead


@dataclass
class Request:
    actor: str
    owner: str
    incarnation: int
    replaced: bool
    deadline: float
    done: bool = False
    asked: str = ""           # the master asked, until it answers or is lost
    node: str = ""            # options.node: where the first creation must go


@dataclass
class SimActors:
    net: SimNet
    owners: dict[str, str] = field(default_factory=dict)           # actor -> owner node
    copies: dict[str, dict[str, Copy]] = field(default_factory=dict)   # node -> actor -> copy
    placed: dict[str, dict[str, tuple[str, int]]] = field(default_factory=dict)
    deciding: dict[tuple[str, str], bool] = field(default_factory=dict)   # (master, actor)
    created: int = 0
    constructed: list[tuple[float, str, str, int]] = field(default_factory=list)
    refused_stale: int = 0
    gave_up: int = 0
    restarts: int = 0

    def __post_init__(self) -> None:
        for node_id in self.net.ids:
            self.copies.setdefault(node_id, {})
            self.placed.setdefault(node_id, {})
        self.net.on_fenced = self._fenced
        self.net.on_crash = self._crashed
        self.net.after_tick = self._tick
        self.net.after_event = self.check

    # -------------------------------------------------------------- helpers

    def _reach(self, a: str, b: str) -> bool:
        net = self.net
        return net.nodes[a].alive and net.nodes[b].alive and net.group[a] == net.group[b]

    def _hop(self, src: str, dst: str, call: Callable[[], None]) -> None:
        """``call`` at ``dst`` one message delay from now, if the message
        gets there (same group at both ends when sent and when it lands;
        requests travel over TCP: no loss)."""
        net = self.net
        if not self._reach(src, dst):
            return
        net.at(net.now + net.rng.uniform(0, net.max_delay),
               lambda: call() if self._reach(src, dst) else None)

    def _round_trip(self) -> float:
        return 2 * self.net.rng.uniform(0, self.net.max_delay) + 1e-4

    def master_of(self, node_id: str) -> str:
        return self.net.nodes[node_id].manager.state.master

    # ------------------------------------------------------------- creation

    def create(self, actor: str, owner: str, node: str = "") -> None:
        self.owners[actor] = owner
        self._ask(Request(actor, owner, 0, False, self.net.now + _PATIENCE, node=node))

    def _ask(self, r: Request) -> None:
        """The creator's node asks its master, and asks the next one when
        that one refuses or is lost (Scheduler._via_master); it gives up at
        the creation's deadline."""
        net = self.net
        owner = net.nodes[r.owner]
        if r.done or not owner.alive:
            return
        if net.now >= r.deadline:
            r.done = True
            self.gave_up += 1
            return
        master = self.master_of(r.owner)
        if r.asked and (r.asked != master or r.asked in owner.dead):
            r.asked = ""   # the master went while deciding: ask the next one
        if not r.asked and master:
            r.asked = master
            self._hop(r.owner, master, lambda: self._decide(master, r))
        net.at(net.now + net.health.interval, lambda: self._ask(r))

    def _refuse(self, src: str, r: Request) -> None:
        """A Failure the creator answers by asking again (NotMasterError,
        StaleTermError, a decision under way)."""
        def landed() -> None:
            r.asked = ""
        self._hop(src, r.owner, landed)

    def _decide(self, master: str, r: Request) -> None:
        m = self.net.nodes[master].manager
        if r.done or m.state.role is not Role.MASTER or self.deciding.get((master, r.actor)):
            self._refuse(master, r)
            return
        self.deciding[(master, r.actor)] = True
        term = m.state.term
        self.net.at(self.net.now + self._round_trip(), lambda: self._looked_up(master, r, term))

    def _deposed(self, master: str, r: Request, term: int) -> bool:
        state = self.net.nodes[master].manager.state
        if (self.net.nodes[master].alive and state.role is Role.MASTER
                and state.term == term):
            return False
        self.deciding.pop((master, r.actor), None)
        self._refuse(master, r)
        return True

    def _looked_up(self, master: str, r: Request, term: int) -> None:
        if self._deposed(master, r, term):
            return
        node = self.net.nodes[master]
        silent = [e.node_id for e in node.manager.state.members
                  if e.state != "dead" and e.node_id not in node.dead
                  and not self._reach(master, e.node_id)]
        if silent:
            # A member that has not answered: the lookup waits for its answer
            # or for its death (Membership.find_actor; a dead member is
            # dropped, which ends the wait).
            self.net.at(self.net.now + self.net.health.interval,
                        lambda: self._looked_up(master, r, term))
            return
        for node_id, actors in self.copies.items():
            if r.actor in actors and self._reach(master, node_id):
                self.deciding.pop((master, r.actor), None)
                self._answer(master, r, node_id, actors[r.actor].incarnation)
                return
        self.net.at(self.net.now + self._round_trip(), lambda: self._asked(master, r, term))

    def _asked(self, master: str, r: Request, term: int) -> None:
        if self._deposed(master, r, term):
            return
        self.deciding.pop((master, r.actor), None)
        state = self.net.nodes[master].manager.state
        voters = [e.node_id for e in state.members]
        # Asked: the members its list holds alive (Membership holds no other).
        heard = {e.node_id for e in state.members
                 if e.state != "dead" and self._reach(master, e.node_id)}
        if not has_quorum(heard, voters, self.net.nodes[master].dead):
            self._refuse(master, r)   # a minority side places nothing
            return
        target = r.node if r.node in heard else self.net.rng.choice(sorted(heard))
        self._hop(master, target, lambda: self._construct(target, master, r, term))

    def _construct(self, target: str, master: str, r: Request, term: int) -> None:
        if self.net.nodes[target].manager.state.term > term:
            self.refused_stale += 1
            self._refuse(target, r)   # StaleTermError: the creator asks the current master
            return
        here = self.copies[target]
        if r.actor not in here:
            here[r.actor] = Copy(r.incarnation, r.replaced)
            self.created += 1
            self.constructed.append((self.net.now, target, r.actor, term))
        self._answer(target, r, target, here[r.actor].incarnation)

    def _answer(self, src: str, r: Request, host: str, incarnation: int) -> None:
        def landed() -> None:
            if not r.done:
                r.done = True
                if host != r.owner:
                    self.placed[r.owner][r.actor] = (host, incarnation)
        self._hop(src, r.owner, landed)

    # ------------------------------------------------------------- failures

    def _tick(self, node_id: str) -> None:
        if not self.placed[node_id]:
            return
        node = self.net.nodes[node_id]
        listed = {e.node_id: e.state for e in node.manager.state.members}
        for actor, (host, incarnation) in list(self.placed[node_id].items()):
            if listed.get(host) == "dead" or (host not in listed and host in node.dead):
                del self.placed[node_id][actor]
                self.restarts += 1
                self._ask(Request(actor, node_id, incarnation + 1, True,
                                  self.net.now + _PATIENCE))

    def _fenced(self, node_id: str) -> None:
        for actor, copy in list(self.copies[node_id].items()):
            if self.owners[actor] != node_id:
                del self.copies[node_id][actor]
            elif copy.replaced:
                del self.copies[node_id][actor]
                self._ask(Request(actor, node_id, copy.incarnation + 1, True,
                                  self.net.now + _PATIENCE))
            else:
                copy.incarnation += 1   # restarted in place

    def _crashed(self, node_id: str) -> None:
        self.copies[node_id] = {}
        self.placed[node_id] = {}

    # ---------------------------------------------------------------- check

    def check(self) -> None:
        net = self.net
        hosts: dict[tuple[int, str], list[str]] = {}   # (group, actor) -> live nodes
        for node_id, actors in self.copies.items():
            if actors and net.nodes[node_id].alive:
                for actor in actors:
                    hosts.setdefault((net.group[node_id], actor), []).append(node_id)
        for (group, actor), nodes in hosts.items():
            if len(nodes) < 2:
                continue
            # The newest member list in the group: the master's, or the
            # last one a master of this lineage sent (no master just now).
            members = [n for n in net.ids if net.nodes[n].alive and net.group[n] == group]
            newest = max(members, key=lambda n: (
                net.nodes[n].manager.state.term,
                net.nodes[n].manager.state.role is Role.MASTER,
                net.nodes[n].manager.state.epoch))
            held_alive = {e.node_id for e in net.nodes[newest].manager.state.members
                          if e.state != "dead"}
            listed = [n for n in nodes if n in held_alive]
            if len(listed) > 1:
                raise Violation(
                    f"seed {net.seed}: actor {actor} runs on {listed[0]} and on {listed[1]}, "
                    f"in one group and both held alive by its newest member list "
                    f"(t={net.now:.3f}); rerun with PMETAL_SIM_SEED={net.seed}")

    def running(self, actor: str) -> list[str]:
        return [n for n, actors in self.copies.items()
                if actor in actors and self.net.nodes[n].alive]
