"""The SPMD backend whose world is the pmetal cluster: no node list, the
ranks find each other (the seed crate's ``AutoDiscoveryBackend``).

Each process joins the cluster (``pmetal.init``: by default an embedded
node that discovers its peers over mDNS; or the node of this machine,
``address="auto"``), waits for its peers, then enrolls in the group's
rendezvous actor (:class:`~pmetal.collectives.rendezvous.Rendezvous`, on
the master's node). When the last of the expected processes has
enrolled, the rendezvous forms the group as it forms an actor group: the
master's term and membership epoch stamped, ranks in the order of the
master's member list (node id, then process), the ring ordered by the
topology. Each process then connects the mesh as an actor group's member
does, so everything about failures holds here too: a process that dies
fails every survivor's operation at once, and forming again (a new
backend over the survivors) makes a new epoch that refuses the old one.

One process per node is the usual layout (as in the seed); several
processes of one node enroll side by side, ordered by a random key.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from typing import Any

from pmetal.actors import context
from pmetal.collectives import actorgroup, rendezvous
from pmetal.collectives.group import Group, Schedule
from pmetal.collectives.spmd import DistributedBackend
from pmetal.config import CollectiveConfig
from pmetal.errors import (
    ActorDiedError,
    CollectiveError,
    PMetalTypeError,
    PMetalValueError,
)

__all__ = ["AutoDiscoveryBackend"]


class AutoDiscoveryBackend(DistributedBackend):
    """See the module docstring. Make it with ``await
    AutoDiscoveryBackend.new(...)`` (or :meth:`new_blocking`), then
    ``await backend.wait_for_peers(n, timeout)``; the world is this
    process and the ``n`` peers."""

    def __init__(self, collectives: CollectiveConfig | None = None, *,
                 name: str = "world") -> None:
        if collectives is not None and not isinstance(collectives, CollectiveConfig):
            raise PMetalTypeError(f"collectives must be a CollectiveConfig, not "
                                  f"{type(collectives).__name__}")
        self.name = rendezvous._check_name(name)
        self._collectives = collectives
        self.world_size: int | None = None
        self.peers: list[str] = []
        # This process's key in the enrolment: its node, its pid, and a
        # random part so that a restarted process never takes an old place.
        self._key = ""

    @property
    def collectives(self) -> CollectiveConfig:
        if self._collectives is None:
            self._collectives = context.current().config.collectives
        return self._collectives

    @classmethod
    def new_blocking(cls, collectives: CollectiveConfig | None = None, *, name: str = "world",
                     **init: Any) -> AutoDiscoveryBackend:
        """Join the cluster (``pmetal.init(**init)``, discovery on unless
        said otherwise, when this process has not called it) and return the
        backend."""
        backend = cls(collectives, name=name)
        if context.current_or_none() is None and not context.in_worker():
            if "address" not in init:
                init.setdefault("discovery", True)
                if init.get("psk") is None:
                    init["psk"] = _cluster_psk()
            context.initialize(**init)
        return backend

    @classmethod
    async def new(cls, collectives: CollectiveConfig | None = None, *, name: str = "world",
                  **init: Any) -> AutoDiscoveryBackend:
        return await asyncio.to_thread(cls.new_blocking, collectives, name=name, **init)

    def wait_for_peers_blocking(self, n: int, timeout: float = 30.0) -> list[str]:
        """Wait until the cluster has ``n`` other nodes; the world is then
        ``n + 1`` processes. Returns their node ids."""
        if type(n) is not int or n < 0:
            raise PMetalValueError(f"wait_for_peers: n must be a non-negative int, not {n!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise PMetalTypeError(f"wait_for_peers: timeout must be a number of seconds, "
                                  f"not {type(timeout).__name__}")
        if not timeout >= 0:
            raise PMetalValueError(f"wait_for_peers: timeout={timeout!r}; it must not be "
                                   "negative")
        self.peers = context.current().wait_for_peers(n, timeout)
        self.world_size = n + 1
        return self.peers

    async def wait_for_peers(self, n: int, timeout: float = 30.0) -> list[str]:
        return await asyncio.to_thread(self.wait_for_peers_blocking, n, timeout)

    def connect(self, timeout: float) -> Group:
        if self.world_size is None:
            raise CollectiveError("call wait_for_peers(n) before the first operation: the "
                                  "world is this process and its n peers")
        client = context.current()
        config = self.collectives
        self._key = f"{client.node_id}:{os.getpid()}:{secrets.token_hex(4)}"
        request = rendezvous.Formation(
            self.name, 0, "", (), (), Schedule.from_config(self.name, self.world_size, config),
            0, config.timeout, config.connect_timeout, config.link_encryption)
        started = time.monotonic()
        deadline = started + timeout
        while True:
            handle = (rendezvous._rendezvous(client, self.name)
                      or rendezvous._start_rendezvous(client, self.name))
            left = deadline - time.monotonic()
            try:
                formation = rendezvous._ask(client, handle, "enroll", self._key,
                                            client.node_id, request, max(0.1, left),
                                            timeout=max(0.1, left) + 5.0)
                break
            except ActorDiedError as exc:
                # Its node died (the master, perhaps with the process that
                # just failed): the next lookup finds or starts another one
                # on the current master, where the others enroll too.
                if time.monotonic() >= deadline:
                    raise CollectiveError(
                        f"group {self.name!r}: its rendezvous actor died and no other "
                        f"answered within {timeout:g} s") from exc
                time.sleep(0.1)  # until the cluster knows the actor is dead (< 1 s)
        rank = formation.members.index(self._key)
        left = max(1.0, timeout - (time.monotonic() - started))
        formation = rendezvous.dataclasses.replace(formation, connect_timeout=left)
        return actorgroup.connect(client, formation, rank, handle)


def _cluster_psk() -> bytes:
    """The PSK every process of the cluster shares (an embedded node would
    otherwise make up its own, and no peer could join it)."""
    from pmetal.config import ConfigError, load_config
    from pmetal.security import NetworkNamespace
    try:
        return NetworkNamespace.resolve(load_config().security).psk
    except ConfigError:
        raise ConfigError(
            "AutoDiscoveryBackend joins the processes into one cluster, so they need the "
            "same PSK: set PMETAL_PSK on every process ('pmetal keygen' makes one), or pass "
            "psk=...") from None
