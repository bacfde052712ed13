"""The cluster service's side of hints: where a node was told another node
answers, and the proof it takes before believing it.

A part of :class:`pmetal.cluster.service.ClusterService`, kept apart for
size (as :mod:`pmetal.cluster.roster` is of the election): these methods
run on its state. A hint (an mDNS record, a NodeJoin, a member naming its
master) makes its address a candidate
(:class:`~pmetal.cluster.candidates.Candidates`); the service dials due
candidates every tick, and a handshake that proves an id there makes that
node a peer at that address. A hint never moves, replaces, refuses or
fences a member: anyone on the LAN can announce one (docs/security.md,
"Forged mDNS records").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pmetal.cluster.candidates import Candidates, LogLimiter
from pmetal.cluster.health import HealthMonitor, HealthStatus
from pmetal.config import PMetalConfig
from pmetal.endpoint import Channel
from pmetal.errors import PMetalError
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.values import host_of

__all__ = ["Hints"]

log = logging.getLogger("pmetal.cluster.service")

_CANDIDATE_DIALS = 4  # candidate handshakes under way at most (each holds a socket)
_RESCAN = 1.0         # s between offers of the current mDNS records to the candidates


def tcp(address: str) -> str:
    """``address`` as peers advertise it: ``tcp://host:port``."""
    return address if "://" in address else f"tcp://{address}"


def host(address: str) -> str:
    """The host of ``tcp://host:port``: the source a log rate limit counts by."""
    return host_of(address, address)


class Hints:
    # State of the ClusterService these methods are part of.
    node_id: str
    address: str
    config: PMetalConfig
    health: HealthMonitor
    peers: dict[str, Any]
    candidates: Candidates
    discovery: Any
    _by_id: dict[str, str]
    _warn: LogLimiter
    _rescanned: float
    _clock: Callable[[], float]
    _identity: NodeIdentity
    _namespace: NetworkNamespace
    _transport: ZmqTransport

    if TYPE_CHECKING:   # steps of the ClusterService these methods call
        def _spawn(self, coro: Any) -> None: ...
        def _peer(self, address: str, node_id: str = "") -> Any: ...
        def _discovered(self, member: dict[str, Any], now: float) -> None: ...

    def _alive_elsewhere(self, node_id: str, address: str) -> bool:
        """Whether ``node_id`` is a member proven at another address than
        ``address`` that the failure detector does not hold dead."""
        known = self._by_id.get(node_id)
        return bool(known and known != tcp(address) and node_id in self.health
                    and self.health.status(node_id) is not HealthStatus.DEAD)

    def discovered(self, node_id: str, address: str, incarnation: int = 0,
                   resources: dict[str, Any] | None = None) -> None:
        """A hint that ``node_id`` answers at ``address``: an mDNS record, a
        NodeJoin, a member naming its master. Believed once a handshake
        there proves an id (:meth:`_try_candidate`); until then it touches
        no member, whatever id it names."""
        address = tcp(address)
        if node_id == self.node_id or address == tcp(self.address) or address in self.peers:
            return   # this node, or a node proven there already
        self.candidates.hint(address, node_id, self._clock(),
                             {"incarnation": incarnation, "resources": resources or {}})

    def withdrawn(self, record: Any) -> None:
        """The mDNS record (a DiscoveredPeer) was withdrawn (a goodbye) or
        expired: its hint ends; a member it named stays (heartbeats tell
        whether a member lives)."""
        self.candidates.withdraw(tcp(record.address), record.node_id)

    def _dial_candidates(self, now: float) -> None:
        if self.discovery is not None and now - self._rescanned >= _RESCAN:
            # Records left out while the table was full, or whose address
            # has rested, are offered again for as long as they are current.
            self._rescanned = now
            for record in self.discovery.peers():
                self.discovered(record.node_id, record.address, record.incarnation,
                                dict(record.resources))
        room = _CANDIDATE_DIALS - self.candidates.dialing()
        if room > 0 and len(self.candidates):
            for address in self.candidates.due(now, room):
                self._spawn(self._try_candidate(address))

    async def _try_candidate(self, address: str) -> None:
        """Dial a candidate address: take in the node whose id the handshake
        proves there, or back off."""
        channel: Channel | None = None
        try:
            channel = Channel(self._transport.dial(address), self._identity, self._namespace,
                              self.config)
            proven = await channel.aopen(timeout=self.config.health.dead_after)
        except BaseException as exc:
            if channel is not None:
                channel.close()
            now = self._clock()
            cand = self.candidates.get(address)
            claims = sorted(cand.claims) if cand is not None else []
            tries = cand.failures + 1 if cand is not None else 1
            if self.candidates.failed(address, now):
                self._warn.log(now, host(address), logging.WARNING,
                               "mDNS records say node(s) %s of this namespace answer at %s, "
                               "but no handshake there proved it (%d tries, last: %s); given "
                               "up: a forged record, or a node this one cannot reach",
                               ",".join(c[:8] for c in claims[:4]) +
                               (f" and {len(claims) - 4} more" if len(claims) > 4 else ""),
                               address, tries, exc)
            else:
                log.debug("candidate %s: no handshake (%s)", address, exc)
            if not isinstance(exc, PMetalError):
                raise
            return
        self._admit(address, proven, channel)

    def _admit(self, address: str, proven: str, channel: Channel) -> None:
        """A handshake at ``address`` proved ``proven``: a peer now, there,
        unless that id is ours (the address is given up) or is alive at
        another address (asked again later, with backoff)."""
        now = self._clock()
        if address in self.peers:      # proven meanwhile (its Beat, a view)
            channel.close()
            self.candidates.discard(address)
            return
        if proven == self.node_id:     # a record names another id at our address
            channel.close()
            self.candidates.give_up(address, now)
            return
        if self._alive_elsewhere(proven, address):
            # A clone, or a node that restarted here while its old address
            # is not yet silent: ask again later; by then the old one is
            # dead (it moves here) or the clone is still refused.
            channel.close()
            self.candidates.failed(address, now)
            log.debug("candidate %s proved %s, alive at %s", address, proven[:8],
                      self._by_id.get(proven))
            return
        claims = self.candidates.proven(address)
        peer = self._peer(address, proven)
        if peer.channel is None:
            peer.channel = channel
        else:
            channel.close()
        claim = claims.get(proven, {})
        self._discovered({"node_id": proven, "address": address,
                          "incarnation": claim.get("incarnation", 0),
                          "resources": claim.get("resources", {})}, now)
