"""Every exception pmetal raises.

All of them derive from :class:`PMetalError`, so ``except pmetal.PMetalError``
catches anything pmetal itself raised. Timeouts also derive from the builtin
:class:`TimeoutError`, configuration errors and bad argument values from
:class:`ValueError`, arguments of the wrong type from :class:`TypeError`, so
code written for Ray's builtin exceptions keeps working::

    PMetalError
    ├── ConfigError (ValueError)             bad setting or environment variable
    ├── PMetalTypeError (TypeError)          API misuse: wrong argument type, unknown option
    ├── PMetalValueError (ValueError)        API misuse: argument value out of range
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
    ├── PMetalTimeoutError (TimeoutError)
    │   ├── RequestTimeoutError              no reply before the deadline
    │   └── GetTimeoutError                  pmetal.get(timeout=...) passed
    ├── RemoteError                          user code raised in another process;
    │                                        also an instance of the original type
    ├── TaskCancelledError                   get of a ref that pmetal.cancel cancelled
    ├── ObjectLostError                      an object its owner no longer holds
    │   └── OwnerDiedError                   a borrowed object whose owner died
    ├── ActorError
    │   ├── ActorDiedError                   the actor's process died or was killed
    │   │   └── WorkerCrashedError           (Ray's name) a task's worker died
    │   └── ActorUnavailableError            (Ray's name; not raised yet)
    ├── PlacementError                       no node can host it (resources, node)
    ├── RuntimeEnvSetupError                 a runtime_env could not be set up in a
    │                                        worker (a working_dir missing or altered)
    ├── CollectiveError                      a collective operation failed: a member
    │                                        died, stalled or sent the wrong chunk
    ├── PipelineError                        pipeline inference failed: a stage died
    │                                        or stalled, or a sequence failed
    └── NotInitializedError                  pmetal.init() has not been called

Ray's names for these classes live in :mod:`pmetal.exceptions`.

The split between :class:`ClosedError` and :class:`PeerError` follows trio's
``ClosedResourceError`` and ``BrokenResourceError``: the first is a bug or a
shutdown on our side, the second is something the remote end did.
"""

from __future__ import annotations

__all__ = [
    "ActorDiedError",
    "ActorError",
    "ActorUnavailableError",
    "AuthenticationError",
    "BackpressureError",
    "ClosedError",
    "CollectiveError",
    "ConfigError",
    "GetTimeoutError",
    "HandshakeError",
    "IdentityError",
    "NotInitializedError",
    "ObjectLostError",
    "OwnerDiedError",
    "PMetalError",
    "PMetalTimeoutError",
    "PMetalTypeError",
    "PMetalValueError",
    "PeerError",
    "PipelineError",
    "PlacementError",
    "ProtocolError",
    "RemoteError",
    "ReplayError",
    "RequestTimeoutError",
    "RuntimeEnvSetupError",
    "SecurityError",
    "TaskCancelledError",
    "TransportError",
    "WorkerCrashedError",
]


class PMetalError(Exception):
    """Root of every exception raised by pmetal."""


class ConfigError(PMetalError, ValueError):
    """A configuration value or ``PMETAL_*`` environment variable is invalid."""


class PMetalTypeError(PMetalError, TypeError):
    """A pmetal API was called with an argument of the wrong type, or an
    option it does not know (``pmetal.get(5)``, ``get_actor(123)``,
    ``@pmetal.remote(num_cpu=1)``)."""


class PMetalValueError(PMetalError, ValueError):
    """A pmetal API argument has the right type but a value it cannot take
    (a negative resource amount, ``num_returns`` out of range, a name no
    live actor has)."""


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


class GetTimeoutError(PMetalTimeoutError):
    """``pmetal.get(..., timeout=...)`` passed before the result arrived. The
    call itself goes on; ``get`` may be called again."""


class RemoteError(PMetalError):
    """User code raised an exception in another process.

    ``get`` raises an instance of a class derived from both this and the
    original exception type (when that type can be subclassed), so both
    ``except RemoteError`` and ``except ValueError`` catch a remote
    ``ValueError``. ``remote_traceback`` holds the traceback text from the
    remote process; ``cause`` the original exception when it could be
    unpickled here.
    """

    def __init__(self, error_type: str, message: str, remote_traceback: str = "", *,
                 cause: BaseException | None = None) -> None:
        # Exception.__init__, not super(): in the dual class made for a remote
        # ValueError (or a user's exception type) super() would reach the
        # original type's __init__, whose signature is unknown.
        Exception.__init__(self, error_type, message)
        self.error_type = error_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        self.cause = cause

    def __str__(self) -> str:
        text = f"{self.error_type}: {self.remote_message}"
        if self.remote_traceback:
            text += "\n\nRemote traceback (most recent call last):\n" + self.remote_traceback
        return text

    def __reduce__(self) -> tuple:
        return (RemoteError, (self.error_type, self.remote_message, self.remote_traceback))


class ActorError(PMetalError):
    """An actor cannot serve a call."""


class ActorDiedError(ActorError):
    """The actor's process died (crash, ``kill -9``, ``pmetal.kill``) before
    the call completed, or the actor is dead for good (no restarts left)."""


class WorkerCrashedError(ActorDiedError):
    """Ray's error for a task whose worker process died (after its
    ``max_retries``), and for the next ref of a streaming task whose worker
    died. A subclass of :class:`ActorDiedError`, so code written for either
    name catches it."""


class ActorUnavailableError(ActorError):
    """Ray's error for an actor that cannot be reached for now but may come
    back (restarting, its node unreachable). pmetal does not raise it yet:
    a call waits for the actor's next incarnation, or fails with
    :class:`ActorDiedError` when there is none."""


class TaskCancelledError(PMetalError):
    """``pmetal.get`` of a ref that ``pmetal.cancel`` cancelled (Ray's
    ``ray.get`` after ``ray.cancel``): its call was dropped before it was
    sent, or its result is discarded."""


class ObjectLostError(PMetalError):
    """An object is gone: its owner (the process that made the ref) no
    longer holds it. pmetal keeps an object only in its owner and does not
    rebuild lost objects (no lineage reconstruction)."""


class OwnerDiedError(ObjectLostError):
    """``get`` of a borrowed ref (one received inside a value) whose owner
    process died: raised as soon as the owner is known dead, naming the
    object and the owner (Ray's name)."""


class PlacementError(PMetalError):
    """No node can host the actor or task: the resources asked for exceed
    what every node has, or the named node is not in the cluster."""


class RuntimeEnvSetupError(PMetalError):
    """Ray's error for a ``runtime_env`` that could not be set up where the
    work runs: a ``working_dir`` archive that no member could send, or whose
    bytes do not match its sha256 (altered or damaged). The work did not run."""


class CollectiveError(PMetalError):
    """A collective operation (all_reduce, broadcast, ...) could not complete
    on this rank: a member died, stalled past the deadline or sent a chunk
    the plan does not expect. The buffer holds partial results; re-form the
    group over the live members and run the operation again."""


class PipelineError(PMetalError):
    """Pipeline-parallel inference failed: a stage died or stalled (every
    sequence in flight fails with it; build the pipeline again), or one
    sequence failed at a stage (its prompt does not fit its KV cache, a
    token id outside the vocabulary): that one only."""


class NotInitializedError(PMetalError):
    """An API that needs a cluster was called before ``pmetal.init()``."""
