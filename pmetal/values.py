"""Values that cross the wire, typed: actor states, failure kinds, collective
strategies, and the address of a process.

The enums are :class:`enum.StrEnum`: a member *is* its string (``ActorState.DEAD
== "dead"``, it hashes as ``"dead"``, msgpack and JSON write ``"dead"``), so
the wire and ``pmetal status --json`` carry the same bytes as when these were
plain strings, while code names a state instead of spelling it. A message
field declared with one of them (``ActorLocation.state``, ``Failure.kind``) is
checked on decoding: a value outside the enum is a
:class:`~pmetal.errors.ProtocolError`, like a field of the wrong type.

:class:`Address` is a process's ZeroMQ TCP endpoint, ``tcp://host:port``
(``tcp://[::1]:52416`` for IPv6), parsed once where text comes in (a
``--peers`` option, a config value) and written back with :meth:`Address.url`.
On the wire addresses stay strings (``tcp://host:port``).
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

__all__ = ["ActorState", "Address", "CollectiveStrategy", "FailureKind", "host_of"]


class ActorState(enum.StrEnum):
    """Where an actor is in its life (``ActorLocation.state``, a node's
    records, ``pmetal status``)."""

    PENDING = "pending"        # placed, waiting for resources or a worker
    ALIVE = "alive"            # its constructor ran; it takes calls
    RESTARTING = "restarting"  # its process died; a new incarnation is being made
    DEAD = "dead"              # for good: killed, out of restarts, or its owner went
    MOVED = "moved"            # (a lookup's answer only) its copy here ended with a fence;
                               # its owner's node restarts it elsewhere

    @property
    def live(self) -> bool:
        """Running or about to run: neither dead nor moved."""
        return self not in (ActorState.DEAD, ActorState.MOVED)


class FailureKind(enum.StrEnum):
    """Why a request failed (``Failure.kind``); the caller raises the
    matching :mod:`pmetal.errors` exception (see pmetal.actors.refs)."""

    USER = "user"                          # the user's code raised
    ACTOR_DIED = "actor_died"              # the actor (or its process) is gone
    NO_SUCH_METHOD = "no_such_method"
    UNKNOWN_FUNCTION = "unknown_function"  # a task whose function the worker cannot load
    BAD_REQUEST = "bad_request"            # malformed, or a kind the receiver does not handle
    PLACEMENT = "placement"                # no node can ever hold what the creation needs
    NOT_FOUND = "not_found"                # no such actor, object or model piece
    TIMEOUT = "timeout"                    # e.g. a creation waited for resources too long
    CANCELLED = "cancelled"                # pmetal.cancel
    OBJECT = "object"                      # an object's value could not be produced


class CollectiveStrategy(enum.StrEnum):
    """How a collective moves data (see pmetal.collectives: one module each)."""

    RING = "ring"    # chunked reduce-scatter + all-gather: bandwidth-optimal
    TREE = "tree"    # binomial tree: latency-optimal for small buffers
    NAIVE = "naive"  # gather to one rank, broadcast back


@dataclass(frozen=True, slots=True)
class Address:
    """A TCP endpoint: ``host`` (a name, an IPv4 or an IPv6 address, without
    brackets) and ``port`` (0: any free port, when binding)."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host or any(c in self.host for c in "[]/ \t"):
            raise ValueError(f"address host {self.host!r} is not a host name or IP address")
        if type(self.port) is not int or not 0 <= self.port <= 65535:
            raise ValueError(f"address port {self.port!r} is not a port number (0-65535)")

    @classmethod
    def parse(cls, text: str, default_port: int | None = None) -> Address:
        """``tcp://host:port``, ``host:port``, ``[v6]:port`` or ``tcp://[v6]:port``;
        ``host`` alone (or ``[v6]``, or a bare IPv6 address) takes ``default_port``
        when one is given. Anything else is a ValueError that quotes ``text``."""
        if not isinstance(text, str):
            raise ValueError(f"an address is text such as tcp://192.168.1.20:52416, "
                             f"not {type(text).__name__}")
        rest = text.strip()
        scheme, sep, tail = rest.partition("://")
        if sep:
            if scheme != "tcp":
                raise ValueError(f"address {text!r}: only tcp:// addresses are supported")
            rest = tail
        host, port_text = _split(rest, text)
        if port_text is None:
            if default_port is None:
                raise ValueError(f"address {text!r} has no port: write host:port, e.g. "
                                 f"192.168.1.20:52416 (an IPv6 address in brackets: "
                                 f"[fd00::1]:52416)")
            return cls(host, default_port)
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"address {text!r}: port {port_text!r} is not a number") from None
        try:
            return cls(host, port)
        except ValueError as exc:
            raise ValueError(f"address {text!r}: {exc}") from None

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.host

    @property
    def hostport(self) -> str:
        """``host:port``, the host bracketed when it is an IPv6 address."""
        host = f"[{self.host}]" if self.is_ipv6 else self.host
        return f"{host}:{self.port}"

    def url(self) -> str:
        """``tcp://host:port``: what ZeroMQ binds and connects to, and what
        travels on the wire."""
        return f"tcp://{self.hostport}"

    def __str__(self) -> str:
        return self.url()


def host_of(address: str, default: str = "") -> str:
    """The host of ``tcp://host:port`` or ``host:port`` (an IPv6 one without
    its brackets); ``default`` when ``address`` is not one (an inproc://
    URL, garbage)."""
    try:
        return Address.parse(address).host
    except ValueError:
        return default


def _split(rest: str, text: str) -> tuple[str, str | None]:
    """(host, port text or None) of ``host:port``, ``[v6]:port``, ``[v6]``,
    a bare IPv6 address, or a host alone."""
    if rest.startswith("["):
        host, sep, after = rest[1:].partition("]")
        if not sep or not host:
            raise ValueError(f"address {text!r}: an IPv6 address in brackets needs its "
                             f"closing ']'")
        if not after:
            return host, None
        if not after.startswith(":"):
            raise ValueError(f"address {text!r}: expected ':port' after ']'")
        return host, after[1:]
    if rest.count(":") > 1:   # a bare IPv6 address: no port can be told apart
        try:
            ipaddress.IPv6Address(rest)
        except ValueError:
            raise ValueError(f"address {text!r} is not host:port (an IPv6 address with a "
                             f"port goes in brackets: [fd00::1]:52416)") from None
        return rest, None
    host, sep, port = rest.rpartition(":")
    if not sep:
        return rest, None
    return host, port
