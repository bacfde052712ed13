"""pmetal: Ray-style actor clusters for the machines you own.

The public surface is ``__all__``; everything else is internal.
"""

import logging as _logging

from pmetal._version import __version__
from pmetal.actors.refs import ObjectRef
from pmetal.actors.dynamic import DynamicObjectRefGenerator
from pmetal.actors.generators import ObjectRefGenerator
from pmetal.actors.handles import ActorClass, ActorHandle, RemoteFunction, method, remote
from pmetal.actors.strategies import NodeAffinitySchedulingStrategy
from pmetal.api import (available_resources, cancel, cluster_resources, get, get_actor,
                        get_runtime_context, init, is_initialized, kill, nodes, put, shutdown,
                        wait, wait_for_peers)
from pmetal.config import PMetalConfig, SecurityConfig, TransportConfig, load_config
from pmetal import actor, exceptions
from pmetal.errors import (ActorDiedError, ActorError, ActorUnavailableError,
                           AuthenticationError, BackpressureError, ClosedError,
                           CollectiveError, ConfigError, GetTimeoutError, HandshakeError,
                           IdentityError, NotInitializedError, ObjectLostError, OwnerDiedError,
                           PeerError, PipelineError, PlacementError, PMetalError,
                           PMetalTimeoutError, PMetalTypeError, PMetalValueError, ProtocolError,
                           RemoteError, ReplayError, RequestTimeoutError,
                           RuntimeEnvSetupError, SecurityError,
                           TaskCancelledError, TransportError, WorkerCrashedError)
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

# Imported on first use: collectives need numpy, which a script that only
# uses actors should not pay for at import.
_LAZY = {
    "AutoDiscoveryBackend": "pmetal.collectives.autodiscovery",
    "CollectiveConfig": "pmetal.config",
    "CompressionConfig": "pmetal.collectives.compression",
    "CompressionStrategy": "pmetal.collectives.compression",
    "DistributedBackend": "pmetal.collectives.spmd",
    "DistributedConfig": "pmetal.collectives.spmd",
    "DistributedContext": "pmetal.collectives.spmd",
    "GradientCompressor": "pmetal.collectives.compression",
    "QuantizationType": "pmetal.collectives.compression",
    "ReduceOp": "pmetal.collectives.ops",
    "RingBackend": "pmetal.collectives.spmd",
}


def __getattr__(name: str) -> object:
    import importlib
    if name == "collective":   # the actor groups' namespace: pmetal.collective.create_group
        return importlib.import_module("pmetal.collective")
    if name in ("dag", "experimental", "util"):   # Ray's paths (ray.util.ActorPool, ...)
        return importlib.import_module(f"pmetal.{name}")   # loaded on first use
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pmetal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "ActorClass",
    "ActorDiedError",
    "ActorError",
    "ActorHandle",
    "ActorUnavailableError",
    "AuthenticationError",
    "AutoDiscoveryBackend",
    "BackpressureError",
    "ClosedError",
    "CollectiveConfig",
    "CollectiveError",
    "CompressionConfig",
    "CompressionStrategy",
    "ConfigError",
    "DistributedBackend",
    "DistributedConfig",
    "DistributedContext",
    "DynamicObjectRefGenerator",
    "GetTimeoutError",
    "GradientCompressor",
    "HandshakeError",
    "IdentityError",
    "NetworkNamespace",
    "NodeAffinitySchedulingStrategy",
    "NodeIdentity",
    "NotInitializedError",
    "ObjectLostError",
    "ObjectRef",
    "ObjectRefGenerator",
    "OwnerDiedError",
    "PMetalConfig",
    "PMetalError",
    "PMetalTimeoutError",
    "PMetalTypeError",
    "PMetalValueError",
    "PeerError",
    "PipelineError",
    "PlacementError",
    "ProtocolError",
    "QuantizationType",
    "ReduceOp",
    "RemoteError",
    "RemoteFunction",
    "ReplayError",
    "RequestTimeoutError",
    "RingBackend",
    "RuntimeEnvSetupError",
    "SecurityConfig",
    "SecurityError",
    "TaskCancelledError",
    "TransportConfig",
    "TransportError",
    "WorkerCrashedError",
    "__version__",
    "available_resources",
    "cancel",
    "cluster_resources",
    "get",
    "get_actor",
    "get_runtime_context",
    "init",
    "is_initialized",
    "kill",
    "load_config",
    "method",
    "nodes",
    "put",
    "remote",
    "shutdown",
    "wait",
    "wait_for_peers",
]
