"""The other nodes a node knows: its members, versioned by an epoch.

The member list is the master's (:mod:`pmetal.cluster.election`, versioned
by its ``epoch``, so that a collective can pin a membership snapshot and
refuse a plan made for another): :meth:`sync` adopts it each time it changes,
keeping its live nodes; :meth:`drop` forgets a node this node's own detector
declared dead, at once, so that nothing waits on it. Nodes that refused us
(another PSK or namespace) are listed in ``refused`` with the reason.

A member's id is the one it proved in the handshake.
Requests to members go over one channel per member, opened on first use and
re-opened after a failure; a member that does not answer gives a
``Failure`` naming it, never an exception or a hang.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from pmetal.config import PMetalConfig
from pmetal.endpoint import Channel
from pmetal.errors import PMetalError
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.values import ActorState, FailureKind
from pmetal.wire import ActorLocation, Failure, LookupActor, Message

__all__ = ["Member", "Membership", "MembershipStatistics"]

log = logging.getLogger(__name__)

_LOOKUP_TIMEOUT = 2.0   # s a member may take to say whether it hosts an actor


@dataclass
class Member:
    node_id: str
    address: str
    resources: dict[str, float]
    channel: Channel | None = None
    gone: asyncio.Event = field(default_factory=asyncio.Event)   # set when dropped


# Addresses listed as having refused us: bounded, whoever the addresses are.
MAX_REFUSED = 256


@dataclass(frozen=True, slots=True)
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

    # ------------------------------------------------------------- changes

    def sync(self, state: Any, own_id: str) -> None:
        """Adopt the master's member list (an ElectionState): members are its
        live nodes but this one; ``epoch`` is the list's."""
        alive = {m.node_id: m for m in state.members if m.node_id != own_id and m.alive}
        for node_id in [n for n in self.members if n not in alive]:
            self.drop(node_id)
        for node_id, m in alive.items():
            known = self.members.get(node_id)
            address = m.address
            if known is not None and known.address != address:
                self.drop(node_id)
                known = None
            if known is None:
                self.members[node_id] = Member(node_id, address, {
                    str(k): float(v) for k, v in m.resources.items()})
                self.refused.pop(address, None)
                log.info("member %s at %s (epoch %d)", node_id[:8], address, state.epoch)
        self.epoch = max(self.epoch, int(state.epoch))

    def drop(self, node_id: str) -> None:
        """Forget a member (dead, or gone from the master's list): nothing
        waits on it any more."""
        member = self.members.pop(node_id, None)
        if member is not None:
            member.gone.set()   # its requests in flight fail now (see ask)
            if member.channel is not None:
                member.channel.close()
            log.info("member %s at %s left", node_id[:8], member.address)

    def refuse(self, address: str, reason: str) -> None:
        """A node at ``address`` refused us (another PSK or namespace, ...):
        listed in ``pmetal status``, logged once per reason."""
        if self.refused.get(address) != reason:
            log.warning("peer %s: %s", address, reason)
            self._counts["refused"] += 1
        self.refused.pop(address, None)
        self.refused[address] = reason
        while len(self.refused) > MAX_REFUSED:   # the oldest go first
            del self.refused[next(iter(self.refused))]

    # ------------------------------------------------------------- requests

    async def ask(self, member: Member, body: Message) -> Message:
        """``body``'s answer from ``member``, or a Failure naming it.

        Requests to one member run concurrently on its channel (one reads at
        a time and files every reply): serialising them would deadlock a
        placement whose construction asks the placing master back (a name
        lookup) while the placement's own request is in flight."""
        if member.gone.is_set():
            return self._gone(member)
        channel = member.channel
        if channel is None:
            channel = member.channel = Channel(self._transport.dial(member.address),
                                               self._identity, self._namespace, self._config)
        # A member held dead (or dropped from the list) meanwhile answers
        # nothing any more: its requests end then with a PeerError. (Before,
        # closing its channel cancelled the read under the request, and the
        # CancelledError silently ended the asker: a restart placed on a
        # node fenced mid-construction was never tried again.)
        request = asyncio.ensure_future(channel.arequest(body))
        gone = asyncio.ensure_future(member.gone.wait())
        try:
            await asyncio.wait((request, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not request.done():
                request.cancel()
        if request.cancelled():
            return self._gone(member)
        try:
            return request.result().body
        except PMetalError as exc:
            if member.channel is channel:
                channel.close()
                member.channel = None
            self._counts["failed"] += 1
            return Failure(FailureKind.PLACEMENT, "PeerError",
                           f"node {member.node_id[:8]} at {member.address} did not answer: "
                           f"{exc}")

    def _gone(self, member: Member) -> Failure:
        self._counts["failed"] += 1
        return Failure(FailureKind.PLACEMENT, "PeerError",
                       f"node {member.node_id[:8]} at {member.address} was held dead or left "
                       f"the member list before it answered")

    async def find_actor(self, body: LookupActor) -> ActorLocation | None:
        """Ask every member for an actor (their own actors only: no loops), all
        at once: a silent member costs at most ``_LOOKUP_TIMEOUT``, and a dead
        one nothing (it is no member any more)."""
        query = LookupActor(body.actor_id, body.name, body.min_incarnation, body.wait, True)
        members = list(self.members.values())
        if not members:
            return None
        answers = await asyncio.gather(*(
            asyncio.wait_for(self.ask(m, query), body.wait + _LOOKUP_TIMEOUT)
            for m in members), return_exceptions=True)
        found = [a for a in answers if isinstance(a, ActorLocation)]
        live = [a for a in found if a.live]
        moved = [a for a in found if a.state == ActorState.MOVED]
        return max(live or moved or found, key=lambda a: a.incarnation, default=None)

    def close(self) -> None:
        for m in self.members.values():
            if m.channel is not None:
                m.channel.close()
