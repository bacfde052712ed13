"""The self-forming cluster: discovery, health, election, topology.

The pure state machines (:mod:`~pmetal.cluster.health`,
:mod:`~pmetal.cluster.election` over :mod:`~pmetal.cluster.view`,
:mod:`~pmetal.cluster.topology`) take events and a clock reading and answer
with messages and events; :mod:`~pmetal.cluster.service` is the node's shell
around them (sockets, timers, the node's callbacks), and
:mod:`~pmetal.cluster.discovery` announces and finds nodes over mDNS.
docs/cluster.md tells how they behave together.
"""

import importlib
from typing import Any

# Loaded on first use: a node alone never needs zeroconf (tens of ms of
# imports in every pmetal.init()).
_WHERE = {
    "ClusterService": "service", "ClusterStatistics": "service",
    "ClusterTopology": "topology", "ConnectionProfile": "topology", "NodeProfile": "topology",
    "DiscoveredPeer": "discovery", "Discovery": "discovery", "IgnoredPeer": "discovery",
    "browse": "discovery",
    "ElectionEvent": "election", "ElectionManager": "election", "ElectionState": "election",
    "ElectionStatistics": "election", "Role": "election",
    "HealthEvent": "health", "HealthMonitor": "health", "HealthStatistics": "health",
    "HealthStatus": "health", "HealthSummary": "health",
    "ElectionConfig": None, "HealthConfig": None,
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pmetal.cluster' has no attribute {name!r}")
    where = _WHERE[name]
    module = importlib.import_module(f"pmetal.cluster.{where}" if where else "pmetal.config")
    return getattr(module, name)


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
