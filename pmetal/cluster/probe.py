"""The node's side of the topology: following the member list, and the
on-demand bandwidth probe (``pmetal status --probe``).

:func:`probe_bandwidth` times ``Probe`` messages of the sizes
:func:`~pmetal.cluster.topology.probe_plan` gives, on a connection of its own:
megabytes queued ahead of the Beats on theirs would delay them past
``health.dead_after`` on a slow link, and the failure detector would take
the peer for dead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from pmetal.cluster.topology import ClusterTopology, NodeProfile, bandwidth_from, probe_plan
from pmetal.cluster.view import MemberEntry
from pmetal.config import PMetalConfig
from pmetal.endpoint import Channel
from pmetal.errors import PMetalError
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.wire import Probe

__all__ = ["follow_members", "probe_bandwidth"]

log = logging.getLogger(__name__)


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
