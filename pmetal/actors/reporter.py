"""A driver's reports to its node, for the node's ``/metrics``.

A worker's node asks it for its counters at each scrape
(:class:`~pmetal.wire.TelemetryRequest`); a driver (a script's process)
serves no requests, so it pushes them instead: the thread
``pmetal-telemetry`` sends :class:`~pmetal.wire.Telemetry` (this process's
:data:`pmetal.tally.TALLY` and its objects) to its node when the tally
changed (or the objects it owns or borrows, looked at every five
intervals), at most once per ``metrics.report_interval`` seconds, and once
more when the driver shuts down. A node that does not answer costs a
report, never the driver's work: the push has its own short deadline and
its failure is logged at DEBUG.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from pmetal.errors import PMetalError
from pmetal.tally import TALLY
from pmetal.wire import Ack, Telemetry

if TYPE_CHECKING:
    from pmetal.actors.client import CoreClient

__all__ = ["Reporter", "driver_report"]

log = logging.getLogger(__name__)

_PUSH_WAIT = 2.0   # s a push may take before it is given up
_OBJECTS_EVERY = 5  # intervals between looks at the objects when nothing was counted


def driver_report(client: CoreClient) -> Telemetry:
    """This driver's report: its tally and the objects it owns and borrows."""
    objects = client._objects
    stats = objects.statistics() if objects is not None else None
    rows = TALLY.report()
    return Telemetry(os.getpid(), "driver", owned=stats.owned if stats else 0,
                     borrowed=stats.borrowed if stats else 0,
                     collectives=tuple(rows["collectives"]),
                     pipelines=tuple(rows["pipelines"]), stages=tuple(rows["stages"]))


class Reporter:
    """Pushes ``client``'s report to its node (see the module docstring);
    :meth:`close` sends the last one and stops the thread."""

    def __init__(self, client: CoreClient, interval: float) -> None:
        self.client = client
        self.interval = interval
        self.pushed = 0       # reports the node accepted
        self.failed = 0       # ... it did not
        self._version = TALLY.version   # what the node has seen (nothing before us)
        self._objects = (0, 0)          # ... and the objects owned and borrowed
        self._closing = threading.Event()
        self._lock = threading.Lock()   # one push at a time
        self._thread = threading.Thread(target=self._run, name="pmetal-telemetry",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            # Woken by a count; the objects it owns and borrows change
            # without one, so they are looked at every few intervals.
            TALLY.changed.wait(self.interval * _OBJECTS_EVERY)
            if self._closing.is_set():
                return
            self.push()
            if self._closing.wait(self.interval):   # at most one push per interval
                return

    def push(self) -> bool:
        """Send the report now if the tally changed since the last one."""
        with self._lock:
            TALLY.changed.clear()    # a count from now on sets it again
            version = TALLY.version
            report = driver_report(self.client)
            objects = (report.owned, report.borrowed)
            if (version == self._version and objects == self._objects) \
                    or self.client.node_dead:   # nobody to tell: no wait at shutdown
                return False
            try:
                reply = self.client.request_node(report, timeout=_PUSH_WAIT)
            except PMetalError as exc:
                self.failed += 1
                log.debug("could not report this driver's telemetry to its node: %s", exc)
                return False
            if not isinstance(reply, Ack):
                self.failed += 1
                log.debug("the node refused this driver's telemetry: %s", reply)
                return False
            self._version, self._objects = version, objects
            self.pushed += 1
            return True

    def close(self) -> None:
        """Send what changed since the last push, then stop."""
        if self._closing.is_set():
            return
        self._closing.set()
        TALLY.changed.set()    # wake the thread: it sees _closing and ends
        self._thread.join(timeout=_PUSH_WAIT + 1.0)
        self.push()
