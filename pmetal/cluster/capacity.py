"""What a node can give a pipeline stage now: compute rate, free memory, links.

Pipeline placement (:mod:`pmetal.pipeline.placement`) asks every member
for these figures when a pipeline is built (``ResourcesRequest(measure=True)``,
answered with a :class:`Capacity` in ``Resources.capacity``):

* ``compute``: the GFLOP/s of float32 matrix products this node's process
  gets over a short wall-clock window, with a thread on each CPU it may run
  on (:func:`measure_compute_rate`). Over wall-clock time, where
  :attr:`~pmetal.cluster.topology.NodeProfile.gflops` is one core's best
  timing (what the hardware can do): so a CPU quota (a container's, a
  cgroup's ``cpu.max``), a narrow CPU affinity or a machine busy with other
  work shows, as it would for a stage placed there. Measured on first need
  by a :class:`ComputeMeter`, in a thread (the node keeps serving), one
  measurement at a time, and kept for :data:`REFRESH` seconds: a node's
  start never pays for it.
* ``memory_free``: what the OS reports available at the moment of asking
  (``MemAvailable`` on Linux, free + inactive pages on macOS), not the total.
* ``links``: the node's own view of its links, by peer id: one-way latency
  from its heartbeats, bandwidth from its probes (``pmetal status --probe``),
  None where not measured.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pmetal.cluster.topology import ClusterTopology, memory_now
from pmetal.errors import PMetalError, PMetalValueError, ProtocolError

__all__ = ["REFRESH", "WINDOW", "Capacity", "ComputeMeter", "ComputeStatistics", "LinkFigures",
           "current_capacity", "measure_compute_rate", "usable_cpus"]

log = logging.getLogger(__name__)

WINDOW = 0.25       # s of wall-clock time one measurement of the compute rate takes
REFRESH = 600.0     # s a measured compute rate is used before it is measured again
_START_WAIT = 30.0  # s the measurement's threads may take to get ready (a starved machine)


@dataclass(frozen=True)
class LinkFigures:
    """What a node measured of its link to one peer: one-way ``latency`` in
    s, ``bandwidth`` in bytes/s; None where not measured."""

    latency: float | None = None
    bandwidth: float | None = None


@dataclass(frozen=True)
class Capacity:
    """A node's figures for placement (see the module docstring).
    ``compute`` is 0.0 when not measured (then ``compute_age`` is None),
    ``memory_free`` 0 when the OS does not tell."""

    memory_free: int = 0
    compute: float = 0.0
    compute_age: float | None = None
    links: Mapping[str, LinkFigures] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"memory_free": self.memory_free, "compute": self.compute,
                "compute_age": self.compute_age,
                "links": {peer: {"latency": f.latency, "bandwidth": f.bandwidth}
                          for peer, f in sorted(self.links.items())}}

    @classmethod
    def from_dict(cls, data: Any) -> Capacity:
        """A capacity from a ``Resources.capacity`` map; unknown keys are
        ignored (a newer peer may send more), missing ones defaulted.
        Raises ProtocolError on a value of the wrong type or sign."""
        if not isinstance(data, Mapping):
            raise ProtocolError(f"a capacity must be a map, not {type(data).__name__}")
        memory = _number(data, "memory_free", 0)
        compute = _number(data, "compute", 0.0)
        age = data.get("compute_age")
        if age is not None:
            age = _number(data, "compute_age", 0.0)
        links_in = data.get("links") or {}
        if not isinstance(links_in, Mapping):
            raise ProtocolError(f"capacity links must be a map, not {type(links_in).__name__}")
        links = {}
        for peer, figures in links_in.items():
            if not isinstance(peer, str) or not isinstance(figures, Mapping):
                raise ProtocolError(f"capacity link {peer!r}: a peer id and a map, not "
                                    f"{figures!r}")
            links[peer] = LinkFigures(
                *(None if figures.get(k) is None else float(_number(figures, k, 0.0))
                  for k in ("latency", "bandwidth")))
        return cls(int(memory), float(compute), None if age is None else float(age), links)


def _number(data: Mapping[str, Any], key: str, default: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ProtocolError(f"capacity field {key!r} must be a non-negative number, not "
                            f"{value!r}")
    return value


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):     # macOS has no affinity
        return os.cpu_count() or 1


def measure_compute_rate(window: float = WINDOW, threads: int | None = None) -> float:
    """GFLOP/s this process gets now on float32 matrix products: ``threads``
    threads (default: one per usable CPU) each multiply batches of sixteen
    64 x 64 matrices until ``window`` seconds of wall-clock time have passed;
    the figure is the work they finished over the time it took.

    Products this small run on one BLAS thread each, and numpy lets go of
    the GIL while they run, so the threads use as many CPUs as the process
    is given. Wall-clock time, so whatever keeps the process off a CPU (a
    quota, other work) lowers the figure, as it would slow a stage: at least
    a few scheduler periods (100 ms for a cgroup's quota by default) must
    fit in ``window``."""
    if not window > 0:
        raise PMetalValueError(f"window {window!r} must be a positive number of seconds")
    import numpy as np

    count = threads if threads is not None else usable_cpus()
    if count < 1:
        raise PMetalValueError(f"threads {threads!r} must be >= 1")
    size, depth = 64, 16
    done = [0] * count
    ready = threading.Barrier(count + 1)

    def work(i: int) -> None:
        try:
            rng = np.random.default_rng(i)
            a = rng.standard_normal((depth, size, size), dtype=np.float32)
            out = np.empty_like(a)
            np.matmul(a, a, out=out)      # first-call costs stay outside the window
        except BaseException:
            ready.abort()                 # the others (and the caller) stop waiting
            raise
        ready.wait(_START_WAIT)
        end, n = time.perf_counter() + window, 0
        while time.perf_counter() < end:
            np.matmul(a, a, out=out)
            n += 1
        done[i] = n

    workers = [threading.Thread(target=work, args=(i,), name=f"pmetal-compute-{i}",
                                daemon=True) for i in range(count)]
    for worker in workers:
        worker.start()
    try:
        ready.wait(_START_WAIT)
    except threading.BrokenBarrierError as exc:
        raise PMetalError("the compute measurement's threads did not start (see the "
                          "log for a thread's error)") from exc
    start = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - start
    return 2.0 * size ** 3 * depth * sum(done) / max(elapsed, 1e-9) / 1e9


@dataclass(frozen=True, slots=True)
class ComputeStatistics:
    """A meter's counters: measurements taken and failed, the last rate
    (GFLOP/s, 0.0 before any) and its age in s (None before any)."""

    measurements: int
    failures: int
    rate: float
    age: float | None


class ComputeMeter:
    """This node's compute rate, measured on first need and kept for
    ``refresh`` seconds. :meth:`rate` runs the measurement in a thread (the
    node's loop keeps serving), one at a time: callers that come meanwhile
    wait for its result. A failed measurement counts as unmeasured (0.0)
    and is tried again at the next call."""

    def __init__(self, *, window: float = WINDOW, refresh: float = REFRESH,
                 clock: Callable[[], float] = time.monotonic,
                 measure: Callable[[float], float] | None = None) -> None:
        self.window = window
        self.refresh = refresh
        self._clock = clock
        self._measure = measure or (lambda w: measure_compute_rate(w))
        self._lock = asyncio.Lock()
        self._rate = 0.0
        self._at: float | None = None
        self.measurements = 0
        self.failures = 0

    def statistics(self) -> ComputeStatistics:
        return ComputeStatistics(self.measurements, self.failures, *self.cached())

    def cached(self) -> tuple[float, float | None]:
        """(GFLOP/s, seconds since measured) without measuring: (0.0, None)
        when never measured."""
        if self._at is None:
            return 0.0, None
        return self._rate, self._clock() - self._at

    async def rate(self) -> tuple[float, float | None]:
        """(GFLOP/s, seconds since measured), measuring first when the last
        figure is older than ``refresh`` or missing."""
        async with self._lock:
            if self._at is None or self._clock() - self._at > self.refresh:
                try:
                    rate = await asyncio.to_thread(self._measure, self.window)
                except Exception as exc:  # noqa: BLE001 - placement falls back to defaults
                    self.failures += 1
                    log.warning("could not measure this node's compute rate: %s", exc)
                    return 0.0, None
                self._rate, self._at = float(rate), self._clock()
                self.measurements += 1
                log.info("compute rate measured: %.1f GFLOP/s over %.2f s", rate, self.window)
            return self.cached()


async def current_capacity(meter: ComputeMeter, topology: ClusterTopology,
                           own_id: str) -> Capacity:
    """This node's :class:`Capacity` now: the meter's rate (measured if due),
    the OS's free memory, and the links ``topology`` holds from ``own_id``."""
    rate, age = await meter.rate()
    links = {}
    for peer in topology.nodes():
        link = None if peer == own_id else topology.link(own_id, peer)
        if link is not None and link.known:
            links[peer] = LinkFigures(link.latency, link.bandwidth)
    return Capacity(memory_now()[1], rate, age, links)
