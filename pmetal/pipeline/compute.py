"""Where a numpy stage's matrix products run: the decode kernel, and the
helpers that share a product across cores.

How a projection ``x @ W.T`` is computed, and why (measured with numpy
2.4's OpenBLAS 0.3.31 on a 2-core Sapphire Rapids VM, SmolLM2-135M shapes):

* Decode rows (up to DECODE_ROWS: one token of each of a few sequences)
  run in chunks of up to CHUNK rows, a chunk of one row padded to two. A
  chunk is one GEMM per slice of W's output rows, each small enough
  (SMALL_GEMM_WORK, SMALL_GEMM_OUT) for OpenBLAS's small-matrix kernels: no
  packing of W, and a row's result does not depend on the other rows of
  its GEMM. So a sequence's decode step gives the same bits alone or in a
  batch of any size or composition: a pipeline, which groups sequences
  differently from a single process, produces the same greedy tokens. (A
  1-row product would be a GEMV, whose last bits differ from a GEMM's; a
  GEMM of more rows or a longer slice switches kernels past those limits,
  whose bits differ too.)
* Those GEMMs never use OpenBLAS's threads (too small), so the BLAS thread
  count does not change a bit either. Parallelism is ours: with n compute
  threads (:func:`pmetal.pipeline.threads.set_compute_threads`) the slices
  of a projection are shared out to n - 1 helpers and the caller, and each
  slice is computed the same way by any of them.
* The helpers are processes where they can be (Linux on x86-64): a
  decode step of a small model is ~120 projections of 1-7 MB, 50-300 us
  of work per core each, and a thread that sleeps between tasks wakes in
  60-100 us on a VM (CPython's GIL rules out waiting without sleeping),
  which ate most of the second core. A helper process maps the stage's
  weights from shared memory (a memfd: one copy for all) and spins on a
  control block between tasks, so it takes a task in about a microsecond;
  after SPIN_SECONDS without work, or when the stage says it will wait for
  input (:meth:`Projector.rest`), it sleeps on a pipe. Elsewhere the
  helpers are threads (np.dot releases the GIL during its BLAS call).
  Measured on the default model, 2 cores: one sequence 25.2 -> 32.3
  tokens/s, 4 batched 83.3 -> 107.3 (``pmetal bench pipeline``).
* More rows (a prefill) are one GEMM on OpenBLAS's threads: fast, and
  deterministic run to run; a prefill's rows may differ in the last bits
  from the same tokens decoded one by one, which nothing compares.

A helper process that dies or stops answering is not fatal: the caller
computes the helper's share itself, logs a warning once, and uses thread
helpers from then on.

A helper process runs :func:`main` of this module.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import platform
import queue
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from pmetal.errors import PipelineError, PMetalValueError

log = logging.getLogger(__name__)

F32 = np.float32

DECODE_ROWS = 8
CHUNK = 4
# OpenBLAS's limits for its small-matrix sgemm kernels (the skylakex
# sgemm_small_kernel_permit, also taken on Sapphire Rapids): M*N*K, and for
# a transposed A (our x @ W.T) M*N, the output's size.
SMALL_GEMM_WORK = 1_000_000
SMALL_GEMM_OUT = 1200
_SLICE_ALIGN = 16
# Below this many weights a projection runs on the calling thread alone:
# handing out slices costs more than it saves.
PARALLEL_MIN_WEIGHTS = 1 << 18
PARALLEL_MIN_WEIGHTS_PROCESSES = 1 << 16

# A helper process's control block: one int64 field per 64-byte cache line,
# so the caller's writes and the helper's never share a line.
_LINE = 8
SEQ, MATRIX, ROWS, FIRST, LAST, DONE, STATE, PARK = (i * _LINE for i in range(8))
_CONTROL_BYTES = 4096
SPINNING, SLEEPING = 0, 1
HELPER_KINDS = ("auto", "processes", "threads")
SPIN_SECONDS = 0.002   # a helper spins this long without work, then sleeps
_SLEEP_CHECK = 0.05    # a sleeping helper looks at its control block this often anyway
READY_TIMEOUT = 30.0   # a new helper process must map the weights within this
TASK_TIMEOUT = 10.0    # and finish a task (milliseconds of work) within this


def slices(weight: np.ndarray) -> list[tuple[int, int]]:
    """Row ranges of W for the decode GEMMs: a chunk of CHUNK rows times a
    slice stays within the small-kernel limits; a multiple of _SLICE_ALIGN
    rows. They depend on W's shape only."""
    out_rows, width = weight.shape
    step = min(SMALL_GEMM_OUT // CHUNK, SMALL_GEMM_WORK // (CHUNK * width))
    step = max(_SLICE_ALIGN, step // _SLICE_ALIGN * _SLICE_ALIGN)
    return [(first, min(first + step, out_rows)) for first in range(0, out_rows, step)]


def project_rows(x: np.ndarray, weight: np.ndarray, out: np.ndarray,
                 ranges: Sequence[tuple[int, int]]) -> None:
    """``out[:, a:b] = x @ weight[a:b].T`` for each ``(a, b)`` in
    ``ranges``, the decode way: chunks of CHUNK rows, a chunk of one row
    padded to two. Caller and helpers all run this, hence the same bits."""
    rows = x.shape[0]
    for first in range(0, rows, CHUNK):
        chunk = x[first:first + CHUNK]
        take = chunk.shape[0]
        if take == 1:
            chunk = np.concatenate([chunk, chunk])  # a GEMM, never a GEMV
        target = out[first:first + take]
        for a, b in ranges:
            target[:, a:b] = np.dot(chunk, weight[a:b].T)[:take]


def processes_supported() -> bool:
    """Whether helper processes can run here: Linux (a memfd holds the
    weights) on x86-64, whose stores reach other cores in program order
    (the control block's protocol relies on that; elsewhere the helpers are
    threads)."""
    return hasattr(os, "memfd_create") and platform.machine().lower() in ("x86_64", "amd64")


def _share(count: int, parts: int) -> list[int]:
    """Bounds splitting ``count`` slices into ``parts`` nearly equal runs."""
    return [count * i // parts for i in range(parts + 1)]


class ThreadHelpers:
    """``count`` threads that each run one task at a time, handed over in
    C-implemented queues (a round trip costs ~5 us plus the wake-up)."""

    kind = "threads"

    def __init__(self, count: int) -> None:
        self.count = count
        self._tasks: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(count)]
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, args=(q,), daemon=True,
                                          name=f"pmetal-compute-{i}")
                         for i, q in enumerate(self._tasks)]
        for thread in self._threads:
            thread.start()

    def _loop(self, tasks: queue.SimpleQueue[Any]) -> None:
        while (task := tasks.get()) is not None:
            try:
                project_rows(*task)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                self._done.put(exc)
            else:
                self._done.put(None)

    def project(self, x: np.ndarray, weight: np.ndarray, out: np.ndarray,
                ranges: Sequence[tuple[int, int]], threads: int) -> np.ndarray:
        bounds = _share(len(ranges), threads)
        for tasks, i in zip(self._tasks, range(1, threads)):
            tasks.put((x, weight, out, ranges[bounds[i]:bounds[i + 1]]))
        try:
            project_rows(x, weight, out, ranges[:bounds[1]])
        finally:
            errors = [self._done.get() for _ in range(threads - 1)]
        for error in errors:
            if error is not None:
                raise error
        return out

    def rest(self) -> None:
        """Threads sleep between tasks anyway."""

    def close(self) -> None:
        for tasks in self._tasks:
            tasks.put(None)
        for thread in self._threads:
            thread.join()


class HelperLost(RuntimeError):
    """A helper process died, failed or stopped answering."""


_FENCE = threading.Lock()


def _fence() -> None:
    # An atomic read-modify-write (the lock's) is a full memory barrier: a
    # store before it is visible before any load after it. Caller and
    # helper each store then load (the task, the helper's state), and
    # without it both could read the other's old value: a lost wake-up.
    _FENCE.acquire()
    _FENCE.release()


class _Arena:
    """The stage's projection matrices, and the buffers caller and helpers
    share, in one memfd that helper processes map."""

    def __init__(self, parts: Sequence[Sequence[np.ndarray]], helpers: int) -> None:
        shapes = [(sum(p.shape[0] for p in stack), stack[0].shape[1]) for stack in parts]
        rows = max(r for r, _ in shapes)
        width = max(c for _, c in shapes)
        offset = _CONTROL_BYTES * helpers
        self.layout: dict[str, Any] = {"helpers": helpers, "x": offset,
                                       "out": offset + DECODE_ROWS * width * 4,
                                       "width": width, "rows": rows}
        offset = _align(self.layout["out"] + DECODE_ROWS * rows * 4)
        placed = []
        for r, c in shapes:
            placed.append((offset, r, c))
            offset = _align(offset + r * c * 4)
        self.layout["matrices"] = placed
        self.layout["size"] = offset
        self.fd = os.memfd_create("pmetal-stage-weights", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, offset)
            self.map = mmap.mmap(self.fd, offset)
        except OSError:
            os.close(self.fd)
            raise
        self.views = _Views(self.map, self.layout)
        for view, stack in zip(self.views.matrices, parts):
            np.concatenate(stack, out=view)

    def close(self) -> None:
        os.close(self.fd)  # the mapping (and the views on it) stays valid


def _align(offset: int) -> int:
    return -(-offset // 4096) * 4096


class _Views:
    def __init__(self, buffer: Any, layout: dict[str, Any]) -> None:
        self.controls = [np.frombuffer(buffer, np.int64, count=_CONTROL_BYTES // 8,
                                       offset=i * _CONTROL_BYTES)
                         for i in range(layout["helpers"])]
        self.x = np.frombuffer(buffer, F32, count=DECODE_ROWS * layout["width"],
                               offset=layout["x"])
        self.out = np.frombuffer(buffer, F32, count=DECODE_ROWS * layout["rows"],
                                 offset=layout["out"])
        self.matrices = [np.frombuffer(buffer, F32, count=r * c, offset=o).reshape(r, c)
                         for o, r, c in layout["matrices"]]

    def buffers(self, rows: int, width: int, out_width: int) -> tuple[np.ndarray, np.ndarray]:
        return (self.x[:rows * width].reshape(rows, width),
                self.out[:rows * out_width].reshape(rows, out_width))


class _Helper:
    """One helper process, from the caller's side."""

    def __init__(self, arena: _Arena, index: int) -> None:
        self.index = index
        self.control = arena.views.controls[index]
        self.seq = 0
        wake_r, self.wake_w = os.pipe()
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (package_root,
                                                          os.environ.get("PYTHONPATH")) if p))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from pmetal.pipeline.compute import main; main()",
                 str(arena.fd), str(wake_r), str(index), json.dumps(arena.layout)],
                pass_fds=(arena.fd, wake_r), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                env=env)
        except BaseException:
            os.close(self.wake_w)
            raise
        finally:
            os.close(wake_r)
        self.ready = False

    def wait_ready(self, deadline: float) -> None:
        if self.ready:
            return
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
                raise HelperLost(f"compute helper {self.index} did not start within "
                                 f"{READY_TIMEOUT:.0f} s")
            byte = os.read(self.process.stdout.fileno(), 1)
            if not byte:
                raise HelperLost(f"compute helper {self.index} exited at start "
                                 f"(code {self.process.wait(timeout=5)})")
            line += byte
        if line != b"ready\n":
            raise HelperLost(f"compute helper {self.index} said {line!r} instead of ready")
        self.ready = True

    def post(self, matrix: int, rows: int, first: int, last: int) -> None:
        c = self.control
        c[MATRIX], c[ROWS], c[FIRST], c[LAST] = matrix, rows, first, last
        self.seq += 1
        c[SEQ] = self.seq
        _fence()
        if c[STATE] == SLEEPING:
            try:
                os.write(self.wake_w, b"w")
            except OSError as exc:  # BrokenPipeError: it died asleep
                raise HelperLost(f"compute helper {self.index} is gone ({exc}; exit code "
                                 f"{self.process.poll()})") from exc

    def wait(self, deadline: float) -> None:
        c, seq, spins = self.control, self.seq, 0
        while c[DONE] != seq:
            spins += 1
            if spins & 4095 == 0:
                if self.process.poll() is not None:
                    raise HelperLost(f"compute helper {self.index} exited "
                                     f"(code {self.process.returncode})")
                if time.monotonic() > deadline:
                    raise HelperLost(f"compute helper {self.index} did not finish a task "
                                     f"in {TASK_TIMEOUT:.0f} s")
        if c[STATE] < 0:
            raise HelperLost(f"compute helper {self.index} failed a task; see its stderr")

    def rest(self) -> None:
        self.control[PARK] = self.seq

    def close(self) -> None:
        self.rest()
        try:
            os.close(self.wake_w)  # end of file on its pipe: it exits
        except OSError:
            pass
        try:
            self.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5.0)
        if self.process.stdout is not None:
            self.process.stdout.close()


class ProcessHelpers:
    """``count`` helper processes over an :class:`_Arena` (see the module
    docstring). Serves projections of the arena's matrices only."""

    kind = "processes"

    def __init__(self, parts: Sequence[Sequence[np.ndarray]], count: int) -> None:
        self.count = count
        self.arena = _Arena(parts, count)
        self.matrices = self.arena.views.matrices
        self._index = {id(m): i for i, m in enumerate(self.matrices)}
        self._helpers: list[_Helper] = []
        try:
            for i in range(count):
                self._helpers.append(_Helper(self.arena, i))
        except BaseException:
            self.close()
            raise
        # Helpers that outlive a forgotten stage would spin for nothing.
        self._finalizer = weakref.finalize(self, _close_helpers, self._helpers, self.arena)

    def serves(self, weight: np.ndarray) -> bool:
        return id(weight) in self._index

    def project(self, x: np.ndarray, weight: np.ndarray, out: np.ndarray,
                ranges: Sequence[tuple[int, int]], threads: int) -> np.ndarray:
        rows, width = x.shape
        shared_x, shared_out = self.arena.views.buffers(rows, width, weight.shape[0])
        shared_x[...] = x
        matrix = self._index[id(weight)]
        bounds = _share(len(ranges), threads)
        helpers = self._helpers[:threads - 1]
        deadline = time.monotonic() + READY_TIMEOUT
        try:
            for helper in helpers:
                helper.wait_ready(deadline)
            for helper, i in zip(helpers, range(1, threads)):
                helper.post(matrix, rows, bounds[i], bounds[i + 1])
        except HelperLost:
            project_rows(x, weight, out, ranges)   # all of it, here
            raise
        project_rows(shared_x, weight, shared_out, ranges[:bounds[1]])
        deadline = time.monotonic() + TASK_TIMEOUT
        for helper, i in zip(helpers, range(1, threads)):
            try:
                helper.wait(deadline)
            except HelperLost:
                # The shares not known done, here; the caller then stops
                # using process helpers.
                project_rows(shared_x, weight, shared_out, ranges[bounds[i]:bounds[threads]])
                out[...] = shared_out
                raise
        out[...] = shared_out
        return out

    def rest(self) -> None:
        for helper in self._helpers:
            helper.rest()

    def close(self) -> None:
        if hasattr(self, "_finalizer"):
            self._finalizer()
        else:
            _close_helpers(self._helpers, self.arena)


def _close_helpers(helpers: list[_Helper], arena: _Arena) -> None:
    for helper in helpers:
        helper.close()
    helpers.clear()
    try:
        arena.close()
    except OSError:
        pass


class Projector:
    """``x @ weight.T`` as described in the module docstring, on the
    process's compute threads. ``parts`` are the projections it will be
    asked for, each given as arrays to stack vertically (a fused matrix);
    :attr:`matrices` holds them stacked, in shared memory when helper
    processes will compute them. ``max_threads`` bounds the helpers started
    (one fewer than the threads); ``helpers`` is ``auto`` (processes where
    the OS allows, else threads), ``processes`` or ``threads``."""

    def __init__(self, parts: Sequence[Sequence[np.ndarray]], max_threads: int,
                 helpers: str = "auto") -> None:
        if helpers not in HELPER_KINDS:
            raise PMetalValueError(
                f"helpers={helpers!r}: choose from {', '.join(HELPER_KINDS)}")
        self._helpers: ProcessHelpers | ThreadHelpers | None = None
        self._lock = threading.Lock()
        sizes = [sum(p.size for p in stack) for stack in parts]
        wants = max_threads > 1 and max(sizes, default=0) >= PARALLEL_MIN_WEIGHTS_PROCESSES
        if helpers != "threads" and wants and processes_supported():
            try:
                self._helpers = ProcessHelpers(parts, max_threads - 1)
            except OSError as exc:
                if helpers == "processes":
                    raise
                log.warning("compute helper processes unavailable (%s); using threads", exc)
        if helpers == "processes" and self._helpers is None:
            raise PMetalValueError(
                "helpers='processes' needs Linux on x86-64, max_threads > 1 and a matrix worth "
                f"sharing (>= {PARALLEL_MIN_WEIGHTS_PROCESSES} weights); use 'auto' or 'threads'")
        self.matrices: list[np.ndarray] = (
            self._helpers.matrices if self._helpers is not None
            else [stack[0] if len(stack) == 1 and stack[0].flags.c_contiguous
                  else np.concatenate(stack) for stack in parts])

    @property
    def helper_pids(self) -> list[int]:
        """Process ids of the helper processes (none with thread helpers)."""
        helpers = self._helpers
        if not isinstance(helpers, ProcessHelpers):
            return []
        return [h.process.pid for h in helpers._helpers]

    @property
    def kind(self) -> str | None:
        """``processes``, ``threads``, or ``None`` while no helper exists."""
        return None if self._helpers is None else self._helpers.kind

    def __call__(self, x: np.ndarray, weight: np.ndarray,
                 ranges: list[tuple[int, int]], threads: int) -> np.ndarray:
        rows = x.shape[0]
        if rows > DECODE_ROWS:
            self.rest()   # OpenBLAS's own threads take the cores now
            return x @ weight.T
        out = np.empty((rows, weight.shape[0]), dtype=F32)
        helpers = self._helpers
        processes = isinstance(helpers, ProcessHelpers) and helpers.serves(weight)
        floor = PARALLEL_MIN_WEIGHTS_PROCESSES if processes else PARALLEL_MIN_WEIGHTS
        threads = min(threads, len(ranges))
        if processes:
            threads = min(threads, helpers.count + 1)
        if threads < 2 or weight.size < floor:
            project_rows(x, weight, out, ranges)
            return out
        if not self._lock.acquire(blocking=False):
            raise PipelineError("a stage computes on one thread at a time, and another thread "
                                "is computing on this one; give each thread its own stage")
        try:
            if processes:
                try:
                    return helpers.project(x, weight, out, ranges, threads)
                except HelperLost as exc:
                    self._lose_processes(exc)
                    return out
            return self._threads(threads).project(x, weight, out, ranges, threads)
        finally:
            self._lock.release()

    def _lose_processes(self, exc: HelperLost) -> None:
        log.warning("%s; computing on threads from now on", exc)
        helpers, self._helpers = self._helpers, None
        if helpers is not None:
            for helper in helpers._helpers:
                if helper.process.poll() is None:
                    helper.process.kill()
            helpers.close()

    def _threads(self, threads: int) -> ThreadHelpers:
        helpers = self._helpers
        if not isinstance(helpers, ThreadHelpers) or helpers.count < threads - 1:
            if isinstance(helpers, ThreadHelpers):
                helpers.close()
            helpers = self._helpers = ThreadHelpers(threads - 1)
        return helpers

    def rest(self) -> None:
        """The stage will wait for input: helpers stop spinning now."""
        if self._helpers is not None:
            self._helpers.rest()

    def close(self) -> None:
        helpers, self._helpers = self._helpers, None
        if helpers is not None:
            helpers.close()


# ---------------------------------------------------------------------------
# The helper process.

def _serve(fd: int, wake: int, index: int, layout: dict[str, Any]) -> int:
    buffer = mmap.mmap(fd, layout["size"])
    os.close(fd)
    views = _Views(buffer, layout)
    control = views.controls[index]
    matrices = views.matrices
    ranges = [slices(m) for m in matrices]
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.flush()
    seen, spins, idle_since = int(control[DONE]), 0, 0.0
    while True:
        seq = int(control[SEQ])
        if seq != seen:
            matrix, rows = int(control[MATRIX]), int(control[ROWS])
            weight = matrices[matrix]
            x, out = views.buffers(rows, weight.shape[1], weight.shape[0])
            try:
                project_rows(x, weight, out, ranges[matrix][int(control[FIRST]):int(control[LAST])])
            except Exception as exc:  # noqa: BLE001 - reported, then this helper ends
                print(f"pmetal compute helper {index}: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
                control[STATE] = -1
                control[DONE] = seq
                return 1
            seen = seq
            control[DONE] = seq
            spins, idle_since = 0, 0.0
            continue
        spins += 1
        if spins & 1023:
            continue
        now = time.monotonic()
        if idle_since == 0.0:
            idle_since = now
        if now - idle_since < SPIN_SECONDS and control[PARK] != seen:
            continue
        control[STATE] = SLEEPING
        _fence()
        while control[SEQ] == seen:
            if select.select([wake], [], [], _SLEEP_CHECK)[0] and not os.read(wake, 4096):
                return 0  # the stage closed us, or its process is gone
        control[STATE] = SPINNING
        spins, idle_since = 0, 0.0


def main() -> None:
    """A helper process's entry (see :class:`_Helper`)."""
    sys.exit(_serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                    json.loads(sys.argv[4])))
