"""The other nodes a node knows: its members, versioned by an epoch.

Today membership is static: a node joins the peers it was given
(``--peers``) with :class:`~pmetal.wire.NodeJoin`, retrying with backoff until
each answers, and records the nodes that join it. Discovery, health and
election (the cluster issue) add and remove members through this same
component, and every change increments ``epoch``, so that a collective can
pin a membership snapshot and refuse a plan made for another.

A member's id is the one it proved in the handshake: :meth:`joined` refuses
a ``NodeJoin`` whose id is not its sender's.
Requests to members go over one channel per member, opened on first use and
re-opened after a failure; a member that does not answer gives a
``Failure`` naming it, never an exception or a hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pmetal.config import PMetalConfig
from pmetal.endpoint import Channel
from pmetal.errors import HandshakeError, PMetalError, PMetalTimeoutError
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.wire import ActorLocation, Failure, LookupActor, Message, NodeJoin, Ping, Pong, Status

__all__ = ["Member", "Membership", "MembershipStatistics"]

log = logging.getLogger(__name__)

_JOIN_RETRY_FIRST = 0.1   # s before the first retry of an unanswered join
_JOIN_RETRY_MAX = 2.0     # s between retries at most

_CLONE = ("two nodes share one identity (a cloned disk, VM or PMETAL_HOME?); give each node "
          "its own ~/.pmetal/node_keypair")


@dataclass
class Member:
    node_id: str
    address: str
    resources: dict[str, float]
    channel: Channel | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True)
class MembershipStatistics:
    members: int          # including this node
    epoch: int
    joins_refused: int
    requests_failed: int


class Membership:
    def __init__(self, identity: NodeIdentity, namespace: NetworkNamespace,
                 config: PMetalConfig, transport: ZmqTransport) -> None:
        self.node_id = identity.node_id
        self._identity = identity
        self._namespace = namespace
        self._config = config
        self._transport = transport
        self.members: dict[str, Member] = {}
        self.epoch = 0
        self._counts = {"refused": 0, "failed": 0}
        # Static peers that refused us or never answered: address -> reason.
        self.refused: dict[str, str] = {}

    def statistics(self) -> MembershipStatistics:
        return MembershipStatistics(len(self.members) + 1, self.epoch, self._counts["refused"],
                                    self._counts["failed"])

    def describe(self) -> list[dict[str, Any]]:
        return [{"node_id": m.node_id, "address": m.address, "resources": m.resources}
                for m in self.members.values()]

    def describe_refused(self) -> list[dict[str, str]]:
        return [{"address": a, "reason": r} for a, r in self.refused.items()]

    def find(self, node_id: str) -> Member | None:
        """The member with this id, or the one whose id starts with it."""
        return self.members.get(node_id) or next(
            (m for m in self.members.values() if m.node_id.startswith(node_id)), None)

    def total_resources(self, own: dict[str, float]) -> dict[str, float]:
        total = dict(own)
        for m in self.members.values():
            for k, v in m.resources.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def _add(self, member: Member) -> None:
        self.members[member.node_id] = member
        self.epoch += 1

    # -------------------------------------------------------------- joining

    async def joined(self, body: NodeJoin, sender: str,
                     status: Callable[[], dict[str, Any]]) -> Message:
        """A node joins us: record it, answer with our ``status()``.
        ``sender`` is the id the joining node proved in the handshake."""
        if body.node_id != sender:
            # Member ids are the ids peers proved (their key signs the
            # handshake), so one member cannot enrol under another's id.
            self._counts["refused"] += 1
            return Failure("bad_request", "PeerError",
                           f"refused: a NodeJoin for node {body.node_id[:8]} came from "
                           f"node {sender[:8]}; a node joins as itself")
        if body.node_id == self.node_id:
            self._counts["refused"] += 1
            return Failure("bad_request", "PeerError",
                           f"refused: node id {body.node_id} is this node's own id: {_CLONE}")
        known = self.members.get(body.node_id)
        if known is not None and known.address != body.address:
            # Same id, new address: a restart elsewhere, or a clone. The
            # member we know decides: if it still answers, refuse the newcomer.
            if isinstance(await self.ask(known, Ping("alive?")), Pong):
                log.warning("refused node %s at %s: that id is a live member at %s",
                            body.node_id[:8], body.address, known.address)
                self._counts["refused"] += 1
                return Failure("bad_request", "PeerError",
                               f"refused: node id {body.node_id} is already a live member at "
                               f"{known.address}: {_CLONE}")
            if known.channel is not None:
                known.channel.close()
            del self.members[body.node_id]
            known = None
        if known is None:
            self._add(Member(body.node_id, body.address,
                             {k: float(v) for k, v in body.resources.items()}))
            log.info("member %s joined at %s (epoch %d)", body.node_id[:8], body.address,
                     self.epoch)
        return Status(status())

    async def join(self, address: str, own: NodeJoin, stopping: asyncio.Event) -> None:
        """Join a static peer, retrying with backoff until it answers (or
        ``stopping`` is set). A peer that refuses the handshake (another PSK
        or namespace) or never answers it is logged as a WARNING once and
        listed in ``refused`` (``pmetal status``), and still retried: it
        may be restarted with the right key. A refusal of the join itself
        (a clone of this node's identity) is final."""
        delay = _JOIN_RETRY_FIRST
        while not stopping.is_set():
            channel = Channel(self._transport.dial(address), self._identity, self._namespace,
                              self._config)
            try:
                await channel.aopen()
                reply = (await channel.arequest(own)).body
                self.refused.pop(address, None)
                if isinstance(reply, Status):
                    info = reply.info
                    self._add(Member(info["node_id"], info["address"], info["resources"],
                                     channel))
                    log.info("joined peer %s at %s (epoch %d)", info["node_id"][:8], address,
                             self.epoch)
                    return
                reason = getattr(reply, "message", "") or type(reply).__name__
                log.error("peer %s refused to join: %s", address, reason)
                self._refuse(address, f"refused our join: {reason}")
                channel.close()
                return
            except HandshakeError as exc:
                self._refuse(address, f"handshake refused: {exc} (another PSK or namespace?)")
            except PMetalTimeoutError as exc:
                if channel.session is None:
                    timeout = self._config.transport.handshake_timeout
                    self._refuse(address, f"no answer from {address} within {timeout:g} s: "
                                          f"another PSK or namespace, not a pmetal node, or "
                                          f"not started yet ({exc})")
                else:
                    log.debug("peer %s did not answer our join yet: %s", address, exc)
            except PMetalError as exc:
                log.debug("peer %s not reachable yet: %s", address, exc)
            channel.close()
            try:
                await asyncio.wait_for(stopping.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, _JOIN_RETRY_MAX)

    def _refuse(self, address: str, reason: str) -> None:
        if self.refused.get(address) != reason:
            log.warning("static peer %s: %s", address, reason)
            self._counts["refused"] += 1
        self.refused[address] = reason

    # ------------------------------------------------------------- requests

    async def ask(self, member: Member, body: Message) -> Message:
        """``body``'s answer from ``member``, or a Failure naming it."""
        async with member.lock:
            if member.channel is None:
                member.channel = Channel(self._transport.dial(member.address), self._identity,
                                         self._namespace, self._config)
            try:
                return (await member.channel.arequest(body)).body
            except PMetalError as exc:
                member.channel.close()
                member.channel = None
                self._counts["failed"] += 1
                return Failure("placement", "PeerError",
                               f"node {member.node_id[:8]} at {member.address} did not answer: "
                               f"{exc}")

    async def find_actor(self, body: LookupActor) -> ActorLocation | None:
        """Ask every member for an actor (their own actors only: no loops)."""
        query = LookupActor(body.actor_id, body.name, body.min_incarnation, body.wait, True)
        for member in list(self.members.values()):
            found = await self.ask(member, query)
            if isinstance(found, ActorLocation):
                return found
        return None

    def close(self) -> None:
        for m in self.members.values():
            if m.channel is not None:
                m.channel.close()
