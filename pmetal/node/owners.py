"""Owners of actors on this machine, and noticing when one dies.

An actor is owned by the process that created it (a driver, or the worker of
another actor), as in Ray, and dies with it unless it was created with
``lifetime="detached"``. An owner is named by its node and its pid; the
owner's node watches the pids of its local owners and, when one exits,
kills their non-detached actors here and tells the members (``OwnerDied``)
to kill theirs.

On Linux a pid is watched through a pidfd (``os.pidfd_open``) registered
with the event loop: the exit is an event, not a poll. Elsewhere the
watched pids are polled every :data:`POLL_INTERVAL` seconds (``kill(pid,
0)``) by one loop owned by the node's task group.

An owner whose process its node cannot watch (a driver on another machine:
its session did not prove it shares this one) holds a lease instead
(:class:`OwnerLeases`): any message from its session renews it, the client
sends a one-way Ping when it has been idle for a quarter of the lease, and
the node ends its actors once the lease lapses. A client that shuts down
says so (``Detach``) and its actors end at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from pmetal import shm
from pmetal.node.membership import Member, Membership
from pmetal.node.records import ActorRecord
from pmetal.wire import Failure, OwnerDied

__all__ = ["LeaseStatistics", "OwnerLeases", "OwnerWatch", "Owners", "POLL_INTERVAL"]

log = logging.getLogger(__name__)

POLL_INTERVAL = 1.0   # s between looks at watched pids where there is no pidfd


class OwnerWatch:
    """Calls ``on_exit(pid)`` once when a watched local process exits."""

    def __init__(self, on_exit: Callable[[int], None]) -> None:
        self._on_exit = on_exit
        self._fds: dict[int, int] = {}        # pid -> pidfd (Linux)
        self._polled: set[int] = set()        # pids without a pidfd
        self._loop: asyncio.AbstractEventLoop | None = None

    def __contains__(self, pid: int) -> bool:
        return pid in self._fds or pid in self._polled

    def watch(self, pid: int) -> bool:
        """Start watching ``pid``; False when it is not running (any more)."""
        if pid in self:
            return True
        if pid <= 0 or not shm.pid_alive(pid):
            return False
        if hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return False
            except OSError as exc:   # no pidfd in this kernel or sandbox: poll
                log.debug("pidfd_open(%d) failed (%s); polling it instead", pid, exc)
            else:
                loop = asyncio.get_running_loop()
                loop.add_reader(fd, self._exited, pid)
                self._loop = loop
                self._fds[pid] = fd
                return True
        self._polled.add(pid)
        return True

    def _exited(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None and self._loop is not None:
            self._loop.remove_reader(fd)
            os.close(fd)
        self._polled.discard(pid)
        log.info("owner process %d exited", pid)
        self._on_exit(pid)

    async def poll(self, stopping: asyncio.Event) -> None:
        """The bounded poll for pids without a pidfd (owned by the node's
        task group; a look every POLL_INTERVAL costs one kill(0) per pid)."""
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), POLL_INTERVAL)
                return
            except asyncio.TimeoutError:
                pass
            for pid in [p for p in self._polled if not shm.pid_alive(p)]:
                self._exited(pid)

    def close(self) -> None:
        for pid, fd in list(self._fds.items()):
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(fd)
            os.close(fd)
        self._fds.clear()
        self._polled.clear()


@dataclass(frozen=True, slots=True)
class LeaseStatistics:
    held: int        # clients holding a lease now
    renewed: int     # messages that renewed a lease
    expired: int     # leases that lapsed (their owners' actors were ended)


class OwnerLeases:
    """Leases of owners on other machines, by client session id. Pure: the
    caller passes the time (``time.monotonic()`` in the node, any clock in
    a test)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._until: dict[str, float] = {}
        self._renewed = 0
        self._expired = 0

    def __bool__(self) -> bool:
        return bool(self._until)

    def __contains__(self, client: str) -> bool:
        return client in self._until

    def hold(self, client: str, now: float) -> None:
        """Start (or renew) ``client``'s lease."""
        self._until[client] = now + self.timeout

    def renew(self, client: str, now: float) -> None:
        """A message from ``client`` arrived: renew its lease if it holds one."""
        if client in self._until:
            self._until[client] = now + self.timeout
            self._renewed += 1

    def drop(self, client: str) -> None:
        self._until.pop(client, None)

    def expired(self, now: float) -> list[str]:
        """The clients whose lease lapsed by ``now``; they hold none any more."""
        gone = [c for c, until in self._until.items() if until <= now]
        for client in gone:
            del self._until[client]
        self._expired += len(gone)
        return gone

    def statistics(self) -> LeaseStatistics:
        return LeaseStatistics(len(self._until), self._renewed, self._expired)

    def describe(self, now: float) -> list[dict[str, object]]:
        return [{"client": c, "expires_in": round(until - now, 1)}
                for c, until in self._until.items()]


class Owners:
    """A node's side of actor lifetime: it names the owner of each creation
    it receives from a client, watches local owners' pids and remote owners'
    leases, and when an owner goes, ends its non-detached actors here
    (through ``kill_owned``) and tells the members it forwarded some to."""

    def __init__(self, node_id: str, lease: float, membership: Membership,
                 kill_owned: Callable[[Callable[[ActorRecord], bool], str], int],
                 spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self.node_id = node_id
        self.watch = OwnerWatch(self._exited)
        self.leases = OwnerLeases(lease)
        self._membership = membership
        self._kill_owned = kill_owned
        self._spawn = spawn
        # (owner pid or 0, owner client) -> members hosting actors of that owner
        self._placed_with: dict[tuple[int, str], set[str]] = {}
        self.died = 0   # owners seen going (their actors were killed)

    def name(self, options: dict[str, Any], client: str, local: bool) -> dict[str, Any] | None:
        """``options`` of a creation from ``client`` naming its owner: the
        process that created it, watched by pid when the client proved it runs
        on this machine; else (another machine) the client's session, which
        holds a lease from now on. None when that process has exited."""
        pid = int(options.get("owner_pid") or 0)
        if pid and local and not self.watch.watch(pid):
            return None
        if not local:
            self.leases.hold(client, time.monotonic())
        return {**options, "owner_node": self.node_id, "owner_pid": pid if local else 0,
                "owner_client": client}

    def forwarded(self, options: dict[str, Any], member: str) -> None:
        """A creation of ``options`` went to ``member``: tell it when its owner goes."""
        if options.get("owner_node") == self.node_id:
            owner = (int(options.get("owner_pid") or 0), options.get("owner_client") or "")
            self._placed_with.setdefault(owner, set()).add(member)

    def _exited(self, pid: int) -> None:
        """A local owner process exited: its actors die with it, here and on
        the members that host some of them."""
        self.died += 1
        killed = self.owner_died(self.node_id, pid, "")
        members = self._members_hosting(lambda key: key[0] == pid)
        log.info("owner process %d exited: killed %d of its actors here, telling %d member(s)",
                 pid, killed, len(members))
        shm.sweep()   # what it was sent and never read, what it made for nobody
        self._tell_members(members, OwnerDied(self.node_id, pid))

    def client_gone(self, client: str, why: str) -> int:
        """A client detached (pmetal.shutdown) or its lease lapsed: the actors
        its session created die, here and on the members hosting some."""
        self.leases.drop(client)
        killed = self._kill_owned(
            lambda r: r.owner[0] == self.node_id and r.owner_client == client, why)
        members = self._members_hosting(lambda key: key[1] == client)
        if killed or members:
            self.died += 1
            log.info("%s: killed %d of its actors here, telling %d member(s)", why, killed,
                     len(members))
        self._tell_members(members, OwnerDied(self.node_id, 0, client))
        return killed

    def owner_died(self, node_id: str, pid: int, client: str) -> int:
        """Kill the non-detached actors of process ``pid`` (or, with
        ``client``, of that client session) that reached the cluster through
        node ``node_id``; how many."""
        if client:
            return self._kill_owned(lambda r: r.owner[0] == node_id and r.owner_client == client,
                                    f"its owner (client {client[:8]} of node {node_id[:8]}) "
                                    f"is gone")
        return self._kill_owned(lambda r: r.owner == (node_id, pid),
                                f"its owner (pid {pid} on node {node_id[:8]}) exited")

    def _members_hosting(self, owner: Callable[[tuple[int, str]], bool]) -> set[str]:
        keys = [key for key in self._placed_with if owner(key)]
        return set().union(*(self._placed_with.pop(key) for key in keys))

    def _tell_members(self, members: set[str], message: OwnerDied) -> None:
        for node_id in members:
            member = self._membership.members.get(node_id)
            if member is not None:
                self._spawn(self._tell(member, message))

    async def _tell(self, member: Member, message: OwnerDied) -> None:
        reply = await self._membership.ask(member, message)
        if isinstance(reply, Failure):
            log.warning("could not tell node %s that an owner died (%s): %s",
                        member.node_id[:8], message, reply.message)

    async def expire_leases(self, stopping: asyncio.Event) -> None:
        """End the actors of remote owners whose lease lapsed (looked at four
        times per lease, so within 1.25 leases of their last message; owned
        by the node's task group)."""
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), self.leases.timeout / 4)
                return
            except asyncio.TimeoutError:
                pass
            for client in self.leases.expired(time.monotonic()):
                self.client_gone(client, f"its owner (client {client[:8]}, on another machine) "
                                         f"sent nothing for {self.leases.timeout:g} s (its "
                                         f"lease lapsed)")

    def close(self) -> None:
        self.watch.close()
