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
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LeaseStatistics", "OwnerLeases", "OwnerWatch", "POLL_INTERVAL"]

log = logging.getLogger(__name__)

POLL_INTERVAL = 1.0   # s between looks at watched pids where there is no pidfd


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # another user's live process
    return True


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
        if pid <= 0 or not _alive(pid):
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
            for pid in [p for p in self._polled if not _alive(p)]:
                self._exited(pid)

    def close(self) -> None:
        for pid, fd in list(self._fds.items()):
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(fd)
            os.close(fd)
        self._fds.clear()
        self._polled.clear()


@dataclass(frozen=True)
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
