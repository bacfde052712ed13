"""What this process ran, tallied for its node's metrics.

Collectives and pipelines run in workers and drivers, not in the node
daemon that serves ``/metrics``. Each process keeps one :class:`Tally`
(:data:`TALLY`): collective operations by group and strategy, a pipeline
driver's tokens and steps, each pipeline stage's steps and hop bytes, and
the objects it owns. Counting is a lock and a few additions per
operation or step (each one milliseconds long), never per byte.

Its node reads it: a worker answers the node's
:class:`~pmetal.wire.TelemetryRequest` at each scrape with
:meth:`Tally.report`; a driver's client pushes the report to its node when
it changed, at most once per ``metrics.report_interval`` seconds, and once
more when it shuts down (:mod:`pmetal.actors.reporter`). The node keeps
the last report of each process (:mod:`pmetal.node.telemetry`).

One per process, as prometheus_client's default registry is: what it
counts belongs to the process, whichever client or group did it. It is
bounded: at most :data:`MAX_KEYS` groups (and pipelines, and stages); the
ones past that are added under the name ``"(other)"``, so totals stay
right and the node's label sets stay few.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["CALL_SECONDS", "MAX_KEYS", "OTHER", "TALLY", "Tally"]

CALL_SECONDS = (0.0005, 0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10.0)
"""Upper bounds (seconds) of the buckets of a worker's call durations
(``pmetal_actor_call_duration_seconds``): few, from a small method's
fraction of a millisecond to a long computation."""

MAX_KEYS = 32
"""Names kept apart per table (collective groups, pipelines, stages)."""

OTHER = "(other)"


@dataclass
class _Collective:
    operations: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class _Pipeline:
    stages: int = 0
    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0        # summed round trips of the driver's hops
    bytes_sent: int = 0         # the driver's hops out (to stage 0)
    bytes_received: int = 0     # and back (from the last stage)
    send_seconds: float = 0.0   # handing its hops to the link (queueing, backpressure)


@dataclass
class _Stage:
    steps: int = 0
    seconds: float = 0.0        # compute
    bytes_out: int = 0          # its hop to the next stage (the last: to the driver)
    send_seconds: float = 0.0   # handing that hop to the link


class Tally:
    """The process's counters (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.version = 0          # changes with every count: a reporter's "anything new?"
        self.changed = threading.Event()   # set by every count; cleared by the reporter
        self._collectives: dict[tuple[str, str], _Collective] = {}
        self._pipelines: dict[str, _Pipeline] = {}
        self._stages: dict[tuple[str, int], _Stage] = {}

    def _bump(self) -> None:
        self.version += 1
        self.changed.set()

    @staticmethod
    def _key(table: dict[Any, Any], key: Any, other: Any) -> Any:
        return key if key in table or len(table) < MAX_KEYS else other

    def collective(self, group: str, strategy: str, nbytes: int, seconds: float) -> None:
        """One collective operation of ``group`` that ran ``strategy`` over
        a buffer of ``nbytes``, in ``seconds``."""
        with self._lock:
            key = self._key(self._collectives, (group, strategy), (OTHER, strategy))
            entry = self._collectives.get(key)
            if entry is None:
                entry = self._collectives[key] = _Collective()
            entry.operations += 1
            entry.bytes += nbytes
            entry.seconds += seconds
            self._bump()

    def pipeline_step(self, name: str, stages: int, tokens: int, seconds: float,
                      sent: int, received: int, send_seconds: float = 0.0) -> None:
        """One hop of a pipeline driver round the ring: ``tokens`` came
        back, ``seconds`` after it left; ``sent``/``received``: the driver's
        hop bytes; ``send_seconds``: handing its hop to the link took that."""
        with self._lock:
            key = self._key(self._pipelines, name, OTHER)
            entry = self._pipelines.get(key)
            if entry is None:
                entry = self._pipelines[key] = _Pipeline()
            entry.stages = stages
            entry.tokens += tokens
            entry.steps += 1
            entry.seconds += seconds
            entry.bytes_sent += sent
            entry.bytes_received += received
            entry.send_seconds += send_seconds
            self._bump()

    def stage_step(self, name: str, index: int, seconds: float, bytes_out: int,
                   send_seconds: float = 0.0) -> None:
        """One step of stage ``index`` of pipeline ``name``: ``seconds`` of
        compute, ``bytes_out`` sent on its hop to the next in
        ``send_seconds``."""
        with self._lock:
            key = self._key(self._stages, (name, index), (OTHER, index))
            entry = self._stages.get(key)
            if entry is None:
                entry = self._stages[key] = _Stage()
            entry.steps += 1
            entry.seconds += seconds
            entry.bytes_out += bytes_out
            entry.send_seconds += send_seconds
            self._bump()

    def report(self) -> dict[str, list[list[Any]]]:
        """The counters as plain lists (msgpack): ``collectives`` rows
        ``[group, strategy, operations, bytes, seconds]``, ``pipelines``
        rows ``[name, stages, tokens, steps, seconds, bytes_sent,
        bytes_received, send_seconds]``, ``stages`` rows ``[name, index,
        steps, seconds, bytes_out, send_seconds]``."""
        with self._lock:
            return {
                "collectives": [[g, s, e.operations, e.bytes, e.seconds]
                                for (g, s), e in self._collectives.items()],
                "pipelines": [[n, e.stages, e.tokens, e.steps, e.seconds, e.bytes_sent,
                               e.bytes_received, e.send_seconds]
                              for n, e in self._pipelines.items()],
                "stages": [[n, i, e.steps, e.seconds, e.bytes_out, e.send_seconds]
                           for (n, i), e in self._stages.items()],
            }


TALLY = Tally()
"""This process's tally."""
