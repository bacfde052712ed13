"""The cluster service's side of pauses: holding its workers after a gap,
asking the members whether this node is still one, and fencing.

A part of :class:`pmetal.cluster.service.ClusterService`, kept apart for
size (as :mod:`pmetal.cluster.hints` is): these methods run on its state.
A gap longer than half of ``health.dead_after`` between two of the
service's own ticks is a pause (:meth:`Pauses._paused`): the others may
have declared this node dead meanwhile. A machine that slept longer than
``dead_after`` fences at once; otherwise the gate its workers read before
every call and every result is shut while the live members are asked
(:meth:`Pauses._membership`, the first answers that settle it end the
wait): still a member, the gate opens; declared dead or deposed,
:meth:`Pauses.fence` stops its actors and it rejoins as a new incarnation.
The lease of the restartable actors (:mod:`pmetal.cluster.lease`) is
renewed here every tick and confirmed the same way when it lapses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from pmetal.cluster.clock import Gate, cluster_clock, slept
from pmetal.cluster.election import ElectionManager, ElectionState, Outgoing, Role
from pmetal.cluster.eventlog import EventKind, EventLog
from pmetal.cluster.health import HealthMonitor
from pmetal.cluster.lease import Lease
from pmetal.cluster.view import MemberEntry, has_quorum
from pmetal.config import PMetalConfig
from pmetal.errors import PMetalError
from pmetal.wire import ClusterState, WatchCluster

if TYPE_CHECKING:
    from pmetal.cluster.service import _Peer
    from pmetal.endpoint import Channel

__all__ = ["Pauses"]

log = logging.getLogger("pmetal.cluster.service")


class Pauses:
    # State of the ClusterService these methods are part of.
    node_id: str
    config: PMetalConfig
    health: HealthMonitor
    election: ElectionManager
    events: EventLog
    gate: Gate | None
    lease: Lease
    incarnation: int
    discovery: Any
    _by_id: dict[str, str]
    _counts: dict[str, int]
    _echoes: dict[str, float]
    _slept: float | None
    _unconfirmed: float | None

    if TYPE_CHECKING:   # steps of the ClusterService these methods call
        def _spawn(self, coro: Any) -> None: ...
        def _peer(self, address: str, node_id: str = "") -> _Peer: ...
        def _channel(self, peer: _Peer) -> Channel: ...
        def _send_all(self, outgoing: list[Outgoing]) -> None: ...
        def _events(self, now: float) -> None: ...
        def _bump(self) -> None: ...
        def _on_fenced(self, why: str) -> None: ...

    def _paused(self, gap: float) -> None:
        """After a gap between two ticks: a machine that slept longer than
        ``dead_after`` fences at once; a node that did not run long enough
        for the others to start doubting it (half of ``dead_after``: its
        last Beat may be that old already) holds its workers until the
        cluster confirms it is still a member (:meth:`_confirm`)."""
        dead_after = self.config.health.dead_after
        before, self._slept = self._slept, slept()
        asleep = (self._slept - before) if before is not None and self._slept is not None \
            else None
        if gap <= dead_after / 2:
            return
        self._counts["pauses"] += 1
        missed = gap - self.config.health.interval
        self.health.paused(missed)
        self.election.paused(missed)
        if asleep is not None and asleep > dead_after and self._others():
            self.fence(f"this machine slept for {asleep:.1f} s (longer than health.dead_after "
                       f"= {dead_after:g} s), so the others may have declared it dead")
            return
        what = (f"the machine slept {asleep:.1f} s of it" if asleep is not None and asleep > 0.05
                else "the machine did not sleep: this process was starved of CPU or stopped"
                if asleep is not None else "this platform cannot tell a sleep")
        if self._unconfirmed is None:
            # WARNING where the others may well have declared it dead.
            log.log(logging.WARNING if gap > dead_after else logging.INFO,
                    "this node did not run for %.1f s (%s); it executes nothing until the "
                    "cluster confirms it is still a member", gap, what)
            self._unconfirmed = cluster_clock()
            if self.gate is not None:
                self.gate.hold()
            self._spawn(self._confirm())

    def _renew_lease(self, now: float) -> None:
        """Renew the lease of the restartable actors (pmetal.cluster.lease)
        and tick the gate; a lease that lapsed waits for the cluster's word."""
        if self.gate is None:
            return
        if not self.lease.renew(now, self.election.vouched(self._echoes)):
            self._counts["lapses"] += 1
            log.info("no quorum of the cluster has answered this node's Beats for %.2f s; its "
                     "restartable actors start nothing until the cluster confirms it is "
                     "still a member", now - self.lease.until + self.lease.length)
            self._spawn(self._reconfirm())
        self.gate.tick(now, self.lease.until)

    async def _reconfirm(self) -> None:
        """After a lapse: as :meth:`_confirm`, for the lease alone."""
        interval = self.config.health.interval
        while self.lease.lapsed:
            asked = cluster_clock()
            verdict = await self._membership()
            if not self.lease.lapsed:    # fenced meanwhile
                return
            if verdict == "member":
                self.lease.confirmed(asked, self.election.vouched(self._echoes))
                log.info("membership confirmed; the lease of this node's actors runs again")
                return
            if verdict:
                self.fence(verdict)
                return
            await asyncio.sleep(interval)

    @property
    def confirmed(self) -> bool:
        """False from a pause until the cluster confirmed this node."""
        return self._unconfirmed is None

    async def _confirm(self) -> None:
        """Ask the members, until one answer settles it, whether this node is
        still a member: the master's word (a master's: a quorum's) in the
        highest term heard. Still one: open the gate; not: fence."""
        interval = self.config.health.interval
        while self._unconfirmed is not None:
            verdict = await self._membership()
            if self._unconfirmed is None:    # fenced meanwhile
                return
            if verdict == "member":
                took = cluster_clock() - self._unconfirmed
                self._unconfirmed = None
                self._counts["confirmed"] += 1
                if self.gate is not None:
                    self.gate.open()
                log.info("membership confirmed %.2f s after the pause; this node carries on",
                         took)
                return
            if verdict:
                self.fence(verdict)
                return
            # No answer settled it (no master reachable, an election under
            # way): ask again after a tick's time; the gate stays shut.
            await asyncio.sleep(interval)

    async def _membership(self) -> str:
        """"member", "" (not settled yet) or why this node must fence. The
        live members are asked at once and their answers taken as they
        come: the first that settle it end the wait, so a member that died
        (still listed until the master drops it) holds up nothing. Before,
        every answer was awaited: after a master's death each confirmation
        took the dead one's timeout, longer than the lease it renewed, and
        the lease lapsed again at once (seen beside two CPU hogs)."""
        state = self.election.state
        others = self._others()
        if not others:
            return "member"   # alone: nobody could have declared it dead
        asks = []
        for m in others:
            address = self._by_id.get(m.node_id) or m.address
            if address and m.alive:
                asks.append(asyncio.ensure_future(
                    self._ask_state(self._peer(address, m.node_id))))
        answers: list[tuple[str, ClusterState]] = []
        try:
            for asked in asyncio.as_completed(asks):
                answer = await asked
                if answer is not None:
                    answers.append(answer)
                verdict = self._verdict(state, answers, complete=len(answers) == len(asks))
                if verdict is not None:
                    return verdict
            return self._verdict(state, answers, complete=True) or ""
        finally:
            pending = [a for a in asks if not a.done()]
            if pending:   # each bounded by its timeout; reaped, not cancelled mid-request
                self._spawn(asyncio.wait(pending))

    def _others(self) -> list[MemberEntry]:
        """The other members in this node's view (none: it is alone, and
        nobody could have declared it dead)."""
        return [m for m in self.election.state.members if m.node_id != self.node_id]

    def _verdict(self, state: ElectionState, answers: list[tuple[str, ClusterState]],
                 complete: bool) -> str | None:
        """What the answers so far settle (see :meth:`_membership`); None
        while more answers could change it."""
        me, term = self.node_id, state.term
        if state.role is Role.MASTER:
            if any(a.term > term or (a.term == term and a.master not in ("", me))
                   for _, a in answers):
                return (f"this node was master in term {term} before a pause, and the "
                        f"others follow another master now")
            backing = {n for n, a in answers if a.master == me and a.term == term and
                       me in a.members}
            if has_quorum(backing | {me}, [m.node_id for m in state.members], {}):
                return "member"
            return "" if complete else None
        masters = [(n, a) for n, a in answers if a.master == n]
        if not masters:
            return "" if complete else None
        master, answer = max(masters, key=lambda na: na[1].term)
        if not complete and answer.term < term:
            return None   # a deposed master's word; the current one may yet answer
        if me in answer.members and me not in answer.dead:
            return "member"
        return (f"the master {master[:8]} (term {answer.term}) no longer holds this node a "
                f"live member after its pause")

    async def _ask_state(self, peer: _Peer) -> tuple[str, ClusterState] | None:
        timeout = self.config.health.dead_after
        try:
            channel = self._channel(peer)
            if channel.session is None:
                await channel.aopen(timeout=timeout)
            reply = (await channel.arequest(WatchCluster(-1, 0.0), timeout=timeout)).body
        except PMetalError as exc:
            log.debug("no membership answer from %s: %s", peer.address, exc)
            return None
        if isinstance(reply, ClusterState) and peer.node_id:
            return peer.node_id, reply
        return None

    def fence(self, why: str) -> None:
        """This node may have been declared dead: its actors go (the
        node's ``on_fenced``) and it continues as a new incarnation."""
        self._counts["fenced"] += 1
        self.events.record(EventKind.FENCE, self.node_id, why)
        self._unconfirmed = None
        self.lease.fenced()
        if self.gate is not None:
            self.gate.fence()
        log.warning("fencing this node: %s; its actors are stopped and it rejoins as a new "
                    "incarnation", why)
        self._on_fenced(why)
        self.incarnation = time.time_ns()
        now = cluster_clock()
        self._send_all(self.election.fence(now, self.incarnation))
        if self.discovery is not None:
            try:
                self.discovery.update(incarnation=self.incarnation)
            except Exception as exc:  # noqa: BLE001 - a stale TXT record is harmless
                log.debug("could not update the announcement: %s", exc)
        self._events(now)
        self._bump()
