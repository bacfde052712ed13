"""A client's links: the control channel to its node (:class:`NodeLink`) and
one data channel per worker it calls (:class:`PeerLink`).

Every :class:`~pmetal.actors.client.CoreClient` has one :class:`NodeLink`
(placement, lookups, kills, status go through it; calls and results do
not: they go straight to workers). A request fails with
:class:`~pmetal.errors.PeerError` within one wait slice once the connection
to the node has dropped and nothing listens at its address any more (the
node died: ``kill -9``), and with :class:`~pmetal.errors.RequestTimeoutError`
when the node is alive but silent past the deadline.

A client whose node cannot watch its process (another machine) holds a
lease on the actors it creates (see :mod:`pmetal.node.owners`): once a
creation's answer carries one, :meth:`NodeLink.renew` sends a one-way Ping
whenever the node has heard nothing from us for a quarter of it. It is
called from the client's flush thread and from a request that waits long
(a creation queued for resources).

A :class:`ClusterWatch` holds a long poll (:class:`~pmetal.wire.WatchCluster`)
open on a connection of its own to our node, in a thread of its own, and
keeps the set of nodes the cluster holds dead: a link to a worker on such a
node fails its pending calls with ActorDiedError within one wait slice,
even when that node stopped without closing its connections (a machine cut
off, or suspended).

A :class:`PeerLink` watches its TCP connection: when the worker's process
dies the connection drops, and the client fails every call pending on it
with :class:`~pmetal.errors.ActorDiedError`; if our node died too (a node's
death takes its workers), the error says so.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from pmetal.config import PMetalConfig
from pmetal.endpoint import Channel
from pmetal.errors import (PeerError, PMetalTimeoutError, RequestTimeoutError,
                           TransportError)
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.wire import Message, Ping
from pmetal.values import Address

if TYPE_CHECKING:
    from pmetal.actors.refs import ObjectRef
    from pmetal.actors.watch import ClusterWatch

__all__ = ["NodeLink", "PeerLink", "listening"]

log = logging.getLogger(__name__)

_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)

_TASKS = "<tasks>"          # owner of a link to a task worker

_NODE_DEAD = ("the connection to the pmetal node at {} dropped and nothing listens there any "
              "more: the node died or stopped; start it again ('pmetal start') and call "
              "pmetal.init() again")


# After the connection to our node drops, how long and how often its address
# is probed before a listener there is taken for a live node.
_SUSPECT_FOR = 5.0
_PROBE_EVERY = 0.2


def listening(address: str) -> bool:
    """Whether something accepts TCP connections at ``address`` (a dropped
    connection to a live process is re-made by ZeroMQ; a dead process's
    port refuses at once). True for an address that is not TCP: cannot tell."""
    try:
        parsed = Address.parse(address)
    except ValueError:
        return True
    try:
        socket.create_connection((parsed.host, parsed.port), timeout=1.0).close()
    except OSError:
        return False
    return True


class NodeLink:
    """The authenticated channel to our node, used under a lock of its own
    (never held while taking the client's: the client's lock may be held
    while taking this one)."""

    def __init__(self, transport: ZmqTransport, identity: NodeIdentity,
                 namespace: NetworkNamespace, config: PMetalConfig, address: str,
                 lock: threading.RLock, slice_s: float) -> None:
        self.address = address
        self._lock = lock
        self._slice = slice_s
        self._send_timeout = config.transport.send_timeout
        self._request_timeout = config.transport.request_timeout
        dialer = transport.dial(address)
        self.channel = Channel(dialer, identity, namespace, config)
        self.dead = ""
        self.node_id = self.channel.open(timeout=config.transport.connect_timeout)
        # The node's death (kill -9) drops this connection: requests waiting
        # on it fail within a slice instead of at their timeout. Taken after
        # the handshake, whose own watch tells a refused CURVE handshake
        # (another PSK) from silence.
        self._monitor = dialer.monitor_disconnects()
        self.renew_every = 0.0   # s between lease renewals (0: the node watches our pid)
        self._sent = 0.0         # when we last sent the node something
        self._suspect_until = 0.0   # after a dropped connection: probe until then
        self._next_probe = 0.0
        self.closed = False

    def request(self, body: Message, timeout: float | None = None) -> Message:
        """``body``'s answer from our node. PeerError as soon as the
        connection to the node drops (it died), RequestTimeoutError when it
        is alive but silent for ``timeout``."""
        timeout = self._request_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        channel = self.channel
        with self._lock:
            self.check()
            corr = channel.submit(body, timeout=min(timeout, self._send_timeout))
            self._sent = time.monotonic()
        # The lock is held for one slice at a time: requests of several
        # threads wait together (a lookup waiting for a restart does not
        # hold up another actor's lookup), each reading whichever reply
        # comes and filing it for its own request.
        while True:
            with self._lock:
                env = channel.take(corr)
                if env is not None:
                    return env.body
                # A creation may wait in the queue longer than our lease.
                self.renew()
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        return channel.result(corr, 0.0).body   # releases corr, raises
                    channel.pump(min(self._slice, remaining))
                except RequestTimeoutError as exc:
                    raise RequestTimeoutError(f"no reply from the node at {self.address} "
                                              f"within {timeout:.3g} s") from exc
                except PMetalTimeoutError:
                    self.check()
            time.sleep(0)   # let a thread queued on the lock in

    def _listening(self) -> bool:
        return listening(self.address)

    def gone(self) -> bool:
        """Whether our node has died (asked when a worker's connection drops:
        a node's death takes its workers with it)."""
        try:
            self.check()
        except PeerError:
            return True
        if not self._listening():
            self.dead = _NODE_DEAD.format(self.address)
        return bool(self.dead)

    def check(self) -> None:
        """Raise PeerError if the connection to our node has dropped and
        nothing listens at its address any more. Something may still
        listen there for a moment after the node's death (a child that
        inherited its socket has not exited yet), so after a drop the
        address is probed again every ``_PROBE_EVERY`` for ``_SUSPECT_FOR``."""
        if not self.dead:
            now = time.monotonic()
            while self._monitor.getsockopt(_EVENTS) & _POLLIN:
                frames = self._monitor.recv_multipart()
                if frames and int.from_bytes(frames[0][:2], "little") == zmq.EVENT_DISCONNECTED:
                    self._suspect_until, self._next_probe = now + _SUSPECT_FOR, now
            if self._suspect_until and now >= self._next_probe:
                self._next_probe = now + _PROBE_EVERY
                if not self._listening():
                    self.dead = _NODE_DEAD.format(self.address)
                elif now > self._suspect_until:
                    self._suspect_until = 0.0   # a live node: ZeroMQ reconnects
        if self.dead:
            raise PeerError(self.dead)

    def hold_lease(self, lease: float) -> None:
        """Our node gave us a lease of ``lease`` s on our actors: keep it."""
        if not self.renew_every:
            self.renew_every = lease / 4

    def renew(self) -> None:
        """Send our node a one-way Ping if it heard nothing from us for a
        quarter of our lease (takes the lock)."""
        if not self.renew_every or time.monotonic() - self._sent < self.renew_every:
            return
        with self._lock:
            if self.dead or self.closed:
                return
            try:
                self.channel.send(Ping(), timeout=self._send_timeout)
            except TransportError as exc:   # the node died: the next request says so
                log.debug("could not renew the lease on our actors: %s", exc)
                return
            self._sent = time.monotonic()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self.channel.close()   # the dialer stops and closes its monitor too


class PeerLink:
    """An authenticated channel to one worker plus a detector of its death."""

    def __init__(self, transport: ZmqTransport, identity: NodeIdentity,
                 namespace: NetworkNamespace, config: PMetalConfig, address: str,
                 node: NodeLink, on_dead: Callable[[str], None] | None = None) -> None:
        dialer = transport.dial(address)
        self.address = address
        self.node = node
        # Told the worker's process id when the link dies with a session
        # open: the client's owned objects forget it as a borrower.
        self._on_dead = on_dead
        self.channel = Channel(dialer, identity, namespace, config)
        self.socket = dialer.socket
        self.monitor = dialer.monitor_disconnects()
        self.dead = ""
        self.functions: set[str] = set()   # remote functions this worker already has
        self.refs: dict[int, ObjectRef] = {}
        # Calls queued behind calls in flight, sent together as one CallBatch.
        self.outbox: list[tuple[ObjectRef, list[Any]]] = []
        self.outbox_actor = ""
        self.streams = 0   # streams (num_returns="streaming") open on it (generators.py)
        self.owner = ""   # the actor this worker hosts, or _TASKS (see CoreClient._link_for)
        self.node_id = ""  # the node of that worker, when known
        self.watch: ClusterWatch | None = None   # set for a worker of another node

    def check(self) -> None:
        """Read connection events; a disconnect marks the link dead, and so
        does the death of the worker's node (see ClusterWatch)."""
        if self.node_dead():
            self.die(f"its node {self.node_id[:8]} was declared dead (it stopped answering "
                     f"heartbeats)")
            return
        # EVENTS, not poll(0): no system call when nothing happened.
        while self.monitor.getsockopt(_EVENTS) & _POLLIN:
            frames = self.monitor.recv_multipart()
            if frames and int.from_bytes(frames[0][:2], "little") == zmq.EVENT_DISCONNECTED:
                why = f"the connection to {self.address} dropped (its process died)"
                if self.node.gone():
                    why += f"; {self.node.dead}"
                self.die(why)

    def node_dead(self) -> bool:
        """Whether the cluster holds this worker's node dead."""
        return self.watch is not None and self.node_id in self.watch.dead

    def die(self, why: str) -> None:
        if self.dead:
            return
        self.dead = why
        peer = self.channel.peer
        if peer and self._on_dead is not None:
            self._on_dead(peer)
        self.channel.abandon()
        for ref in self.refs.values():
            ref._fail_link(why)
        for ref, _ in self.outbox:
            ref._fail_link(why)
        self.refs.clear()
        self.outbox.clear()

    def close(self) -> None:
        self.channel.close()   # the dialer stops and closes its monitor too
