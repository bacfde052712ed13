"""An in-memory network of ElectionManagers on simulated time.

Every node is an :class:`~pmetal.cluster.election.ElectionManager` wrapped in
the smallest shell that does what the node daemon's does: it ticks every
``health.interval``, sends its Beat to every other node, runs a failure
detector (a peer silent for ``health.dead_after`` is dead) that feeds
``peer_dead``, and answers "fenced" with ``fence`` and a new incarnation.
Messages are delayed and lost at random; nodes crash and restart (a
restarted node is a new manager with a new incarnation and no memory); the
network splits into groups and heals. Everything random comes from one
seeded generator, so a seed replays a run exactly.

While it runs, :class:`SimNet` records which node became master in each
term, over the whole run and across restarts, and raises
:class:`Violation` as soon as a term has two. It also checks that a
master keeps its role only while it can reach a quorum of its member list:
once the network has not changed for :meth:`SimNet.settle` seconds, a
master cut off from its quorum (check-quorum should have stepped it down)
is a violation too.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pmetal.cluster.election import ElectionEvent, ElectionManager, Outgoing, Role
from pmetal.cluster.view import has_quorum
from pmetal.config import ElectionConfig, HealthConfig
from pmetal.wire import Beat, Message

_TICK = 0
_DELIVER = 1
_CALL = 2


class Violation(AssertionError):
    pass


@dataclass
class SimNode:
    node_id: str
    manager: ElectionManager
    incarnation: int
    alive: bool = True
    heard: dict[str, float] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    tick_seq: int = 0   # ticks scheduled for an earlier life are ignored
    master_since: float = -1.0


class SimNet:
    def __init__(self, n: int, seed: int, *, loss: float = 0.0, max_delay: float = 0.0,
                 election: ElectionConfig | None = None, health: HealthConfig | None = None,
                 ids: Iterable[str] | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.loss = loss
        self.max_delay = max_delay
        self.election = election or ElectionConfig()
        self.health = health or HealthConfig()
        self.now = 0.0
        self._queue: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.ids = list(ids) if ids is not None else [f"n{i}" for i in range(n)]
        self.group: dict[str, int] = dict.fromkeys(self.ids, 0)
        self.masters: dict[int, str] = {}           # term -> the node elected in it
        self.log: list[tuple[float, str, ElectionEvent]] = []
        self.messages = 0
        self.changed_at = 0.0       # the last crash, restart, partition or heal
        self.nodes: dict[str, SimNode] = {}
        # Hooks of a layer above the election (tests/cluster/simactors.py).
        self.on_fenced: Callable[[str], None] | None = None
        self.on_crash: Callable[[str], None] | None = None
        self.after_tick: Callable[[str], None] | None = None
        self.after_event: Callable[[], None] | None = None
        for node_id in self.ids:
            self.nodes[node_id] = self._new_node(node_id, 1)

    # ---------------------------------------------------------------- nodes

    def _new_node(self, node_id: str, incarnation: int) -> SimNode:
        manager = ElectionManager(self._entry(node_id, incarnation), self.election, self.health,
                                  now=self.now, rng=random.Random(self.rng.random()))
        node = SimNode(node_id, manager, incarnation)
        node.tick_seq = self._seq
        self._push(self.now + self.rng.uniform(0, self.health.interval), _TICK,
                   (node_id, node.tick_seq))
        return node

    @staticmethod
    def _entry(node_id: str, incarnation: int) -> dict[str, Any]:
        return {"node_id": node_id, "address": f"sim://{node_id}", "incarnation": incarnation,
                "resources": {}, "profile": {}}

    def add_node(self, node_id: str) -> SimNode:
        """Start one more node (it joins whatever it finds)."""
        self.ids.append(node_id)
        self.group[node_id] = 0
        self.nodes[node_id] = self._new_node(node_id, 1)
        return self.nodes[node_id]

    def crash(self, node_id: str) -> None:
        self.nodes[node_id].alive = False
        if self.on_crash is not None:
            self.on_crash(node_id)
        self.changed_at = self.now

    def restart(self, node_id: str) -> None:
        old = self.nodes[node_id]
        if self.on_crash is not None:
            self.on_crash(node_id)
        self.nodes[node_id] = self._new_node(node_id, old.incarnation + 1)
        self.changed_at = self.now

    def partition(self, *groups: Iterable[str]) -> None:
        """Split the network: nodes talk only within their group (nodes
        named in no group form one more group)."""
        self.group = dict.fromkeys(self.ids, len(groups))
        for i, g in enumerate(groups):
            for node_id in g:
                self.group[node_id] = i
        self.changed_at = self.now

    def heal(self) -> None:
        self.group = dict.fromkeys(self.ids, 0)
        self.changed_at = self.now

    @property
    def settle(self) -> float:
        """How long check-quorum may take to step down a master cut off
        from its quorum: its timeout, a tick, the last messages in flight."""
        return self.election.timeout + self.health.interval + self.max_delay + 1e-6

    def live(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.alive]

    def masters_now(self) -> list[SimNode]:
        return [n for n in self.live() if n.manager.state.role is Role.MASTER]

    # --------------------------------------------------------------- running

    def _push(self, at: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (at, self._seq, kind, payload))

    def at(self, when: float, call: Any) -> None:
        """Run ``call()`` at simulated time ``when`` (a scripted fault)."""
        self._push(when, _CALL, call)

    def run_until(self, end: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= end:
            at, _, kind, payload = heapq.heappop(queue)
            self.now = at
            if kind == _DELIVER:
                self._deliver(*payload)
            elif kind == _TICK:
                self._tick(*payload)
            else:
                payload()
            if self.after_event is not None:
                self.after_event()
        self.now = end

    def run_for(self, seconds: float) -> None:
        self.run_until(self.now + seconds)

    def run_until_true(self, predicate: Any, limit: float, step: float = 0.01) -> float:
        """Run until ``predicate()`` holds; the simulated time it took, or
        raise after ``limit`` simulated seconds."""
        start = self.now
        while not predicate():
            if self.now - start > limit:
                raise AssertionError(f"not within {limit} s of simulated time (seed {self.seed})")
            self.run_for(step)
        return self.now - start

    def _send(self, src: str, outs: list[Outgoing]) -> None:
        rng = self.rng
        group = self.group
        for o in outs:
            if o.to not in group or group[o.to] != group[src]:
                continue
            if self.loss and rng.random() < self.loss:
                continue
            self._push(self.now + rng.uniform(0, self.max_delay), _DELIVER,
                       (src, o.to, o.message))

    def _deliver(self, src: str, dst: str, message: Message) -> None:
        node = self.nodes[dst]
        if not node.alive or self.group[src] != self.group[dst]:
            return
        self.messages += 1
        node.heard[src] = self.now
        if src in node.dead:
            node.dead.discard(src)
            self._send(dst, node.manager.peer_dead(src, False, self.now))
        self._send(dst, node.manager.receive(src, message, self.now))
        self._drain(node)

    def _tick(self, node_id: str, seq: int) -> None:
        node = self.nodes[node_id]
        if not node.alive or node.tick_seq != seq:
            return
        now = self.now
        manager = node.manager
        self._send(node_id, manager.tick(now))
        if node.master_since >= 0 and manager.state.role is not Role.MASTER:
            node.master_since = -1.0
        if node.master_since >= 0 and now - max(self.changed_at, node.master_since) > self.settle:
            self._check_quorum(node)
        dead_after = self.health.dead_after
        for peer, last in node.heard.items():
            if peer not in node.dead and now - last >= dead_after:
                node.dead.add(peer)
                self._send(node_id, manager.peer_dead(peer, True, now))
        fields = manager.beat(now)
        beat = Beat(node_id, node.incarnation, f"sim://{node_id}", fields["term"],
                    fields["master"], fields["epoch"], fields["size"], now,
                    fields["master_address"])
        self._send(node_id, [Outgoing(p, "", beat) for p in self.ids if p != node_id])
        self._drain(node)
        if self.after_tick is not None:
            self.after_tick(node_id)
        self._push(now + self.health.interval, _TICK, (node_id, seq))

    def _drain(self, node: SimNode) -> None:
        for event in node.manager.events():
            self.log.append((self.now, node.node_id, event))
            if event.kind == "elected":
                node.master_since = self.now
                other = self.masters.setdefault(event.term, node.node_id)
                if other != node.node_id:
                    raise Violation(f"seed {self.seed}: term {event.term} has two masters, "
                                    f"{other} and {node.node_id} (t={self.now:.3f}); rerun "
                                    f"with PMETAL_SIM_SEED={self.seed}")
            elif event.kind == "fenced":
                if self.on_fenced is not None:
                    self.on_fenced(node.node_id)
                node.incarnation += 1
                self._send(node.node_id, node.manager.fence(self.now, node.incarnation))

    def _check_quorum(self, node: SimNode) -> None:
        group = self.group[node.node_id]
        reachable = {i for i, n in self.nodes.items() if n.alive and self.group[i] == group}
        members = [m.node_id for m in node.manager.state.members]
        if len(members) == 2:
            return   # a master of two keeps its role when it loses the other
        if not has_quorum(reachable, members):
            raise Violation(f"seed {self.seed}: {node.node_id} is still master "
                            f"{self.now - self.changed_at:.3f} s after the network changed, "
                            f"reaching only {sorted(reachable)} of its members {members} "
                            f"(t={self.now:.3f}); rerun with PMETAL_SIM_SEED={self.seed}")

    # ------------------------------------------------------------ agreement

    def agreement(self) -> str:
        """"" when every live node follows one master, with one term and one
        epoch; otherwise what differs."""
        live = self.live()
        masters = [n.node_id for n in live if n.manager.state.role is Role.MASTER]
        views = {(n.node_id, n.manager.state.master, n.manager.state.term,
                  n.manager.state.epoch) for n in live}
        if len(masters) != 1:
            return f"masters {masters}; views {sorted(views)}"
        if len({v[1:] for v in views}) != 1:
            return f"disagreement: {sorted(views)}"
        return ""
