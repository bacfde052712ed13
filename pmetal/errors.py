"""Every exception pmetal raises.

All of them derive from :class:`PMetalError`, so ``except pmetal.PMetalError``
catches anything pmetal itself raised. Timeouts also derive from the builtin
:class:`TimeoutError`, configuration errors from :class:`ValueError`::

    PMetalError
    ├── ConfigError (ValueError)             bad setting or environment variable
    ├── ProtocolError                        malformed, unknown, oversize message
    ├── IdentityError                        node key file missing, corrupt, unsafe
    ├── SecurityError
    │   ├── HandshakeError                   peer failed to prove the PSK or its key
    │   └── AuthenticationError              message MAC wrong or missing
    │       └── ReplayError                  message seen before (sequence reused)
    ├── TransportError
    │   ├── ClosedError                      *we* closed the socket or endpoint
    │   ├── PeerError                        *the peer* broke it: refused, gone
    │   └── BackpressureError                peer not draining; send queue full
    └── PMetalTimeoutError (TimeoutError)
        └── RequestTimeoutError              no reply before the deadline

The split between :class:`ClosedError` and :class:`PeerError` follows trio's
``ClosedResourceError`` and ``BrokenResourceError``: the first is a bug or a
shutdown on our side, the second is something the remote end did.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "BackpressureError",
    "ClosedError",
    "ConfigError",
    "HandshakeError",
    "IdentityError",
    "PMetalError",
    "PMetalTimeoutError",
    "PeerError",
    "ProtocolError",
    "ReplayError",
    "RequestTimeoutError",
    "SecurityError",
    "TransportError",
]


class PMetalError(Exception):
    """Root of every exception raised by pmetal."""


class ConfigError(PMetalError, ValueError):
    """A configuration value or ``PMETAL_*`` environment variable is invalid."""


class ProtocolError(PMetalError):
    """A message could not be decoded: garbage, truncated, unknown kind,
    wrong protocol version, oversize, or buffers that do not match the
    envelope. The receiver drops the message and keeps serving others."""


class IdentityError(PMetalError):
    """The node key file cannot be used (corrupt, unsafe permissions, ...)."""


class SecurityError(PMetalError):
    """A peer failed a security check."""


class HandshakeError(SecurityError):
    """The namespace handshake failed: wrong PSK, bad signature, refused."""


class AuthenticationError(SecurityError):
    """A message on an established session failed authentication."""


class ReplayError(AuthenticationError):
    """A message arrived with a sequence number already used (a replay)."""


class TransportError(PMetalError):
    """Sending or receiving failed."""


class ClosedError(TransportError):
    """The socket, channel or endpoint was closed by this process."""


class PeerError(TransportError):
    """The peer refused us, vanished, or broke the session."""


class BackpressureError(TransportError):
    """The peer is not draining its queue; the send could not be queued
    before its deadline. Nothing was sent; retry later or slow down."""


class PMetalTimeoutError(PMetalError, TimeoutError):
    """A pmetal operation did not finish before its deadline."""


class RequestTimeoutError(PMetalTimeoutError):
    """No reply to a request arrived before its deadline."""
