"""The cluster's machines and the links between them, and the shapes they suggest.

What it owns: a rustworkx graph whose nodes carry a :class:`NodeProfile`
(memory, cores, chip, a quick measured compute figure; exchanged in the
``profile`` map of member entries) and whose edges carry a
:class:`ConnectionProfile` (latency from heartbeats, bandwidth from an
on-demand probe). What changes it: the node's shell, with
:meth:`ClusterTopology.add_node` and :meth:`~ClusterTopology.remove_node` as
members come and go and :meth:`~ClusterTopology.update_link` as beats are
echoed and probes answered. What a caller gets: :meth:`~ClusterTopology.best_ring`
and :meth:`~ClusterTopology.best_tree`, the orders the collectives use.

Links are undirected: a round trip measures both directions at once, and a
probe in either direction stands for both (home networks are symmetric
enough; a Wi-Fi uplink that is not is a known limit). A link never measured
is *unknown*: it ranks after every measured link but never stops a ring or
a tree from being built.

This module is pure but for :meth:`NodeProfile.local`, which reads this
machine; the probe's messages are sent by the shell (:func:`probe_plan` says
what to send, :func:`bandwidth_from` what the timings mean).
"""

from __future__ import annotations

import itertools
import logging
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import rustworkx as rx

from pmetal.errors import PMetalValueError, ProtocolError
from pmetal.hardware import gpu_count

__all__ = [
    "ClusterTopology",
    "ConnectionProfile",
    "NodeProfile",
    "bandwidth_from",
    "measure_gflops",
    "memory_now",
    "probe_plan",
]

log = logging.getLogger(__name__)

# A link's cost is the time to move this much over it: latency plus transfer
# (the transport's chunk size, the unit a ring step moves when buffers are large).
_REFERENCE_BYTES = 1 << 20
_EXACT_RING = 8          # rings of up to this many nodes are searched exhaustively
_PROBE_SMALL = 4096      # the probe payload whose time is mostly latency


# ------------------------------------------------------------ node profiles

@dataclass(frozen=True)
class NodeProfile:
    """One machine as the scheduler sees it. Memory in bytes (``memory_free``
    is what the OS reports as available, 0 where it cannot tell); ``gflops``
    is one core's, from :func:`measure_gflops`, 0.0 when not measured
    (:attr:`total_gflops` estimates the machine's)."""

    node_id: str
    memory_total: int = 0
    memory_free: int = 0
    cores: int = 1
    chip: str = ""
    gflops: float = 0.0
    gpus: int = 0

    @classmethod
    def local(cls, node_id: str, *, measure: bool = True) -> NodeProfile:
        """This machine's profile; ``measure`` runs :func:`measure_gflops`
        (a few milliseconds)."""
        total, free = memory_now()
        return cls(node_id, total, free, os.cpu_count() or 1, _chip(),
                   measure_gflops() if measure else 0.0, gpu_count())

    @property
    def total_gflops(self) -> float:
        return self.gflops * self.cores

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], node_id: str | None = None) -> NodeProfile:
        """A profile from a member entry's ``profile`` map: unknown keys are
        ignored (a newer peer may send more), missing ones take their
        defaults. ``node_id``, the id the peer proved in the handshake,
        overrides the map's."""
        if not isinstance(data, Mapping):
            raise ProtocolError(f"a node profile must be a map, not {type(data).__name__}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            value, kind = data[f.name], {"str": str, "int": int, "float": float}[str(f.type)]
            ok = isinstance(value, str) if kind is str else (
                isinstance(value, (int, float)) and not isinstance(value, bool))
            if not ok or (kind is not str and value < 0):
                want = "a str" if kind is str else f"a non-negative {kind.__name__}"
                raise ProtocolError(f"node profile field {f.name!r} must be {want}, "
                                    f"not {value!r}")
            values[f.name] = kind(value)
        if node_id is not None:
            values["node_id"] = node_id
        if not values.get("node_id"):
            raise ProtocolError("a node profile without a node_id")
        return cls(**values)


def measure_gflops(samples: int = 20, budget: float = 0.05) -> float:
    """One core's GFLOP/s on float32 matrix products: the best of up to
    ``samples`` timings (three at least, stopping after ``budget`` seconds)
    of 16 products of 64 x 64 matrices.

    One core, because that figure is stable: BLAS runs products this small
    on one thread, where a large product runs on every core and, when
    another process holds one of them, waits for it (here a 256 x 256
    product on two busy cores came out 50 to 100 times slower, run after
    run). The best timing, because load only ever makes one slower. A quick
    relative figure for weighing machines, not a peak; a machine's is about
    ``gflops * cores``."""
    import numpy as np

    size, depth = 64, 16
    rng = np.random.default_rng(0)
    a = rng.standard_normal((depth, size, size), dtype=np.float32)
    b = rng.standard_normal((depth, size, size), dtype=np.float32)
    out = np.empty_like(a)
    np.matmul(a, b, out=out)   # first-call costs stay outside the timing
    best, start = float("inf"), time.perf_counter()
    for i in range(samples):
        t = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t)
        if i >= 2 and time.perf_counter() - start > budget:
            break
    return 2.0 * size ** 3 * depth / max(best, 1e-9) / 1e9


def memory_now() -> tuple[int, int]:
    """(total, available) bytes of this machine's memory as the OS reports
    them now (available: what it hands out without swapping; 0 where it
    cannot tell)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            return parse_meminfo(f.read())
    except OSError:
        pass
    if platform.system() == "Darwin":
        total = _sysctl("hw.memsize")
        vm = _run(["vm_stat"])
        return (int(total) if total.isdigit() else _sysconf_memory(),
                parse_vm_stat(vm) if vm else 0)
    return _sysconf_memory(), 0


def _sysconf_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def parse_meminfo(text: str) -> tuple[int, int]:
    """(total, available) bytes from Linux's /proc/meminfo."""
    kb = {m.group(1): int(m.group(2)) * 1024
          for m in re.finditer(r"^(\w+):\s+(\d+) kB", text, re.MULTILINE)}
    return kb.get("MemTotal", 0), kb.get("MemAvailable", kb.get("MemFree", 0))


def parse_vm_stat(text: str) -> int:
    """Available bytes from macOS's ``vm_stat``: free, inactive and
    speculative pages (what the OS hands out without swapping)."""
    page = re.search(r"page size of (\d+) bytes", text)
    pages = {m.group(1): int(m.group(2))
             for m in re.finditer(r"^Pages (\w+):\s+(\d+)\.", text, re.MULTILINE)}
    size = int(page.group(1)) if page else 4096
    return size * sum(pages.get(k, 0) for k in ("free", "inactive", "speculative"))


def _chip() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            name = chip_from_cpuinfo(f.read())
        if name:
            return name
    except OSError:
        pass
    if platform.system() == "Darwin":
        name = _sysctl("machdep.cpu.brand_string")
        if name:
            return name
    return platform.processor() or platform.machine() or "unknown"


def chip_from_cpuinfo(text: str) -> str:
    """The CPU's name in Linux's /proc/cpuinfo: ``model name`` (x86), else
    ``Model`` or ``Hardware`` (ARM boards such as a Raspberry Pi)."""
    for key in ("model name", "Model", "Hardware", "cpu model"):
        m = re.search(rf"^{key}\s*:\s*(.+?)\s*$", text, re.MULTILINE)
        if m:
            return m.group(1)
    return ""


def _sysctl(name: str) -> str:
    return _run(["sysctl", "-n", name]).strip()


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=5,
                              check=False).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("%s failed (%s): the node profile leaves it out", argv[0], exc)
        return ""


# ------------------------------------------------------------------ links

@dataclass(frozen=True)
class ConnectionProfile:
    """A link. ``latency`` is one way, in seconds: half the median round trip
    of beats (health's summary ``rtt / 2``), None until measured;
    ``bandwidth`` is bytes/s from :func:`bandwidth_from`, None until probed;
    ``measured_at`` the caller's clock at the last update."""

    latency: float | None = None
    bandwidth: float | None = None
    measured_at: float = 0.0

    @property
    def known(self) -> bool:
        return self.latency is not None or self.bandwidth is not None

    def cost(self, nbytes: int = _REFERENCE_BYTES) -> float:
        """Seconds to move ``nbytes`` over the link, as far as it is known."""
        transfer = nbytes / self.bandwidth if self.bandwidth else 0.0
        return (self.latency or 0.0) + transfer


def probe_plan(max_bytes: int = 4 << 20, repeats: int = 3) -> list[int]:
    """Payload sizes of one bandwidth probe, in the order to send them (each
    a ``wire.Probe``, answered by an ``Ack``, timed by the sender): small and
    large alternate so that a change of load during the probe hits both."""
    if max_bytes <= _PROBE_SMALL or repeats < 1:
        raise PMetalValueError(f"a probe needs max_bytes > {_PROBE_SMALL} and repeats >= 1, "
                               f"not {max_bytes} and {repeats}")
    return [_PROBE_SMALL, max_bytes] * repeats


def bandwidth_from(samples: Iterable[tuple[int, float]]) -> float:
    """Bytes/s from probes' (payload bytes, round-trip seconds).

    With two sizes or more, the median time of the smallest payload is the
    fixed part (latency, the answer, scheduling), and each larger probe
    gives ``(bytes - small) / (seconds - small_seconds)``; the median of
    those is the figure, so one stalled probe does not move it. With one
    size only, the median of ``bytes / seconds``, which includes latency
    and so understates the link."""
    usable = [(int(n), float(t)) for n, t in samples if n > 0 and t > 0]
    if not usable:
        raise PMetalValueError("no probe timing to compute a bandwidth from (each needs "
                               "a positive size and a positive duration)")
    small = min(n for n, _ in usable)
    base = statistics.median(t for n, t in usable if n == small)
    rates = [(n - small) / (t - base) for n, t in usable if n > small and t > base]
    if rates:
        return float(statistics.median(rates))
    return float(statistics.median(n / t for n, t in usable))


# ------------------------------------------------------------------- graph

class ClusterTopology:
    def __init__(self) -> None:
        self._graph: rx.PyGraph = rx.PyGraph(multigraph=False)
        self._index: dict[str, int] = {}

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._index

    def __len__(self) -> int:
        return len(self._index)

    def add_node(self, profile: NodeProfile) -> None:
        """Add a machine, or refresh its profile (its links stay)."""
        index = self._index.get(profile.node_id)
        if index is None:
            self._index[profile.node_id] = self._graph.add_node(profile)
        else:
            self._graph[index] = profile

    def remove_node(self, node_id: str) -> None:
        index = self._index.pop(node_id, None)
        if index is not None:
            self._graph.remove_node(index)

    def update_link(self, a: str, b: str, latency: float | None = None,
                    bandwidth: float | None = None, *, now: float) -> bool:
        """Record a measurement of the link between ``a`` and ``b`` (what is
        None keeps its last value). False, and nothing recorded, when either
        is not a node yet: the next beat measures the link again."""
        if a == b:
            raise PMetalValueError(f"a link joins two nodes, not {a!r} to itself")
        ia, ib = self._index.get(a), self._index.get(b)
        if ia is None or ib is None:
            log.debug("link %s-%s measured before both are in the topology: skipped", a, b)
            return False
        old = self.link(a, b) or ConnectionProfile()
        self._graph.add_edge(ia, ib, ConnectionProfile(
            old.latency if latency is None else latency,
            old.bandwidth if bandwidth is None else bandwidth, now))
        return True

    def nodes(self) -> list[str]:
        return sorted(self._index)

    def profile(self, node_id: str) -> NodeProfile:
        profile: NodeProfile = self._graph[self._node(node_id)]
        return profile

    def link(self, a: str, b: str) -> ConnectionProfile | None:
        ia, ib = self._node(a), self._node(b)
        if not self._graph.has_edge(ia, ib):
            return None
        link: ConnectionProfile = self._graph.get_edge_data(ia, ib)
        return link

    def best_ring(self, nodes: Iterable[str] | None = None) -> list[str]:
        """An order of ``nodes`` (default all) to use as a ring: the one whose
        slowest link is fastest, then whose links add up to least, then the
        first by node ids (so every node computes the same ring). It starts
        at the smallest id. Exact up to eight nodes; beyond, nearest
        neighbour then 2-opt moves while they improve."""
        ids = self._select(nodes)
        if len(ids) <= 3:
            return ids    # every order of three or fewer is the same ring
        cost = self._costs(ids)
        n = len(ids)
        if n <= _EXACT_RING:
            # Index order is id order, so the smallest ring key also breaks ties by id.
            best = min(((0, *p) for p in itertools.permutations(range(1, n))),
                       key=lambda r: (_ring_key(r, cost), r))
        else:
            best = _ring_heuristic(n, cost)
        return [ids[i] for i in best]

    def best_tree(self, root: str, nodes: Iterable[str] | None = None) -> dict[str, list[str]]:
        """A broadcast (or, reversed, reduce) tree over ``nodes`` (default
        all, root included) as a children map with every node a key; each
        list is in the order its parent should send.

        A binomial tree built greedily: in each round every node that
        already has the data sends to one that has not, over its fastest
        link to such a node (ties by id). Depth is ceil(log2(n)), which is
        the fewest rounds any broadcast needs; on a uniform network it is
        the textbook binomial tree in id order. Chosen over a minimum
        spanning tree, which can degenerate into a chain n deep."""
        ids = self._select(nodes, must_include=root)
        cost = self._costs(ids)
        r = ids.index(root)
        children: dict[int, list[int]] = {i: [] for i in range(len(ids))}
        have, waiting = [r], set(range(len(ids))) - {r}
        while waiting:
            for sender in list(have):
                if not waiting:
                    break
                child = min(waiting, key=lambda j: (cost[sender][j], j))
                waiting.discard(child)
                children[sender].append(child)
                have.append(child)
        return {ids[i]: [ids[j] for j in kids] for i, kids in children.items()}

    def to_dict(self) -> dict[str, Any]:
        """For ``pmetal status --json``: node profiles and measured links."""
        links = []
        for a, b in itertools.combinations(self.nodes(), 2):
            link = self.link(a, b)
            if link is not None:
                links.append({"a": a, "b": b, **asdict(link)})
        return {"nodes": [self.profile(n).to_dict() for n in self.nodes()], "links": links}

    # ---------------------------------------------------------- internals

    def _node(self, node_id: str) -> int:
        try:
            return self._index[node_id]
        except KeyError:
            raise PMetalValueError(f"node {node_id!r} is not in the topology; the nodes "
                                   f"are {self.nodes()}") from None

    def _select(self, nodes: Iterable[str] | None, must_include: str | None = None) -> list[str]:
        ids = self.nodes() if nodes is None else sorted(set(nodes))
        for node_id in ids:
            self._node(node_id)
        if must_include is not None and must_include not in ids:
            self._node(must_include)
            raise PMetalValueError(f"the root {must_include!r} is not among the nodes {ids}")
        return ids

    def _costs(self, ids: list[str]) -> list[list[tuple[int, float]]]:
        """Pairwise link costs: (0, seconds) when measured, (1, 0.0) when not,
        so any measured link sorts before any unknown one."""
        out = []
        for a in ids:
            row = []
            for b in ids:
                link = None if a == b else self.link(a, b)
                row.append((0, link.cost()) if link is not None and link.known else (1, 0.0))
            out.append(row)
        return out


def _ring_key(ring: tuple[int, ...],
              cost: list[list[tuple[int, float]]]) -> tuple[tuple[int, float], int, float]:
    steps = [cost[a][b] for a, b in zip(ring, ring[1:] + ring[:1])]
    return max(steps), sum(u for u, _ in steps), sum(s for _, s in steps)


def _ring_heuristic(n: int, cost: list[list[tuple[int, float]]]) -> tuple[int, ...]:
    ring, left = [0], set(range(1, n))
    while left:
        nxt = min(left, key=lambda j: (cost[ring[-1]][j], j))
        ring.append(nxt)
        left.discard(nxt)
    key = _ring_key(tuple(ring), cost)
    improved = True
    while improved:
        improved = False
        for i, j in itertools.combinations(range(1, n), 2):
            candidate = ring[:i] + ring[i:j + 1][::-1] + ring[j + 1:]
            new = _ring_key(tuple(candidate), cost)
            if new < key:
                ring, key, improved = candidate, new, True
    return tuple(ring)
