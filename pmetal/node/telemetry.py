"""What this node's workers and drivers ran: calls, collectives, pipelines.

User code runs in workers and drivers, never in the node daemon (DESIGN.md
section 1), so what it did is counted there (:mod:`pmetal.tally`) and
reported here:

* each worker answers :class:`~pmetal.wire.TelemetryRequest`, which
  :meth:`NodeTelemetry.refresh` sends to every ready worker at once (0.5 s
  at most each, as ``pmetal status`` asks for calls) at each scrape of
  ``/metrics``; a worker busy in a long sync call is counted at the next;
* a worker that the node kills (``pmetal.kill``, its owner's end, a
  pipeline's close) is asked once more first, for at most 50 ms
  (:meth:`NodeTelemetry.last_words`);
* a driver (a script's client) pushes its :class:`~pmetal.wire.Telemetry`
  when it changed, at most once per ``metrics.report_interval`` seconds,
  and when it shuts down (:meth:`NodeTelemetry.accept`).

The node keeps each process's last report. A process that is gone (a
worker that exited, a driver of this machine whose process ended) has its
last report added
to the retired totals, so counters never go back; what it did after its
last report is lost with it. At most :data:`MAX_DRIVERS` drivers are held
(a newer one past that retires the oldest). Process CPU and memory of the
workers are read here from ``/proc`` (Linux), by role.

:meth:`NodeTelemetry.snapshot` is the one reader: ``/metrics`` and the
dashboard render its frozen value.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pmetal import shm
from pmetal.errors import PMetalError
from pmetal.tally import CALL_SECONDS, MAX_KEYS, OTHER
from pmetal.wire import Ack, Failure, Message, Telemetry, TelemetryRequest

if TYPE_CHECKING:
    from pmetal.node.pool import WorkerPool

__all__ = [
    "MAX_DRIVERS",
    "CallLatency",
    "CollectiveTelemetry",
    "NodeTelemetry",
    "PipelineTelemetry",
    "ProcessTelemetry",
    "StageTelemetry",
    "TelemetrySnapshot",
]

log = logging.getLogger(__name__)

MAX_DRIVERS = 64
"""Drivers whose last report a node holds at once."""

_ASK_WAIT = 0.5   # s a worker may take to answer a scrape's TelemetryRequest
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# ------------------------------------------------------------ the snapshot

@dataclass(frozen=True)
class CallLatency:
    """Calls by how long the worker took to run them (method and reply
    packing): ``counts[i]`` calls took at most ``bounds[i]`` seconds and
    more than the bound before; ``counts[-1]`` took longer than every
    bound. ``seconds``: their total."""
    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    seconds: float

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class CollectiveTelemetry:
    """Operations of collective group ``group`` run with ``strategy``
    (ring, tree, naive) by this node's processes: how many, their buffers'
    bytes (each rank's own, added over the ranks here) and seconds."""
    group: str
    strategy: str
    operations: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class StageTelemetry:
    """A pipeline stage hosted on this node: steps, compute seconds, and
    its hop to the next stage (the last stage's: to the driver): bytes,
    and seconds spent handing them to the link (queueing and
    backpressure; not their flight, which needs both ends' clocks)."""
    index: int
    steps: int
    seconds: float
    hop_bytes: int
    hop_seconds: float = 0.0

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class PipelineTelemetry:
    """A pipeline, as its driver on this node and its stages on this node
    ran it (each side is absent where it runs elsewhere: zeros, no
    stages). ``steps`` are the driver's hops round the ring, ``seconds``
    their summed round trips; ``bytes_sent``/``bytes_received`` its hops
    to the first stage and from the last, ``send_seconds`` the time it
    took to hand its hops to the link."""
    name: str
    stages: int
    tokens: int
    steps: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    stage_rows: tuple[StageTelemetry, ...] = ()
    send_seconds: float = 0.0

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class ProcessTelemetry:
    """This node's worker processes of one role (actor, task, lent):
    alive now, CPU seconds used (alive and exited ones), resident memory
    (alive ones)."""
    role: str
    processes: int
    cpu_seconds: float
    resident_bytes: int


@dataclass(frozen=True)
class TelemetrySnapshot:
    """Everything this module knows, at ``at`` (``time.time()``)."""
    at: float
    calls: int
    calls_failed: int
    latency: CallLatency
    objects_owned: int
    objects_borrowed: int
    collectives: tuple[CollectiveTelemetry, ...]
    pipelines: tuple[PipelineTelemetry, ...]
    processes: tuple[ProcessTelemetry, ...]
    reporters: int            # processes whose last report is held
    refreshed: float = 0.0    # time.time() the workers were last asked (0: never)


# ------------------------------------------------------------- the sums

@dataclass
class _Sums:
    """Reports added up (the retired ones, or a snapshot's)."""
    calls: int = 0
    failed: int = 0
    latency: list[int] = field(default_factory=lambda: [0] * (len(CALL_SECONDS) + 1))
    latency_sum: float = 0.0
    collectives: dict[tuple[str, str], list[Any]] = field(default_factory=dict)
    pipelines: dict[str, list[Any]] = field(default_factory=dict)
    stages: dict[tuple[str, int], list[Any]] = field(default_factory=dict)

    def add(self, report: Telemetry) -> None:
        self.calls += report.calls
        self.failed += report.failed
        if len(report.latency) == len(self.latency):
            for i, n in enumerate(report.latency):
                self.latency[i] += n
            self.latency_sum += report.latency_sum
        for group, strategy, ops, nbytes, seconds in _rows(report.collectives, _COLLECTIVE):
            _add(self.collectives, (group, strategy), (OTHER, strategy), [ops, nbytes, seconds])
        for name, stages, *counts in _rows(report.pipelines, _PIPELINE):
            row = _add(self.pipelines, name, OTHER, [0, *counts])
            row[0] = max(row[0], stages)
        for name, index, *counts in _rows(report.stages, _STAGE):
            _add(self.stages, (name, index), (OTHER, index), counts)

    def copy(self) -> _Sums:
        return _Sums(self.calls, self.failed, list(self.latency), self.latency_sum,
                     {k: list(v) for k, v in self.collectives.items()},
                     {k: list(v) for k, v in self.pipelines.items()},
                     {k: list(v) for k, v in self.stages.items()})


_NUMBER = (int, float)
_COLLECTIVE = (str, str, int, int, _NUMBER)
_PIPELINE = (str, int, int, int, _NUMBER, int, int, _NUMBER)
_STAGE = (str, int, int, _NUMBER, int, _NUMBER)


def _rows(rows: tuple[list, ...], types: tuple[Any, ...]) -> list[list[Any]]:
    """The rows of a report whose values have ``types``. A malformed row
    is skipped: a report is a peer's word, never a reason to fail a scrape."""
    return [r for r in rows if len(r) == len(types) and all(
        isinstance(v, t) and not isinstance(v, bool) for v, t in zip(r, types))]


def _add(table: dict[Any, list[Any]], key: Any, other: Any, values: list[Any]) -> list[Any]:
    if key not in table and len(table) >= MAX_KEYS:
        key = other
    row = table.get(key)
    if row is None:
        row = table[key] = [0] * len(values)
    for i, v in enumerate(values):
        row[i] += v
    return row


# ------------------------------------------------------ processes (/proc)

def _usage(pid: int) -> tuple[float, int] | None:
    """CPU seconds and resident bytes of ``pid`` (Linux), None elsewhere
    or when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/statm", "rb") as f:
            resident = int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    # fields[11], [12]: utime, stime (the 14th and 15th of the whole line)
    return (int(fields[11]) + int(fields[12])) / _TICKS, resident


# ---------------------------------------------------------------- the hub

class NodeTelemetry:
    """The reports of this node's workers and drivers (see the module
    docstring). Lives in the node's event loop."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.workers: dict[str, Telemetry] = {}       # worker id -> last report
        self.drivers: dict[str, Telemetry] = {}       # session peer -> last report
        self._pids: dict[str, int] = {}               # session peer -> proved local pid
        self.retired = _Sums()
        self._cpu: dict[str, tuple[str, float]] = {}  # worker id -> (role, last cpu seconds)
        self._retired_cpu: dict[str, float] = {}      # role -> cpu seconds of exited workers
        self.refreshes = 0
        self.refreshed = 0.0      # time.time() of the last refresh

    # ---------------------------------------------------------- reports in

    def accept(self, peer: str, report: Telemetry, pid: int = 0) -> Message:
        """A driver's push (its session's peer id names it). ``pid``: its
        process id as its session proved it runs on this machine (0: not
        proved, a driver on another machine), by which it is retired once
        it ended; an unproved one stays until :data:`MAX_DRIVERS` newer
        ones pushed (the report's own ``pid`` is its word only)."""
        if report.role != "driver":
            return Failure("bad_request", "ProtocolError",
                           f"a Telemetry push must come from a driver, not a {report.role!r}")
        if peer not in self.drivers and len(self.drivers) >= MAX_DRIVERS:
            oldest = next(iter(self.drivers))
            self.retired.add(self.drivers.pop(oldest))
            self._pids.pop(oldest, None)
        self.drivers.pop(peer, None)
        self.drivers[peer] = report      # the most recent push last
        self._pids[peer] = pid
        return Ack()

    async def last_words(self, worker: Any) -> None:
        """Ask a worker that is about to be killed for its report, on the
        channel the node has open to it (the pool's ``end`` bounds the wait)."""
        if worker.channel is None:
            return
        reply = (await worker.channel.arequest(TelemetryRequest(), timeout=_ASK_WAIT)).body
        if isinstance(reply, Telemetry):
            self.workers[worker.worker_id] = reply

    async def refresh(self) -> None:
        """Ask every ready worker for its report (side by side, 0.5 s at
        most each), retire the processes that are gone, read the workers'
        CPU and memory."""
        self.refreshes += 1
        pool = self.pool

        async def ask(worker: Any) -> None:
            try:
                channel = await pool.channel(worker, _ASK_WAIT)
                reply = (await channel.arequest(TelemetryRequest(), timeout=_ASK_WAIT)).body
            except PMetalError:
                return
            if isinstance(reply, Telemetry) and worker.worker_id in pool.workers:
                self.workers[worker.worker_id] = reply

        ready = [w for w in pool.workers.values() if w.ready.is_set() and w.address]
        # return_exceptions: a worker that dies meanwhile has its channel
        # closed under the ask (which ends cancelled); the others still count.
        await asyncio.gather(*(ask(w) for w in ready), return_exceptions=True)
        self._retire()
        self.refreshed = time.time()

    def _retire(self) -> None:
        live = self.pool.workers
        for worker_id in [w for w in self.workers if w not in live]:
            self.retired.add(self.workers.pop(worker_id))
        for worker_id in [w for w in self._cpu if w not in live]:
            role, cpu = self._cpu.pop(worker_id)
            self._retired_cpu[role] = self._retired_cpu.get(role, 0.0) + cpu
        for peer in [p for p, pid in self._pids.items() if pid and not shm.pid_alive(pid)]:
            self.retired.add(self.drivers.pop(peer))
            del self._pids[peer]

    def _processes(self) -> tuple[ProcessTelemetry, ...]:
        by_role: dict[str, list[Any]] = {r: [0, c, 0] for r, c in self._retired_cpu.items()}
        for worker in list(self.pool.workers.values()):
            pid = worker.proc.pid
            usage = _usage(pid) if pid is not None else None
            row = by_role.setdefault(worker.role, [0, 0.0, 0])
            row[0] += 1
            if usage is None:
                continue
            cpu, resident = usage
            self._cpu[worker.worker_id] = (worker.role, cpu)
            row[1] += cpu
            row[2] += resident
        return tuple(ProcessTelemetry(role, n, cpu, rss)
                     for role, (n, cpu, rss) in sorted(by_role.items()))

    # ------------------------------------------------------------ reading

    def snapshot(self) -> TelemetrySnapshot:
        """The counters as of the last reports: the workers' as of the last
        :meth:`refresh` (a scrape of ``/metrics`` makes one; a reader that
        wants them fresh awaits it first), the drivers' as they pushed."""
        sums = self.retired.copy()
        owned = borrowed = 0
        for report in (*self.workers.values(), *self.drivers.values()):
            sums.add(report)
            owned += report.owned
            borrowed += report.borrowed
        stages: dict[str, list[StageTelemetry]] = {}
        for (name, index), (steps, seconds, nbytes, send) in sorted(sums.stages.items()):
            stages.setdefault(name, []).append(StageTelemetry(index, steps, seconds, nbytes,
                                                              send))
        pipelines = {name: PipelineTelemetry(name, *row[:6], send_seconds=row[6],
                                             stage_rows=tuple(stages.pop(name, ())))
                     for name, row in sums.pipelines.items()}
        for name, rows in stages.items():   # stages here, their driver elsewhere
            pipelines[name] = PipelineTelemetry(name, 0, 0, 0, 0.0, 0, 0, tuple(rows))
        return TelemetrySnapshot(
            at=time.time(), calls=sums.calls, calls_failed=sums.failed,
            latency=CallLatency(CALL_SECONDS, tuple(sums.latency), sums.latency_sum),
            objects_owned=owned, objects_borrowed=borrowed,
            collectives=tuple(CollectiveTelemetry(g, s, int(o), int(b), float(t))
                              for (g, s), (o, b, t) in sorted(sums.collectives.items())),
            pipelines=tuple(p for _, p in sorted(pipelines.items())),
            processes=self._processes(),
            reporters=len(self.workers) + len(self.drivers), refreshed=self.refreshed)
