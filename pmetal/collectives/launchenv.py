"""The environment ``pmetal launch`` gives every rank, and its reader.

``pmetal launch -n N script.py`` starts N copies of a script (SPMD, like
torchrun, mlx.launch or mpirun) and tells each copy who it is through four
variables:

=====================  ====================================================
``PMETAL_RANK``        this process's rank, ``0 <= rank < world size``
``PMETAL_WORLD_SIZE``  how many ranks the job has
``PMETAL_LOCAL_RANK``  this rank's index among the ranks on its machine
                       (``0 ..``), for choosing a device or a core
``PMETAL_NODES``       ``host:port`` of every rank, comma-separated, in rank
                       order: rank r listens on entry r for collective data
                       and reaches rank s at entry s
=====================  ====================================================

A host is an IPv4 address, a name, or an IPv6 address in brackets
(``[fd00::1]:52480``). :func:`from_env` reads and checks them (a script
started by hand can set them itself); ``PMETAL_LOCAL_RANK`` may then be
left out, and is the rank's index among the earlier ranks with the same
host. :meth:`LaunchEnv.environ` writes them: the launcher uses it, so
the writer and the reader cannot drift apart.

This module imports nothing beyond the standard library and
:mod:`pmetal.errors`: ``pmetal/config.py`` lists these names as variables
that stand outside its sections, so ``pmetal.init()`` in a launched script
does not refuse them as typos.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pmetal.errors import ConfigError

__all__ = [
    "LAUNCH_VARIABLES",
    "LaunchEnv",
    "format_node",
    "from_env",
    "parse_node",
]

RANK = "PMETAL_RANK"
WORLD_SIZE = "PMETAL_WORLD_SIZE"
LOCAL_RANK = "PMETAL_LOCAL_RANK"
NODES = "PMETAL_NODES"
LAUNCH_VARIABLES = (RANK, WORLD_SIZE, LOCAL_RANK, NODES)

_HOW = ("run the script with `pmetal launch -n N script.py` (which sets "
        f"{', '.join(LAUNCH_VARIABLES)}), or set them yourself")


def parse_node(text: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"``) as ``(host, port)``; ConfigError if malformed."""
    entry = text.strip()
    if entry.startswith("["):
        host, sep, port = entry[1:].partition("]:")
        if not sep or not host or "]" in host:
            raise ConfigError(f"{entry!r} is not host:port (an IPv6 host is written "
                              f"[address]:port)")
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise ConfigError(f"{entry!r}: {host!r} in brackets is not an IPv6 "
                              f"address") from exc
    else:
        host, sep, port = entry.rpartition(":")
        if not sep or not host:
            raise ConfigError(f"{entry!r} is not host:port (e.g. 10.0.0.2:52480)")
        if ":" in host:
            raise ConfigError(f"{entry!r}: write an IPv6 host in brackets, [address]:port")
    if any(c.isspace() for c in host):
        raise ConfigError(f"{entry!r}: the host {host!r} contains white space")
    if not port.isdecimal() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{entry!r}: the port must be a number from 1 to 65535, "
                          f"not {port!r}")
    return host, int(port)


def format_node(host: str, port: int) -> str:
    """The ``PMETAL_NODES`` entry for ``host`` and ``port`` (IPv6 in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _local_rank(nodes: Sequence[str], rank: int) -> int:
    host = parse_node(nodes[rank])[0]
    return sum(1 for entry in nodes[:rank] if parse_node(entry)[0] == host)


@dataclass(frozen=True)
class LaunchEnv:
    """Who this process is in a launched job; see the module docstring."""

    rank: int
    world_size: int
    local_rank: int
    nodes: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"{WORLD_SIZE}={self.world_size}: a job has at least one "
                              f"rank; {_HOW}")
        if len(self.nodes) != self.world_size:
            raise ConfigError(f"{NODES} lists {len(self.nodes)} address(es) but "
                              f"{WORLD_SIZE}={self.world_size}: it needs one host:port per "
                              f"rank, in rank order; {_HOW}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"{RANK}={self.rank} is out of range for {WORLD_SIZE}="
                              f"{self.world_size} (ranks are 0..{self.world_size - 1}); {_HOW}")
        if not 0 <= self.local_rank < self.world_size:
            raise ConfigError(f"{LOCAL_RANK}={self.local_rank} is out of range for "
                              f"{WORLD_SIZE}={self.world_size}; {_HOW}")
        seen: dict[tuple[str, int], int] = {}
        for r, entry in enumerate(self.nodes):
            try:
                address = parse_node(entry)
            except ConfigError as exc:
                raise ConfigError(f"{NODES}, entry {r} (rank {r}): {exc}; {_HOW}") from exc
            if address in seen:  # two ranks cannot listen on one address
                raise ConfigError(f"{NODES}: ranks {seen[address]} and {r} both have "
                                  f"{entry.strip()!r}; every rank needs its own host:port")
            seen[address] = r

    @property
    def address(self) -> str:
        """This rank's own ``host:port``, where it listens."""
        return self.nodes[self.rank]

    @staticmethod
    def is_set(environ: Mapping[str, str] | None = None) -> bool:
        """Whether this process looks launched: any of rank, world size or nodes set.

        :func:`from_env` then reports the missing or malformed ones."""
        environ = os.environ if environ is None else environ
        return any(name in environ for name in (RANK, WORLD_SIZE, NODES))

    def environ(self) -> dict[str, str]:
        """The variables that make :func:`from_env` return this value."""
        return {RANK: str(self.rank), WORLD_SIZE: str(self.world_size),
                LOCAL_RANK: str(self.local_rank), NODES: ",".join(self.nodes)}


def _integer(environ: Mapping[str, str], name: str) -> int:
    raw = environ.get(name)
    if raw is None:
        raise ConfigError(f"{name} is not set: this process was not started by "
                          f"`pmetal launch`; {_HOW}")
    try:
        return int(raw.strip(), 10)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not a whole number; {_HOW}") from exc


def from_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """This process's :class:`LaunchEnv`, read from ``environ`` (``os.environ``).

    Raises :class:`~pmetal.errors.ConfigError` naming the variable, its value
    and what to do, when one is missing or malformed, the rank is out of
    range, or the world size is not the number of nodes."""
    environ = os.environ if environ is None else environ
    rank = _integer(environ, RANK)
    world_size = _integer(environ, WORLD_SIZE)
    raw_nodes = environ.get(NODES)
    if raw_nodes is None or not raw_nodes.strip():
        state = "is not set" if raw_nodes is None else "is empty"
        raise ConfigError(f"{NODES} {state}: it lists the host:port of every rank; {_HOW}")
    nodes = tuple(entry.strip() for entry in raw_nodes.split(","))
    if LOCAL_RANK in environ:
        local_rank = _integer(environ, LOCAL_RANK)
    else:
        # The checks of LaunchEnv come first: _local_rank indexes nodes by rank.
        LaunchEnv(rank, world_size, 0, nodes)
        local_rank = _local_rank(nodes, rank)
    return LaunchEnv(rank, world_size, local_rank, nodes)
