"""What a client knows of the cluster: the nodes declared dead, the master,
the members (:class:`ClusterWatch`), and the error of a
:func:`pmetal.wait_for_peers` that timed out (:func:`peers_missing`).

A :class:`ClusterWatch` holds a long poll (:class:`~pmetal.wire.WatchCluster`)
on a connection of its own to the client's node, in a thread of its own: the
node answers as soon as what a client must know changes (a node declared
dead, a new master, a new member list). Links to workers of a dead node fail
their calls within one wait slice (:meth:`~pmetal.actors.links.PeerLink.check`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import zmq

from pmetal.config import PMetalConfig
from pmetal.endpoint import Channel
from pmetal.errors import PMetalError, PMetalTimeoutError, RequestTimeoutError
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.wire import ClusterState, Message, WatchCluster

__all__ = ["ClusterWatch", "peers_missing"]

log = logging.getLogger(__name__)


class ClusterWatch:
    """The nodes the cluster holds dead, as our node tells it.

    Its thread alone uses its socket (a ZeroMQ socket belongs to one
    thread); :meth:`close` wakes it through a pipe and waits for it."""

    _WAIT = 10.0   # s a long poll stays open

    def __init__(self, transport: ZmqTransport, identity: NodeIdentity,
                 namespace: NetworkNamespace, config: PMetalConfig, address: str) -> None:
        self.dead: frozenset[str] = frozenset()
        self.state: ClusterState | None = None
        self._closing = threading.Event()
        self._updated = threading.Condition()
        self._wake_r, self._wake_w = os.pipe()
        self._handshake = config.transport.handshake_timeout
        dialer = transport.dial(address)
        self._socket = dialer.socket
        self._channel = Channel(dialer, identity, namespace, config)
        self._thread = threading.Thread(target=self._run, name="pmetal-cluster-watch",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._watch()
        finally:
            self._channel.close()

    def _watch(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        version = -1
        while not self._closing.is_set():
            try:
                if self._channel.session is None:
                    self._channel.open(timeout=self._handshake)
                reply = self._ask(poller, WatchCluster(version, self._WAIT))
            except PMetalError as exc:
                log.debug("cluster watch: %s", exc)
                if self._closing.wait(0.5):
                    return
                continue
            if reply is None:
                return   # closing
            if not isinstance(reply, ClusterState):
                return   # a node that does not know the cluster (an older one)
            with self._updated:
                self.state = reply
                self.dead = frozenset(reply.dead)
                version = reply.version
                self._updated.notify_all()

    def _ask(self, poller: zmq.Poller, body: Message) -> Message | None:
        channel = self._channel
        corr = channel.submit(body, timeout=self._handshake)
        deadline = time.monotonic() + self._WAIT + 5.0
        while (env := channel.take(corr)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                channel.abandon()
                raise RequestTimeoutError("the node did not answer the cluster watch")
            ready = dict(poller.poll(int(remaining * 1000) + 1))
            if self._wake_r in ready or self._closing.is_set():
                return None
            if self._socket in ready:
                try:
                    channel.pump(0)
                except PMetalTimeoutError:
                    pass
        return env.body

    def wait(self, done: Any, deadline: float) -> bool:
        """Wait until ``done(state)`` holds (True) or ``deadline`` passes."""
        with self._updated:
            while not (self.state is not None and done(self.state)):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closing.is_set():
                    return False
                self._updated.wait(min(remaining, 0.5))
            return True

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        # The pipe's read end stays open until the thread is gone: a thread
        # that ended by itself (a node that knows no cluster) closed nothing,
        # so this write cannot meet a closed pipe (it raised BrokenPipeError).
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=2.0 + self._handshake)
        os.close(self._wake_w)
        if not self._thread.is_alive():
            os.close(self._wake_r)


def peers_missing(cluster: dict[str, Any], own: str, n: int, timeout: float) -> PMetalTimeoutError:
    """The error of a wait for ``n`` peers that timed out, naming what the
    node saw (``cluster``: the ``cluster`` part of its status)."""
    members = [m["node_id"][:8] for m in cluster.get("members", [])
               if m.get("node_id") != own and m.get("state") != "dead"
               and m.get("health") != "dead"]
    found = [d[:8] for d in cluster.get("discovered", []) if d[:8] not in members]
    ignored = [f"{i.get('address', '?')} ({i.get('reason', '?')})"
               for i in cluster.get("ignored", [])]
    return PMetalTimeoutError(
        f"wait_for_peers: {len(members)} of {n} peers joined within {timeout:g} s; "
        f"members: {members or 'none'}; found but not members: {found or 'none'}; "
        f"ignored: {ignored or 'none'}; master: {cluster.get('master', '')[:8] or 'none'}. "
        f"If nobody is found: on macOS allow Local Network access for Python, check that "
        f"the machines share a network without a VPN or firewall in the way "
        f"(mDNS is UDP 5353 multicast), and that they share the namespace and PSK; "
        f"static peers (pmetal start --peers HOST:PORT) always work")
