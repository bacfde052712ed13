"""The member side of a collective group (see :mod:`pmetal.collectives.rendezvous`
for the rendezvous actor and the driver side): :func:`join_group` behind
``pmetal.collective.get_group``, which connects a member actor to the
others, and the :class:`ActorGroup` it returns, which knows its formation.
A failed operation closes the member's connections, so every other member
fails at once, and says whether the group has formed again.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pmetal.actors import context
from pmetal.actors.handles import ActorHandle
from pmetal.collectives.group import Group
from pmetal.collectives.rendezvous import (
    _ASK_MARGIN,
    _EXPLAIN_WAIT,
    Formation,
    _ask,
    _check_name,
    _rendezvous,
)
from pmetal.errors import (
    ActorDiedError,
    CollectiveError,
    PMetalError,
    PMetalTimeoutError,
    PMetalValueError,
)
from pmetal.links import tcplinks
from pmetal.links.seal import requires_seal

__all__ = ["ActorGroup", "GroupStatistics", "join_group", "local_groups"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupStatistics:
    """One member's view of its formation: collective operations run
    (point-to-point messages not counted), payload bytes sent and received
    over its connections, and why the formation is spent (None while it
    works)."""
    name: str
    epoch: int
    rank: int
    size: int
    operations: int
    bytes_sent: int
    bytes_received: int
    spent: str | None


class ActorGroup(Group):
    """A member actor's :class:`~pmetal.collectives.group.Group`, which
    knows its formation: a failed operation closes its connections (the
    formation is spent) and says whether the group has formed again."""

    def __init__(self, formation: Formation, rank: int, links: Any,
                 rendezvous: ActorHandle) -> None:
        super().__init__(formation.schedule, rank, links, timeout=formation.timeout)
        self.formation = formation
        self.epoch = formation.epoch
        self._rendezvous = rendezvous
        self._spent: str | None = None

    def statistics(self) -> GroupStatistics:
        return GroupStatistics(self.name, self.epoch, self.rank, self.size, self._op_id,
                               getattr(self.links, "bytes_sent", 0),
                               getattr(self.links, "bytes_received", 0), self._spent)

    def _execute(self, *args: Any) -> None:
        self._guard(lambda: super(ActorGroup, self)._execute(*args))

    def send(self, *args: Any, **kwargs: Any) -> None:
        self._guard(lambda: super(ActorGroup, self).send(*args, **kwargs))

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        return self._guard(lambda: super(ActorGroup, self).recv(*args, **kwargs))

    def _guard(self, run: Callable[[], Any]) -> Any:
        if self._spent is not None:
            raise CollectiveError(self._spent)
        try:
            return run()
        except CollectiveError as exc:
            # The peers cannot tell how far this rank got: end the
            # formation for all of them now rather than at their timeout.
            self._abort()
            self._spent = self._explain(str(exc))
            raise CollectiveError(self._spent) from exc

    def supersede(self, why: str) -> None:
        """This formation is over (the group formed again, or was
        destroyed): close its connections and refuse its operations."""
        self._spent = (f"collective group {self.name!r}, epoch {self.epoch}: {why}; a stale "
                       f"epoch is refused: call pmetal.collective.get_group({self.name!r}) "
                       "again")
        self._abort()

    def _abort(self) -> None:
        """Close at once, without flushing (no peer will read the rest);
        not through close(), whose second links.close would flush."""
        if not self.closed:
            self.closed = True
            atexit.unregister(self.close)
            self.links.close(timeout=0.0)

    def _explain(self, failure: str) -> str:
        """``failure``, plus what the rendezvous actor says now: whether
        the group formed again without waiting for us, or was destroyed."""
        client = context.current()
        try:
            now = _ask(client, self._rendezvous, "failed", self.formation.formation_id,
                       timeout=_EXPLAIN_WAIT)
        except PMetalError:
            return (f"{failure} (the group's rendezvous actor is gone: the group was "
                    "destroyed or its node died; create it again)")
        if now is None or now.formation_id == self.formation.formation_id:
            return f"{failure}; form the group again with create_group over the live members"
        member = now.rank_of(self.formation.members[self.rank])
        where = ("this member is not in the new formation" if member is None
                 else f"call pmetal.collective.get_group({self.name!r}) again")
        return (f"{failure}; this rank holds epoch {self.epoch} but the group formed again "
                f"as epoch {now.epoch}: a stale epoch is refused; {where}")


class _LocalGroups:
    """This process's memberships, by group name (one per name: a process
    hosts one actor). One lock per name: joining a group waits for the
    other members, and a threaded actor joining two groups at once must
    not make one wait behind the other (their members may join them in
    the other order)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.groups: dict[str, ActorGroup] = {}
        self._joining: dict[str, threading.Lock] = {}

    def lock_for(self, name: str) -> threading.Lock:
        with self.lock:
            return self._joining.setdefault(name, threading.Lock())

    def drop(self, name: str, why: str) -> None:
        with self.lock:
            group = self.groups.pop(name, None)
        if group is not None:
            group.supersede(why)


local_groups = _LocalGroups()


def join_group(name: str) -> ActorGroup:
    """See :func:`pmetal.collective.get_group`."""
    _check_name(name)
    actor_id = context.current_actor_id()
    if not actor_id:
        raise PMetalValueError(
            f"get_group({name!r}) runs inside a method of one of the group's actors; the "
            "driver holds the handle create_group returned")
    client = context.current()
    rendezvous = _rendezvous(client, name)
    if rendezvous is None:
        local_groups.drop(name, "the group was destroyed")
        raise PMetalValueError(
            f"there is no collective group named {name!r}: create it from the driver with "
            f"pmetal.collective.create_group(actors, name={name!r}) first")
    timeout = client.config.transport.request_timeout
    with local_groups.lock_for(name):
        formation: Formation | None = _ask(client, rendezvous, "current", timeout=timeout)
        if formation is None:
            raise PMetalValueError(f"collective group {name!r} is not formed yet")
        cached = local_groups.groups.get(name)
        if cached is not None:
            if cached.formation.formation_id == formation.formation_id and not cached.closed:
                return cached
            local_groups.drop(name, f"the group formed again as epoch {formation.epoch}")
        rank = formation.rank_of(actor_id)
        if rank is None:
            raise PMetalValueError(
                f"this actor ({actor_id}) is not a member of collective group {name!r} "
                f"(epoch {formation.epoch}, members {list(formation.members)}); add it with "
                "create_group from the driver")
        group = connect(client, formation, rank, rendezvous)
        with local_groups.lock:
            local_groups.groups[name] = group
        return group


def connect(client: Any, formation: Formation, rank: int,
             rendezvous: ActorHandle) -> ActorGroup:
    host = tcplinks.reachable_host(client)
    listener = tcplinks.listen(host, 0)
    try:
        address = (host, listener.getsockname()[1])
        wait = formation.connect_timeout
        try:
            addresses = _ask(client, rendezvous, "join", formation.formation_id, rank,
                             address, wait, timeout=wait + _ASK_MARGIN)
        except (ActorDiedError, PMetalTimeoutError) as exc:
            raise CollectiveError(
                f"collective group {formation.name!r}: its rendezvous actor did not answer "
                f"rank {rank}'s get_group ({exc}); the group was destroyed or the node that "
                "held it died: create it again from the driver") from exc
        # The creator's setting, or this process's own when it demands more.
        seal = (requires_seal(formation.link_encryption, [h for h, _ in addresses])
                or client.config.collectives.link_encryption == "on")
        links = tcplinks.connect_mesh(
            rank, addresses, listener, key=tcplinks.collective_key(client.namespace.psk),
            tag=formation.tag, epoch=formation.epoch,
            deadline=time.monotonic() + formation.connect_timeout,
            is_dead=_death_watch(client, formation.nodes), seal=seal)
    finally:
        listener.close()
    log.info("joined collective group %r as rank %d of %d (epoch %d)", formation.name, rank,
             formation.size, formation.epoch)
    return ActorGroup(formation, rank, links, rendezvous)


def _death_watch(client: Any, nodes: Sequence[str]) -> Callable[[int], bool] | None:
    """A rank counts as dead once the cluster declares its node dead (a
    host that vanished closes no connection); None when every member
    shares this node."""
    own = client.node_id
    if all(n == own for n in nodes):
        return None
    watch = client.watch
    return lambda rank: nodes[rank] in watch.dead
