"""The node's side of the topology: following the member list, and the
bandwidth probes (on demand, ``pmetal status --probe``, and periodic).

:func:`probe_bandwidth` times ``Probe`` messages of the sizes
:func:`~pmetal.cluster.topology.probe_plan` gives, on a connection of its own:
megabytes queued ahead of the Beats on theirs would delay them past
``health.dead_after`` on a slow link, and the failure detector would take
the peer for dead.

:class:`LinkProbes` is a part of :class:`pmetal.cluster.service.ClusterService`
(as :mod:`pmetal.cluster.hints` is): which live members to measure, one at a
time on a schedule or all at once on demand, and the figures written into
its topology.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pmetal.cluster.clock import cluster_clock
from pmetal.cluster.topology import ClusterTopology, NodeProfile, bandwidth_from, probe_plan
from pmetal.cluster.view import MemberEntry
from pmetal.config import PMetalConfig
from pmetal.endpoint import Channel
from pmetal.errors import PMetalError
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.wire import Probe

__all__ = ["LinkProbes", "follow_members", "probe_bandwidth"]

log = logging.getLogger(__name__)
_service_log = logging.getLogger("pmetal.cluster.service")   # LinkProbes: the service's


def follow_members(topology: ClusterTopology, members: Iterable[MemberEntry],
                   own_id: str) -> None:
    """Make ``topology``'s nodes the listed members (this node stays),
    with the profiles their entries carry."""
    members = list(members)
    listed = {m.node_id for m in members}
    for node_id in [n for n in topology.nodes() if n not in listed and n != own_id]:
        topology.remove_node(node_id)
    for m in members:
        node_id = m.node_id
        if node_id != own_id:
            try:
                topology.add_node(NodeProfile.from_dict(dict(m.profile), node_id=node_id))
            except PMetalError as exc:   # a malformed profile: the member stays
                log.warning("member %s sent an unreadable profile: %s", node_id[:8], exc)


async def probe_bandwidth(transport: ZmqTransport, identity: NodeIdentity,
                          namespace: NetworkNamespace, config: PMetalConfig, address: str,
                          max_bytes: int = 4 << 20) -> float:
    """Bytes/s of the link to the node at ``address``."""
    channel = Channel(transport.dial(address), identity, namespace, config)
    samples = []
    try:
        for size in probe_plan(max_bytes):
            start = time.perf_counter()
            await channel.arequest(Probe(bytes(size)))
            samples.append((size, time.perf_counter() - start))
    finally:
        channel.close()
    return bandwidth_from(samples)


class LinkProbes:
    # State of the ClusterService these methods are part of.
    node_id: str
    config: PMetalConfig
    topology: ClusterTopology
    peers: dict[str, Any]
    _identity: NodeIdentity
    _namespace: NetworkNamespace
    _transport: ZmqTransport

    if TYPE_CHECKING:   # the ClusterService's
        def dead(self) -> set[str]: ...

    def _probe_targets(self) -> list[Any]:
        dead = self.dead()
        return [p for p in self.peers.values() if p.node_id and p.node_id not in dead
                and p.node_id in self.topology]

    async def probe_periodically(self, interval: float, stopping: asyncio.Event,
                                 max_bytes: int = 1 << 20, timeout: float = 10.0) -> None:
        """Measure one link at a time, each live member's in turn, so that
        each is measured about every ``interval`` seconds (the topology's
        bandwidth figures, and ``/metrics``, stay current without
        ``pmetal status --probe``). One probe moves about 3 x ``max_bytes``
        (1 MiB: a few milliseconds of a LAN link) on a connection of its
        own; until ``stopping`` is set."""
        turn = 0
        while True:
            wait = interval / max(1, len(self._probe_targets()))
            try:
                await asyncio.wait_for(stopping.wait(), wait)
                return
            except TimeoutError:
                pass
            peers = self._probe_targets()
            if not peers:
                continue
            peer = peers[turn % len(peers)]
            turn += 1
            try:
                bandwidth = await asyncio.wait_for(probe_bandwidth(
                    self._transport, self._identity, self._namespace, self.config,
                    peer.address, max_bytes), timeout)
            except (PMetalError, OSError, TimeoutError) as exc:
                _service_log.info("periodic bandwidth probe to %s failed: %r", peer.address, exc)
                continue
            self.topology.update_link(self.node_id, peer.node_id, bandwidth=bandwidth,
                                      now=cluster_clock())

    async def probe_links(self, max_bytes: int = 4 << 20, timeout: float = 10.0) -> None:
        """Measure the bandwidth of the link to every live member (the
        on-demand probe: ``pmetal status --probe``), all at once."""
        peers = self._probe_targets()
        results = await asyncio.gather(*(asyncio.wait_for(
            probe_bandwidth(self._transport, self._identity, self._namespace, self.config,
                            p.address, max_bytes), timeout) for p in peers),
            return_exceptions=True)
        for peer, result in zip(peers, results):
            if isinstance(result, BaseException):
                _service_log.warning("bandwidth probe to %s failed: %r", peer.address, result)
            else:
                self.topology.update_link(self.node_id, peer.node_id, bandwidth=result,
                                          now=cluster_clock())
