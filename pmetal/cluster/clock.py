"""The clocks a node tells a pause by, and the gate its workers obey.

Two questions after a gap between a node's ticks (pmetal.cluster.service):

* **Did the machine sleep?** :func:`slept` reads the seconds the machine
  has spent suspended since boot: on Linux the gap between CLOCK_BOOTTIME
  (counts suspension) and CLOCK_MONOTONIC (does not); on macOS between
  CLOCK_MONOTONIC (there it counts sleep) and CLOCK_UPTIME_RAW (does not).
  It grows only across a system suspend: a process starved of CPU (load 12
  on two cores) or stopped with SIGSTOP sees the same gap on both clocks.
  Where no pair of such clocks exists it is ``None`` (a gap is then never
  taken for a sleep).
* **May this node run its actors?** A node that did not run for a while
  (slept, starved, stopped) may have been declared dead meanwhile, its
  actors restarted elsewhere. Until the cluster confirms it is still a
  member, it must execute nothing and deliver no result. Its workers are
  separate processes that callers reach directly, so the node tells them
  through :class:`Gate`: one small page of shared memory (a file in
  /dev/shm) that the node writes and every worker reads before it starts a
  call and before it sends a result:

  ====== ====== ==========================================================
  offset type   meaning
  ====== ====== ==========================================================
  0      u8     0: open; 1: held (the node's membership is unconfirmed)
  8      u64    generation: grows at every fence (a worker whose actor
                was built in an older generation never answers again)
  16     f64    the node's last tick, on :func:`cluster_clock`
  24     f64    the lease: until when the node's restartable actors may
                run, on :func:`cluster_clock` (``inf``: no limit)
  ====== ====== ==========================================================

  A worker also holds while the node's last tick is older than
  ``stale`` seconds: when a whole machine is stopped and continued, every
  process resumes at once, and a worker must not reply before its node has
  ticked, seen the gap and closed the gate.

  The lease is for an actor that can restart elsewhere: cut off from a
  quorum (a partition, a dropped Wi-Fi link), its node stops renewing it,
  and its copy starts nothing and delivers nothing past that time, before a
  master can have held the node dead and restarted the actor on another
  (pmetal.cluster.view, ``LEASE_SHARE``). The lease is written by the node
  but expires by itself: a starved or stopped node cannot keep it alive.
  Actors that never restart, and tasks, run on: no second copy can exist.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time

__all__ = ["Gate", "GateView", "cluster_clock", "slept"]

_CLOCK = getattr(time, "CLOCK_BOOTTIME", None) or time.CLOCK_MONOTONIC

_LINUX_PAIR = (getattr(time, "CLOCK_BOOTTIME", None), getattr(time, "CLOCK_MONOTONIC", None))
_MAC_PAIR = (getattr(time, "CLOCK_MONOTONIC", None), getattr(time, "CLOCK_UPTIME_RAW", None))


def cluster_clock() -> float:
    """Seconds on a clock that counts while the machine sleeps."""
    return time.clock_gettime(_CLOCK)


def _pair() -> tuple[int, int] | None:
    import sys
    pair = _LINUX_PAIR if sys.platform.startswith("linux") else (
        _MAC_PAIR if sys.platform == "darwin" else (None, None))
    if pair[0] is None or pair[1] is None:
        return None
    return pair  # type: ignore[return-value]


_PAIR = _pair()


def slept() -> float | None:
    """Seconds this machine has been suspended since boot (compare two
    readings: only a system sleep moves it); None where it cannot tell.

    The counting clock is read between two readings of the other, and the
    tightest of a few brackets is kept: a process starved of CPU between
    two plain readings (seen beside CPU hogs) would otherwise take the
    time it waited for a sleep of the machine, and fence itself."""
    if _PAIR is None:
        return None
    counting, not_counting = _PAIR
    best: tuple[float, float] | None = None
    for _ in range(4):
        before = time.clock_gettime(not_counting)
        value = time.clock_gettime(counting)
        after = time.clock_gettime(not_counting)
        if best is None or after - before < best[0]:
            best = (after - before, value - (before + after) / 2)
        if after - before < 1e-3:
            break
    return best[1]


_LAYOUT = struct.Struct("<B7xQdd")
OPEN, HELD = 0, 1


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _sweep(directory: str, prefix: str) -> None:
    """Unlink the pages of nodes of this pid namespace that died without
    closing theirs (``kill -9``): named ``<prefix><pid>-...``."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        pid = entry[len(prefix):].partition("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(directory, entry))
        except OSError:
            pass


class Gate:
    """The node's side: creates the page, writes it; :attr:`path` goes to
    its workers (``--gate``)."""

    def __init__(self, directory: str | None = None) -> None:
        directory = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else
                                  tempfile.gettempdir())
        prefix = f"pmetal-gate-{_pid_namespace()}-"
        _sweep(directory, prefix)
        fd, self.path = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", dir=directory)
        try:
            os.ftruncate(fd, _LAYOUT.size)
            self._map = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)
        self.state = OPEN
        self.generation = 1
        self.lease = float("inf")
        self._write(cluster_clock())

    def _write(self, tick: float) -> None:
        # Workers read the page without a lock, so it is written in one
        # copy of a finished buffer: every aligned field is then read
        # whole, old or new. (struct.pack_into zeroes its target before it
        # fills it in: a worker that read in between saw generation 0,
        # took it for a fence, and refused an actor's creation.)
        self._map[:_LAYOUT.size] = _LAYOUT.pack(self.state, self.generation, tick, self.lease)

    def tick(self, now: float, lease: float | None = None) -> None:
        """The node ran at ``now``; ``lease``, if given, replaces the lease."""
        if lease is not None:
            self.lease = lease
        self._write(now)

    def hold(self) -> None:
        """Workers start nothing and deliver nothing until :meth:`open`."""
        self.state = HELD
        self._write(cluster_clock())

    def open(self) -> None:
        self.state = OPEN
        self._write(cluster_clock())

    def fence(self) -> None:
        """A new generation: actors built before never answer again."""
        self.generation += 1
        self.state = OPEN
        self._write(cluster_clock())

    @property
    def held(self) -> bool:
        return self.state == HELD

    def close(self) -> None:
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass
        try:
            os.unlink(self.path)
        except OSError:
            pass


class GateView:
    """A worker's side: reads the page its node writes."""

    def __init__(self, path: str, stale: float) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, _LAYOUT.size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.stale = stale
        self.generation = self.read()[1]
        self.leased = False   # True for an actor that may restart elsewhere: it obeys the lease

    def read(self) -> tuple[int, int, float, float]:
        return _LAYOUT.unpack_from(self._map, 0)  # type: ignore[return-value]

    def adopt(self) -> None:
        """The actor being built belongs to the current generation."""
        self.generation = self.read()[1]

    def check(self, generation: int | None) -> str:
        """"" when open; else why not: "fenced" (``generation`` is past:
        never again), "held" (unconfirmed, or the node has not ticked for
        ``stale`` s), "lapsed" (:attr:`leased` and past the lease: the node
        has not heard from a quorum)."""
        state, current, tick, lease = _LAYOUT.unpack_from(self._map, 0)
        if generation is not None and current != generation:
            return "fenced"
        now = cluster_clock()
        if state != OPEN or now - tick > self.stale:
            return "held"
        if self.leased and now > lease:
            return "lapsed"
        return ""

    def wait(self, generation: int | None, timeout: float) -> str:
        """Until open ("") or fenced, or ``timeout`` s ("held"). Polls
        every 5 ms: the page is written by another process, and a held gate
        is rare (after a pause of the node), so a plain poll costs less
        than a wake-up channel on the path of every call."""
        reason = self.check(generation)
        if not reason or reason == "fenced":
            return reason
        deadline = time.monotonic() + timeout
        while True:
            time.sleep(0.005)
            reason = self.check(generation)
            if not reason or reason == "fenced" or time.monotonic() >= deadline:
                return reason

    def close(self) -> None:
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass
