"""The node's cluster: heartbeats, the failure detector, the election, the
member list and discovery, around the pure state machines.

:class:`ClusterService` is the thin shell of DESIGN.md section 4. It owns:

* one :class:`_Peer` per other node it knows (members of the master's list,
  nodes discovery or static peers found, nodes whose Beat arrived), each with
  its own channel; a Beat goes to each every ``health.interval`` as a request
  whose answer (a BeatEcho) measures the link's latency;
* the failure detector (:mod:`pmetal.cluster.health`), fed with every message
  a peer sends, and the election (:mod:`pmetal.cluster.election`), fed with
  Beats, votes, views and joins; their outputs are sent here, their events
  turned into the node's callbacks (``on_view``: the member list changed;
  ``on_fenced``: this node was declared dead, so its actors must go);
* discovery (:mod:`pmetal.cluster.discovery`) when asked for, and the
  :class:`~pmetal.cluster.candidates.Candidates` its records (and members'
  words about third nodes) propose: a hint never moves, replaces, refuses
  or fences a member. A candidate address is dialled (with backoff, given
  up in the end) and the node there is taken in once the handshake proved
  its id, at that address; a member moves to a new address only that way,
  or by its own authenticated word (a Beat, from a session it opened),
  and only when it is not alive at the old one (the clone rule);
* the version of what a client must know (dead nodes, master, term, epoch),
  answered to :class:`~pmetal.wire.WatchCluster` long polls.

Every background loop belongs to the task group :meth:`run` opens; stopping
the node cancels them. A silent peer costs a Beat that times out, never a
wait of anything else: votes and views to it are sent by tasks of their own
with a deadline.

Time comes from one clock that keeps counting while the machine sleeps
(CLOCK_BOOTTIME on Linux; :mod:`pmetal.cluster.clock`). A gap longer than
half of ``health.dead_after`` between two of its own ticks is a pause: the
others may have declared this node dead meanwhile. If the machine slept
(the suspension clocks parted) longer than ``dead_after``, it fences at
once: its actors go, and it rejoins as a new incarnation. Otherwise (starved
of CPU, stopped with SIGSTOP) it does not hold the gap against its peers,
shuts the gate its workers read before every call and every result, and
asks the members whether it is still one: confirmed, it opens the gate;
declared dead or deposed, it fences.

Parts of the service live in modules of their own, run on its state as
mixins: :mod:`pmetal.cluster.hints` (candidates and their proof),
:mod:`pmetal.cluster.pauses` (pauses, the lease, confirmation, fencing) and
:class:`pmetal.cluster.probe.LinkProbes` (the bandwidth probes).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pmetal.cluster.candidates import Candidates, LogLimiter
from pmetal.cluster.clock import Gate, cluster_clock, slept
from pmetal.cluster.hints import Hints, tcp as _tcp
from pmetal.cluster.election import ElectionManager, ElectionState, Outgoing, Role
from pmetal.cluster.eventlog import EventKind, EventLog
from pmetal.cluster.health import HealthMonitor, HealthStatus
from pmetal.cluster.lease import Lease
from pmetal.cluster.pauses import Pauses
from pmetal.cluster.probe import LinkProbes, follow_members
from pmetal.cluster.topology import ClusterTopology, NodeProfile
from pmetal.cluster.view import LEASE_SHARE
from pmetal.config import PMetalConfig
from pmetal.endpoint import Channel
from pmetal.errors import HandshakeError, PMetalError
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.values import FailureKind
from pmetal.wire import (Ack, Beat, BeatEcho, ClusterState, ClusterView, Failure, JoinCluster,
                         Message, Probe, Vote, VoteRequest, WatchCluster)

__all__ = ["ClusterService", "ClusterStatistics", "cluster_clock"]

log = logging.getLogger(__name__)

_SEND_TIMEOUT = 1.0   # s a vote or view may wait for a peer's socket


@dataclass
class _Peer:
    """A node whose id a handshake proved at ``address`` (or that said so in
    its own authenticated Beat), or a static peer (id unknown until its
    first handshake)."""

    address: str
    node_id: str = ""
    channel: Channel | None = None
    beating: bool = False          # a Beat is in flight


@dataclass(frozen=True, slots=True)
class ClusterStatistics:
    beats_sent: int
    beats_failed: int
    beats_received: int
    messages_sent: int
    sends_failed: int
    fenced: int
    clones_refused: int
    version: int
    candidates: int = 0        # addresses hinted, not yet proven
    candidate_dials: int = 0
    candidate_failures: int = 0
    candidates_proven: int = 0
    candidates_given_up: int = 0
    hints_left_out: int = 0
    pauses: int = 0            # tick gaps over dead_after / 2 (slept, starved, stopped)
    confirmed: int = 0         # pauses after which the cluster confirmed this node
    lapses: int = 0            # leases that expired (no quorum answered in time)


class ClusterService(Hints, Pauses, LinkProbes):
    def __init__(self, *, config: PMetalConfig, identity: NodeIdentity,
                 namespace: NetworkNamespace, transport: ZmqTransport, address: str,
                 resources: dict[str, float], profile: dict[str, Any],
                 static_peers: list[str], on_view: Callable[[ElectionState], None],
                 on_fenced: Callable[[str], None], on_dead: Callable[[str], None],
                 on_refused: Callable[[str, str], None] | None = None,
                 bootstrap: float | None = None, gate: Gate | None = None) -> None:
        self.config = config
        self.node_id = identity.node_id
        self._identity = identity
        self._namespace = namespace
        self._transport = transport
        self.address = address
        self.resources = resources
        self.profile = profile
        self.incarnation = time.time_ns()
        self._static = [_tcp(a) for a in static_peers]
        self._on_view = on_view
        self._on_fenced = on_fenced
        self._on_dead = on_dead
        refused = on_refused or (lambda address, reason: None)
        # What happened, for the dashboard (pmetal.cluster.eventlog).
        self.events = EventLog()

        def _refused(address: str, reason: str) -> None:
            self.events.record(EventKind.REFUSAL, "", f"{address}: {reason}")
            refused(address, reason)
        self._on_refused = _refused
        now = cluster_clock()
        self.started = now
        self.health = HealthMonitor(config.health, now)
        election_config = config.election
        if bootstrap is not None:
            from dataclasses import replace
            election_config = replace(election_config, bootstrap=bootstrap)
        self.election = ElectionManager(self._me(), election_config, config.health, now=now,
                                        rng=random.Random())
        self.topology = ClusterTopology()
        self.topology.add_node(NodeProfile.from_dict(profile, node_id=self.node_id))
        self._rtts: dict[str, collections.deque[float]] = {}   # node id -> recent round trips
        self.peers: dict[str, _Peer] = {}      # address -> peer
        self._by_id: dict[str, str] = {}       # node id -> address (proven)
        self.candidates = Candidates(config.discovery)
        self._warn = LogLimiter(log)
        self._clock = cluster_clock
        self._rescanned = now
        self.version = 0
        self._changed = asyncio.Event()
        self._last_tick = now
        self._slept = slept()
        self.gate = gate
        self._unconfirmed: float | None = None   # when a pause was found, until confirmed
        # The lease of the restartable actors (pmetal.cluster.lease), from
        # the send time of the last Beat each member echoed.
        self.lease = Lease(config.health.dead_after * LEASE_SHARE)
        self._echoes: dict[str, float] = {}
        self._group: asyncio.TaskGroup | None = None
        self._counts = {"beats_sent": 0, "beats_failed": 0, "beats_received": 0,
                        "messages_sent": 0, "sends_failed": 0, "fenced": 0,
                        "clones_refused": 0, "pauses": 0, "confirmed": 0, "lapses": 0}
        self.discovery: Any = None
        self.first_seen: dict[str, float] = {}   # node id -> when we first heard of it
        self.elected_at: float | None = None

    # ---------------------------------------------------------------- state

    def _me(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "address": self.address,
                "incarnation": self.incarnation, "resources": dict(self.resources),
                "profile": dict(self.profile)}

    @property
    def state(self) -> ElectionState:
        return self.election.state

    @property
    def master(self) -> str:
        return self.election.state.master

    @property
    def term(self) -> int:
        return self.election.state.term

    def is_master(self) -> bool:
        return self.election.state.role is Role.MASTER

    def dead(self) -> set[str]:
        """Nodes this node's detector or the master's list holds dead."""
        dead = set(self.health.dead())
        dead.update(m.node_id for m in self.election.state.members if not m.alive)
        dead.discard(self.node_id)
        return dead

    def cluster_state(self) -> ClusterState:
        s = self.election.state
        dead = self.dead()
        members = tuple(sorted(m.node_id for m in s.members
                               if m.node_id not in dead and m.alive))
        return ClusterState(self.version, tuple(sorted(dead)), s.master, s.term, s.epoch,
                            members)

    def statistics(self) -> ClusterStatistics:
        c = self.candidates.statistics()
        return ClusterStatistics(**self._counts, version=self.version, candidates=c.candidates,
                                 candidate_dials=c.dials, candidate_failures=c.failures,
                                 candidates_proven=c.proven, candidates_given_up=c.given_up,
                                 hints_left_out=c.left_out)

    def describe(self) -> dict[str, Any]:
        """The cluster for ``pmetal status``: master, term, epoch, every member
        with its health as this node sees it."""
        s = self.election.state
        health = {h.node_id: h for h in self.health.summary()}
        members = []
        for m in s.members:
            h = health.get(m.node_id)
            members.append({
                "node_id": m.node_id, "address": m.address, "incarnation": m.incarnation,
                "state": m.state,
                "health": ("self" if m.node_id == self.node_id else
                           h.status.value if h is not None else "unknown"),
                "rtt_ms": (round(h.rtt * 1000, 3) if h is not None and h.rtt is not None
                           else None),
                "resources": dict(m.resources), "profile": dict(m.profile),
            })
        return {"master": s.master, "term": s.term, "epoch": s.epoch, "role": s.role.value
                if hasattr(s.role, "value") else str(s.role), "members": members,
                "incarnation": self.incarnation, "version": self.version,
                "discovery": (self.discovery.interfaces if self.discovery is not None
                              else None),
                "timeouts": {"dead_after": self.config.health.dead_after,
                             "interval": self.config.health.interval,
                             "election": self.config.election.timeout},
                "discovered": sorted(self._by_id),
                "candidates": self.candidates.addresses(),
                "discovery_statistics": (dataclasses.asdict(self.discovery.statistics())
                                         if self.discovery is not None else None),
                "found": {n: round(t - self.started, 3) for n, t in self.first_seen.items()},
                "topology": self.topology.to_dict(),
                "ring": self.topology.best_ring(),
                "ignored": ([dataclasses.asdict(i) for i in self.discovery.ignored()]
                            if self.discovery is not None else []),
                "statistics": dataclasses.asdict(self.statistics())}

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def watch(self, body: WatchCluster) -> Message:
        """The WatchCluster long poll: answer once past ``body.version``."""
        if self.version <= body.version:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), max(0.0, min(body.wait, 60.0)))
            except asyncio.TimeoutError:
                pass
        return self.cluster_state()

    async def changed(self) -> None:
        """Returns at the next change of what clients see (see version)."""
        await self._changed.wait()

    async def wait_master(self, deadline: float) -> str:
        """The master's node id once there is one; "" at ``deadline``
        (time.monotonic)."""
        while not self.master:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ""
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                return ""
        return self.master

    async def until_gone(self, node_id: str) -> None:
        """Returns once ``node_id`` is dead or no longer the master."""
        while node_id not in self.dead() and (self.master == node_id or
                                              node_id == self.node_id):
            await self._changed.wait()
        return None

    # -------------------------------------------------------------- running

    async def run(self, stopping: asyncio.Event, discovery: Any = None) -> None:
        """Beat, tick and send until ``stopping`` is set (then the peers'
        tasks are cancelled with the group)."""
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                for address in self._static:
                    self._peer(address)
                if discovery is not None:
                    self.discovery = discovery
                    await discovery.start()
                group.create_task(self._ticks(stopping))
                await stopping.wait()
                raise _Stopped
        except* _Stopped:
            pass
        finally:
            self._group = None
            if self.discovery is not None:
                try:
                    await asyncio.wait_for(self.discovery.close(), 2.0)
                except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - best effort
                    log.debug("discovery did not close cleanly: %s", exc)
            for peer in self.peers.values():
                if peer.channel is not None:
                    peer.channel.close()

    async def _ticks(self, stopping: asyncio.Event) -> None:
        interval = self.config.health.interval
        # Time between construction and the first tick is not a pause.
        self._last_tick, self._slept = cluster_clock(), slept()
        while not stopping.is_set():
            now = cluster_clock()
            self._paused(now - self._last_tick)
            self._last_tick = now
            self._renew_lease(now)
            self._handle_health(self.health.tick(now), now)
            self._send_all(self.election.tick(now))
            self._events(now)
            for peer in list(self.peers.values()):
                if not peer.beating:
                    peer.beating = True
                    self._spawn(self._beat(peer))
            self._dial_candidates(now)
            try:
                await asyncio.wait_for(stopping.wait(), interval)
            except asyncio.TimeoutError:
                pass

    def _spawn(self, coro: Any) -> None:
        if self._group is None:
            coro.close()
            return
        self._group.create_task(self._guarded(coro))

    @staticmethod
    async def _guarded(coro: Any) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a peer's failure never ends the service
            log.error("a cluster task failed", exc_info=exc)

    def _peer(self, address: str, node_id: str = "") -> _Peer:
        address = _tcp(address)
        peer = self.peers.get(address)
        if peer is None:
            if node_id and node_id in self._by_id and self._by_id[node_id] != address:
                # The node moved (a restart on another port): forget the old address.
                old = self.peers.pop(self._by_id[node_id], None)
                if old is not None and old.channel is not None:
                    old.channel.close()
            peer = self.peers[address] = _Peer(address, node_id)
        if node_id and not peer.node_id:
            peer.node_id = node_id
        if peer.node_id:
            self._by_id[peer.node_id] = address
        return peer

    def _channel(self, peer: _Peer) -> Channel:
        if peer.channel is None:
            peer.channel = Channel(self._transport.dial(peer.address), self._identity,
                                   self._namespace, self.config)
        return peer.channel

    def _drop_channel(self, peer: _Peer) -> None:
        if peer.channel is not None:
            peer.channel.close()
            peer.channel = None

    async def _beat(self, peer: _Peer) -> None:
        health = self.config.health
        try:
            channel = self._channel(peer)
            fields = self.election.beat(cluster_clock())
            beat = Beat(self.node_id, self.incarnation, self.address, fields["term"],
                        fields["master"], fields["epoch"], fields["size"], cluster_clock(),
                        fields.get("master_address", ""))
            self._counts["beats_sent"] += 1
            try:
                if channel.session is None:
                    await channel.aopen(timeout=health.dead_after)
                    if channel.peer is not None and channel.peer != peer.node_id:
                        self._peer(peer.address, channel.peer)
                reply = (await channel.arequest(beat, timeout=health.dead_after)).body
            except HandshakeError as exc:
                self._counts["beats_failed"] += 1
                self._on_refused(peer.address, f"handshake refused: {exc} (another PSK or "
                                               f"namespace?)")
                self._drop_channel(peer)
                return
            except PMetalError as exc:
                self._counts["beats_failed"] += 1
                if channel.session is None and peer.address in self._static \
                        and not peer.node_id:
                    self._on_refused(peer.address, f"no answer from {peer.address}: another "
                                                   f"PSK or namespace, not a pmetal node, or "
                                                   f"not started yet ({exc})")
                log.debug("no Beat answer from %s: %s", peer.address, exc)
                self._drop_channel(peer)
                return
            if isinstance(reply, BeatEcho):
                now = cluster_clock()
                rtt = now - reply.sent
                if reply.sent > self._echoes.get(reply.node_id, float("-inf")):
                    self._echoes[reply.node_id] = reply.sent
                self._heard(reply.node_id, now, rtt=rtt)
                recent = self._rtts.setdefault(reply.node_id, collections.deque(maxlen=20))
                recent.append(rtt)
                # One-way latency: half the median of the last round trips (one
                # slow beat, a busy moment of either node, does not move it).
                self.topology.update_link(self.node_id, reply.node_id,
                                          latency=statistics.median(recent) / 2, now=now)
            elif isinstance(reply, Failure):
                self._counts["beats_failed"] += 1
                self._on_refused(peer.address, f"refused our Beat: {reply.message}")
        finally:
            peer.beating = False

    def _send_all(self, outgoing: list[Outgoing]) -> None:
        for out in outgoing:
            address = out.address or self._by_id.get(out.to, "")
            if not address or out.to == self.node_id:
                continue
            peer = self._peer(address, out.to)
            self._spawn(self._send(peer, out.message))

    async def _send(self, peer: _Peer, message: Message) -> None:
        term = getattr(message, "term", None)
        try:
            channel = self._channel(peer)
            if channel.session is None:
                await channel.aopen(timeout=_SEND_TIMEOUT)
            await channel.asend(message, term=term if isinstance(term, int) else None,
                                timeout=_SEND_TIMEOUT)
            self._counts["messages_sent"] += 1
        except PMetalError as exc:
            self._counts["sends_failed"] += 1
            log.debug("could not send a %s to %s: %s", type(message).__name__, peer.address,
                      exc)
            self._drop_channel(peer)

    # ------------------------------------------------------------ receiving

    def receive(self, sender: str, body: Message) -> Message | None:
        """A cluster message from ``sender`` (the id it proved): the answer,
        if one is due."""
        now = cluster_clock()
        kind = type(body)
        if kind is Beat:
            self._counts["beats_received"] += 1
            if body.node_id != sender:  # type: ignore[attr-defined]
                raise ValueError(f"a Beat for node {body.node_id[:8]} came from node "  # type: ignore[attr-defined]
                                 f"{sender[:8]}; a node beats as itself")
            known = sender in self._by_id
            clone = self._clone(sender, body.address)  # type: ignore[attr-defined]
            if clone:
                return Failure(FailureKind.BAD_REQUEST, "PeerError", clone)
            self._peer(body.address, sender)  # type: ignore[attr-defined]
            self.candidates.discard(_tcp(body.address))  # type: ignore[attr-defined]
            if not known:
                self._discovered({"node_id": sender, "address": body.address,  # type: ignore[attr-defined]
                                  "incarnation": body.incarnation}, now)  # type: ignore[attr-defined]
            self._heard(sender, now)
            master, master_address = body.master, body.master_address  # type: ignore[attr-defined]
            if master and master_address and master != self.node_id \
                    and master not in self._by_id:
                # A node that knows only a follower (one static peer) learns of
                # the master here: beating it is how the master takes it in.
                self.discovered(master, master_address)
            self._send_all(self.election.receive(sender, body, now))
            self._events(now)
            return BeatEcho(self.node_id, body.sent)  # type: ignore[attr-defined]
        if kind in (VoteRequest, Vote, ClusterView, JoinCluster):
            self._heard(sender, now)
            self._send_all(self.election.receive(sender, body, now))
            self._events(now)
            return None
        if kind is Probe:
            return Ack(len(body.payload))  # type: ignore[attr-defined]
        raise ValueError(f"the cluster does not handle {kind.__name__} messages")

    def _clone(self, node_id: str, address: str) -> str:
        """Why a Beat from ``node_id`` at ``address`` is refused ("" if it is
        not): that id is a live member at another address, so two nodes
        share one identity. (A member that restarted elsewhere is silent at
        its old address, hence Dead, and is let in.)"""
        if not self._alive_elsewhere(node_id, address):
            return ""
        known = self._by_id.get(node_id)
        self._counts["clones_refused"] += 1
        self.events.record(EventKind.REFUSAL, node_id, f"a cloned identity at {address}: "
                                                       f"already a live member at {known}")
        if self._counts["clones_refused"] == 1 or log.isEnabledFor(logging.DEBUG):
            log.warning("refused node %s at %s: that id is a live member at %s (a cloned "
                        "identity?)", node_id[:8], address, known)
        return (f"refused: node id {node_id} is already a live member at {known}: two nodes "
                f"share one identity (a cloned disk, VM or PMETAL_HOME?); give each node its "
                f"own ~/.pmetal/node_keypair")

    def _discovered(self, member: dict[str, Any], now: float) -> None:
        node_id = member["node_id"]
        if node_id not in self.first_seen:
            self.first_seen[node_id] = now
            log.info("found node %s at %s", node_id[:8], member.get("address"))
        self._send_all(self.election.discovered(member, now))
        self._events(now)

    def _heard(self, node_id: str, now: float, rtt: float | None = None) -> None:
        if not node_id or node_id == self.node_id:
            return
        self.first_seen.setdefault(node_id, now)
        if node_id not in self.health:
            self.health.watch(node_id, now)
        self.election.heard(node_id, now)
        self._handle_health(self.health.heard(node_id, now, rtt), now)

    def _handle_health(self, events: list[Any], now: float) -> None:
        for ev in events:
            if ev.status is HealthStatus.DEAD:
                log.warning("node %s is dead: silent for %.2f s", ev.node_id[:8], ev.silent_for)
                self.events.record(EventKind.DEATH, ev.node_id,
                                   f"silent for {ev.silent_for:.2f} s")
                self._send_all(self.election.peer_dead(ev.node_id, True, now))
                self._on_dead(ev.node_id)
                self._bump()
            elif ev.previous is HealthStatus.DEAD:
                log.info("node %s answers again", ev.node_id[:8])
                self.events.record(EventKind.RECOVERY, ev.node_id, "answers again")
                self._send_all(self.election.peer_dead(ev.node_id, False, now))
                # The node forgot it when it was held dead; if the master's
                # list still holds it a member, it is one again now, not at
                # the list's next change (7.5 s later in one run, while a
                # driver's lookups of the actor it hosted said "no actor").
                self._on_view(self.election.state)
                self._bump()
        if events:
            self._events(now)

    def _events(self, now: float) -> None:
        for ev in self.election.events():
            if ev.kind == "elected":
                log.info("this node is the master (term %d)", ev.term)
                if self.elected_at is None:
                    self.elected_at = now
            elif ev.kind == "master":
                log.info("master is %s (term %d)", ev.master[:8], ev.term)
                self.events.record(EventKind.ELECTION, ev.master, f"master in term {ev.term}")
            elif ev.kind == "no_master":
                log.warning("no master (term %d): %s", ev.term, ev.detail)
                self.events.record(EventKind.ELECTION, "", f"no master (term {ev.term}): "
                                                           f"{ev.detail}")
            elif ev.kind == "view":
                state = self.election.state
                self.events.members(state.members, state.epoch)
                self._view_topology(state)
                for m in state.members:
                    node_id, address = m.node_id, m.address
                    if node_id != self.node_id and address:
                        self._peer(address, node_id)
                        if node_id not in self.health:
                            self.health.watch(node_id, now)
                self._on_view(state)
            elif ev.kind == "fenced":
                self.fence(ev.detail or "the master declared this node dead")
            elif ev.kind == "refused":
                log.warning("cluster join refused: %s", ev.detail)
                self.events.record(EventKind.REFUSAL, "", f"join refused: {ev.detail}")
            self._bump()

    def _view_topology(self, state: ElectionState) -> None:
        follow_members(self.topology, state.members, self.node_id)



class _Stopped(Exception):
    """Ends the service's task group when the node stops."""
