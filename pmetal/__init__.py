"""pmetal: Ray-style actor clusters for the machines you own.

The public surface is ``__all__``; everything else is internal.
"""

import logging as _logging

from pmetal._version import __version__
from pmetal.config import PMetalConfig, SecurityConfig, TransportConfig, load_config
from pmetal.errors import (AuthenticationError, BackpressureError, ClosedError, ConfigError,
                           HandshakeError, IdentityError, PeerError, PMetalError,
                           PMetalTimeoutError, ProtocolError, ReplayError, RequestTimeoutError,
                           SecurityError, TransportError)
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [
    "AuthenticationError",
    "BackpressureError",
    "ClosedError",
    "ConfigError",
    "HandshakeError",
    "IdentityError",
    "NetworkNamespace",
    "NodeIdentity",
    "PMetalConfig",
    "PMetalError",
    "PMetalTimeoutError",
    "PeerError",
    "ProtocolError",
    "ReplayError",
    "RequestTimeoutError",
    "SecurityConfig",
    "SecurityError",
    "TransportConfig",
    "TransportError",
    "__version__",
    "load_config",
]
