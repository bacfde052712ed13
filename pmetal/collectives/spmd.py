"""The SPMD entry point, the seed crate's API: the same script runs as
every rank (``pmetal launch -n N script.py``, torchrun-style), builds a
:class:`DistributedContext` over a backend and calls collectives.

- :class:`RingBackend` over :class:`DistributedConfig` (a static list of
  ``host:port``, one per rank, like torchrun or mlx.launch): rank ``r``
  listens on ``nodes[r]`` and connects to every other rank. There is no
  master to ask, so the schedule is the configuration's, the same on
  every rank (its fingerprint is part of the group's tag: ranks started
  with different settings refuse each other at once instead of
  exchanging mismatched plans).
- :class:`AutoDiscoveryBackend` joins the pmetal cluster (mDNS or static
  peers) and takes its rank from the master's member list
  (:mod:`pmetal.collectives.rendezvous`).

Every operation exists twice: ``await ctx.all_reduce(x)`` (runs in a
worker thread, the event loop stays free) and
``ctx.all_reduce_blocking(x)`` for plain scripts.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from pmetal.collectives.group import Group, Schedule
from pmetal.collectives.ops import ReduceOp
from pmetal.config import CollectiveConfig, ConfigError, load_config
from pmetal.errors import PMetalValueError
from pmetal.links import tcplinks
from pmetal.links.memory import RankLinks
from pmetal.links.seal import requires_seal
from pmetal.transport import is_loopback

__all__ = ["DistributedBackend", "DistributedConfig", "DistributedContext", "RingBackend"]

log = logging.getLogger(__name__)

# A world whose every rank is on loopback and that has no PSK uses this
# key: only processes of this machine can reach it anyway.
_LOOPBACK_KEY = b"pmetal-loopback-collectives-without-psk"


@dataclass(frozen=True)
class DistributedConfig:
    """A static world: ``nodes`` lists every rank's ``host:port`` in rank
    order (a list, or one comma-separated string), ``rank`` is this
    process's. ``psk``: the namespace key (default
    ``PMETAL_PSK``/``PMETAL_PSK_HEX``; not needed when every node is on
    loopback). ``collectives``: strategy, chunk size and timeouts
    (default: ``PMETAL_COLLECTIVES_*`` variables, else the defaults)."""
    nodes: Sequence[str]
    rank: int
    psk: str | bytes | None = None
    collectives: CollectiveConfig | None = None
    name: str = "world"
    addresses: tuple[tuple[str, int], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # "a:1,b:2" (as in PMETAL_NODES) or a list; a string must not be
        # taken for a list of characters.
        nodes = tuple(n.strip() for n in self.nodes.split(",") if n.strip()) \
            if isinstance(self.nodes, str) else tuple(self.nodes)
        if not nodes:
            raise ConfigError("DistributedConfig.nodes is empty: list every rank's host:port")
        if not isinstance(self.rank, int) or not 0 <= self.rank < len(nodes):
            raise ConfigError(f"DistributedConfig.rank is {self.rank!r}; with {len(nodes)} "
                              f"nodes it must be 0 to {len(nodes) - 1}")
        addresses = tuple(_address(n) for n in nodes)
        if len(set(addresses)) != len(addresses):
            raise ConfigError(f"DistributedConfig.nodes lists an address twice: {list(nodes)}")
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "addresses", addresses)

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    @classmethod
    def from_env(cls, environ: Any = None, **kwargs: Any) -> DistributedConfig:
        """The world ``pmetal launch`` describes in ``PMETAL_RANK``,
        ``PMETAL_WORLD_SIZE`` and ``PMETAL_NODES``."""
        from pmetal.collectives.launchenv import from_env
        env = from_env(os.environ if environ is None else environ)
        return cls(nodes=env.nodes, rank=env.rank, **kwargs)


def _address(node: str) -> tuple[str, int]:
    host, sep, port = str(node).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"node {node!r} is not host:port (for example 127.0.0.1:29500)")
    return host, int(port)


class DistributedBackend(abc.ABC):
    """What a :class:`DistributedContext` runs on: forms the group."""

    @abc.abstractmethod
    def connect(self, timeout: float) -> Group:
        """Form the group (blocking); raise CollectiveError on failure."""


class RingBackend(DistributedBackend):
    """A static world of ``host:port`` nodes (see the module docstring)."""

    def __init__(self, config: DistributedConfig) -> None:
        self.config = config
        self.collectives = config.collectives or load_config().collectives

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def _key(self) -> bytes:
        from pmetal.security import NetworkNamespace
        cfg = load_config().security
        try:
            namespace = NetworkNamespace.resolve(cfg, self.config.psk)
        except ConfigError:
            if all(is_loopback(h) for h, _ in self.config.addresses):
                return _LOOPBACK_KEY
            raise ConfigError(
                "the ranks are on several machines and no PSK is set: set PMETAL_PSK "
                "(the same on every rank; 'pmetal keygen' makes one) so that only your "
                "ranks can join the group") from None
        return tcplinks.collective_key(namespace.psk)

    def connect(self, timeout: float) -> Group:
        config, collectives = self.config, self.collectives
        schedule = Schedule.from_config(config.name, config.world_size, collectives)
        fingerprint = ",".join(config.nodes) + repr(schedule)
        tag = tcplinks.group_tag(fingerprint, schedule.term, schedule.epoch)
        deadline = time.monotonic() + timeout
        key = self._key()
        if self.same_machine:
            # Every rank is on this machine: shared-memory rings, as MPI
            # does. The token (the rendezvous's secret) is bound to the
            # group's tag, so ranks of another formation never meet.
            from pmetal.links.shmlinks import ShmLinks
            token = hashlib.blake2b(tag, key=key, digest_size=16).hexdigest()
            links: RankLinks = ShmLinks.connect(token, config.rank, config.world_size,
                                                deadline=deadline)
        else:
            host, port = config.addresses[config.rank]
            listener = tcplinks.listen(host, port)
            try:
                seal = requires_seal(collectives.link_encryption,
                                     [h for h, _ in config.addresses])
                links = tcplinks.connect_mesh(config.rank, config.addresses, listener,
                                              key=key, tag=tag, epoch=schedule.epoch,
                                              deadline=deadline, seal=seal)
            finally:
                listener.close()
        return Group(schedule, config.rank, links, timeout=collectives.timeout)

    @property
    def same_machine(self) -> bool:
        """Whether the ranks exchange through shared memory: every node is
        on loopback (so on this machine) and ``shared_memory`` is on."""
        return (self.collectives.shared_memory and self.config.world_size > 1
                and all(is_loopback(h) for h, _ in self.config.addresses))


class DistributedContext:
    """Collective operations over a backend's group. The group forms on
    the first operation (or :meth:`connect_blocking`), within the
    configured ``connect_timeout``."""

    def __init__(self, backend: DistributedBackend) -> None:
        if not isinstance(backend, DistributedBackend):
            raise PMetalValueError(f"DistributedContext needs a DistributedBackend such as "
                                   f"RingBackend(DistributedConfig(...)), not {backend!r}")
        self.backend = backend
        self._group: Group | None = None

    @property
    def group(self) -> Group:
        if self._group is None:
            return self.connect_blocking()
        return self._group

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.size

    def connect_blocking(self, timeout: float | None = None) -> Group:
        if self._group is None:
            collectives = getattr(self.backend, "collectives", CollectiveConfig())
            self._group = self.backend.connect(timeout or collectives.connect_timeout)
        return self._group

    async def connect(self, timeout: float | None = None) -> Group:
        return await asyncio.to_thread(self.connect_blocking, timeout)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Blocking twins.
    def all_reduce_blocking(self, x: Any, op: ReduceOp | str = ReduceOp.SUM,
                            **kw: Any) -> Any:
        return self.group.all_reduce(x, op, **kw)

    def reduce_blocking(self, x: Any, root: int = 0, op: ReduceOp | str = ReduceOp.SUM,
                        **kw: Any) -> Any:
        return self.group.reduce(x, root, op, **kw)

    def broadcast_blocking(self, x: Any, root: int = 0, **kw: Any) -> Any:
        return self.group.broadcast(x, root, **kw)

    def all_gather_blocking(self, x: Any, **kw: Any) -> Any:
        return self.group.all_gather(x, **kw)

    def reduce_scatter_blocking(self, x: Any, op: ReduceOp | str = ReduceOp.SUM,
                                **kw: Any) -> Any:
        return self.group.reduce_scatter(x, op, **kw)

    def barrier_blocking(self, **kw: Any) -> None:
        self.group.barrier(**kw)

    def send_blocking(self, x: Any, to_rank: int, **kw: Any) -> None:
        self.group.send(x, to_rank, **kw)

    def recv_blocking(self, x: Any, from_rank: int, **kw: Any) -> Any:
        return self.group.recv(x, from_rank, **kw)

    # The asyncio API: the same operations in a worker thread.
    async def all_reduce(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, **kw: Any) -> Any:
        return await asyncio.to_thread(self.all_reduce_blocking, x, op, **kw)

    async def reduce(self, x: Any, root: int = 0, op: ReduceOp | str = ReduceOp.SUM,
                     **kw: Any) -> Any:
        return await asyncio.to_thread(self.reduce_blocking, x, root, op, **kw)

    async def broadcast(self, x: Any, root: int = 0, **kw: Any) -> Any:
        return await asyncio.to_thread(self.broadcast_blocking, x, root, **kw)

    async def all_gather(self, x: Any, **kw: Any) -> Any:
        return await asyncio.to_thread(self.all_gather_blocking, x, **kw)

    async def reduce_scatter(self, x: Any, op: ReduceOp | str = ReduceOp.SUM,
                             **kw: Any) -> Any:
        return await asyncio.to_thread(self.reduce_scatter_blocking, x, op, **kw)

    async def barrier(self, **kw: Any) -> None:
        await asyncio.to_thread(self.barrier_blocking, **kw)

    async def send(self, x: Any, to_rank: int, **kw: Any) -> None:
        await asyncio.to_thread(self.send_blocking, x, to_rank, **kw)

    async def recv(self, x: Any, from_rank: int, **kw: Any) -> Any:
        return await asyncio.to_thread(self.recv_blocking, x, from_rank, **kw)
