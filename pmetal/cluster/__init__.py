"""The self-forming cluster: discovery, health, election, topology.

The pure state machines (:mod:`~pmetal.cluster.health`,
:mod:`~pmetal.cluster.election` over :mod:`~pmetal.cluster.view`,
:mod:`~pmetal.cluster.topology`) take events and a clock reading and answer
with messages and events; :mod:`~pmetal.cluster.service` is the node's shell
around them (sockets, timers, the node's callbacks), and
:mod:`~pmetal.cluster.discovery` announces and finds nodes over mDNS.
docs/cluster.md tells how they behave together.
"""

from pmetal.cluster.discovery import DiscoveredPeer, Discovery, IgnoredPeer, browse
from pmetal.cluster.election import (ElectionEvent, ElectionManager, ElectionState,
                                     ElectionStatistics, Role)
from pmetal.cluster.health import (HealthEvent, HealthMonitor, HealthStatistics, HealthStatus,
                                   HealthSummary)
from pmetal.cluster.service import ClusterService, ClusterStatistics
from pmetal.cluster.topology import ClusterTopology, ConnectionProfile, NodeProfile
from pmetal.config import ElectionConfig, HealthConfig

__all__ = [
    "ClusterService",
    "ClusterStatistics",
    "ClusterTopology",
    "ConnectionProfile",
    "DiscoveredPeer",
    "Discovery",
    "ElectionConfig",
    "ElectionEvent",
    "ElectionManager",
    "ElectionState",
    "ElectionStatistics",
    "HealthConfig",
    "HealthEvent",
    "HealthMonitor",
    "HealthStatistics",
    "HealthStatus",
    "HealthSummary",
    "IgnoredPeer",
    "NodeProfile",
    "Role",
    "browse",
]
