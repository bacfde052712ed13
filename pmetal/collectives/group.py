"""A formed group of ranks and the operations users call on it.

:class:`Schedule` is what the master (or rank 0 of a static world) decides
once per formation of a group and stamps with its term and the
membership epoch: the strategy rule, the ring order and the chunk size.
Every operation's :class:`~pmetal.collectives.plan.Plan` then follows from
the schedule and the buffer's size by a pure function, so every rank
computes the same plan without a round trip to the master per operation
(a 4 KiB all_reduce takes about 100 us; one more hop would double it).

:class:`Group` owns one rank's links and its operation counter, turns
arrays into flat buffers (numpy in place; MLX, bfloat16 and anything else
converted and returned) and runs the executor. Every operation is
synchronous; the asyncio API (:mod:`pmetal.collectives.spmd`) runs them
in a worker thread. One operation at a time per group: operations are
numbered in call order, the same on every rank.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pmetal.collectives.executor import execute
from pmetal.links.memory import RankLinks
from pmetal.collectives.ops import ReduceOp, chunk_bounds
from pmetal.collectives.plan import Plan
from pmetal.collectives.planner import make_plan, pipeline_parts_for
from pmetal.links.tcplinks import DTYPE_CODES, P2P_BASE
from pmetal.config import CollectiveConfig
from pmetal.errors import CollectiveError, PMetalTypeError, PMetalValueError
from pmetal.tally import TALLY

__all__ = ["Group", "Schedule"]


@dataclass(frozen=True)
class Schedule:
    """The master's decisions for one formation of a group (see the module
    docstring). ``order`` is the ring order of the ranks (from the
    topology's link figures); ``strategy`` "auto" means the tree up to
    ``tree_max_bytes`` and the ring above (two ranks: always the ring)."""
    name: str
    world: int
    term: int = 0
    epoch: int = 0
    order: tuple[int, ...] = ()
    strategy: str = "auto"
    tree_max_bytes: int = 256 * 1024
    chunk_bytes: int = 1 << 20
    compression: str = "none"  # a CompressionStrategy value, "none", or "auto" (undecided)
    compression_ratio: float = 0.01
    compression_min_bytes: int = 256 * 1024
    compress_below_bandwidth: float = 25e6

    @classmethod
    def from_config(cls, name: str, world: int, config: CollectiveConfig, *, term: int = 0,
                    epoch: int = 0, order: tuple[int, ...] = ()) -> Schedule:
        """The schedule ``config`` asks for. "auto" compression stays
        undecided (no compression) until the master decides it from its
        link figures (:meth:`with_links`)."""
        return cls(name=name, world=world, term=term, epoch=epoch,
                   order=order or tuple(range(world)), strategy=config.strategy,
                   tree_max_bytes=config.tree_max_bytes, chunk_bytes=config.chunk_bytes,
                   compression=config.compression, compression_ratio=config.compression_ratio,
                   compression_min_bytes=config.compression_min_bytes,
                   compress_below_bandwidth=config.compress_below_bandwidth)

    def with_links(self, slowest: float | None) -> Schedule:
        """The master's choice of compression for "auto": TopK (with error
        feedback) when the slowest link of the ring carries less than
        ``compress_below_bandwidth`` bytes/s, none when it is faster or not
        measured."""
        if self.compression != "auto":
            return self
        slow = slowest is not None and slowest < self.compress_below_bandwidth
        return dataclasses.replace(self, compression="topk" if slow else "none")

    def compression_for(self, op: ReduceOp, dtype: np.dtype, nbytes: int) -> str:
        """What an all_reduce of ``nbytes`` of ``dtype`` under ``op`` sends:
        the schedule's compression for large SUM or MEAN reductions of
        floats, "none" for anything else (integers, MAX, small buffers)."""
        if (self.compression in ("none", "auto") or op not in (ReduceOp.SUM, ReduceOp.MEAN)
                or dtype.kind != "f" or nbytes < self.compression_min_bytes):
            return "none"
        return self.compression

    def strategy_for(self, op: str, nbytes: int) -> str:
        if self.strategy != "auto":
            return self.strategy
        # Measured on loopback (docs/performance.md, "auto"): with two ranks
        # the ring's two exchanges run both ways at once and beat the
        # tree at every size (4 KiB: 64 against 120 us); with more, the
        # tree's log2 hops beat the ring's 2(n-1) up to about 256 KiB.
        if op == "barrier" or (nbytes <= self.tree_max_bytes and self.world > 2):
            return "tree"
        return "ring"

    def plan(self, op: str, n_elements: int, itemsize: int, root: int = 0,
             strategy: str | None = None) -> Plan:
        strategy = strategy or self.strategy_for(op, n_elements * itemsize)
        parts = 1
        if strategy == "ring" and n_elements:
            parts = pipeline_parts_for(n_elements, itemsize, self.world, self.chunk_bytes)
        return _plan(op, strategy, self.world, root, n_elements, self.order or None, parts,
                     self.term, self.epoch)


@functools.lru_cache(maxsize=256)
def _plan(op: str, strategy: str, world: int, root: int, n_elements: int,
          order: tuple[int, ...] | None, parts: int, term: int, epoch: int) -> Plan:
    plan = make_plan(op, strategy, world, root, n_elements, order=order, pipeline_parts=parts)
    return dataclasses.replace(plan, term=term, epoch=epoch)


class Group:
    """One rank's membership of a formed group: ``rank``, ``size`` and the
    operations. Arrays of float16, float32, float64, int32 and int64 (and
    the other dtypes of :data:`~pmetal.links.tcplinks.DTYPE_CODES`)
    travel as they are; bfloat16 (MLX) is reduced in float32 and rounded
    back; MLX arrays are returned as new MLX arrays; contiguous numpy
    arrays are changed in place and returned."""

    def __init__(self, schedule: Schedule, rank: int, links: RankLinks, *,
                 timeout: float, on_close: Callable[[], None] | None = None) -> None:
        if not 0 <= rank < schedule.world:
            raise PMetalValueError(f"rank {rank} is not in a group of {schedule.world}")
        self.schedule = schedule
        self.rank = rank
        self.size = schedule.world
        self.name = schedule.name
        self.timeout = timeout
        self.links = links
        self._op_id = 0
        self._p2p_sent: dict[int, int] = {}
        self._p2p_received: dict[int, int] = {}
        self._lock = threading.Lock()
        self._on_close = on_close
        self.closed = False
        self.failed = False  # an operation raised CollectiveError
        self._compressor: Any = None  # made on the first compressed all_reduce
        # A script that ends without close() must still let its last
        # operation's queued bytes reach the peers.
        atexit.register(self.close)

    def __repr__(self) -> str:
        return (f"Group({self.name!r}, rank={self.rank}, size={self.size}, "
                f"term={self.schedule.term}, epoch={self.schedule.epoch})")

    # ----------------------------------------------------------- operations

    def all_reduce(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                   timeout: float | None = None, strategy: str | None = None,
                   compression: Any = None, name: str | None = None) -> Any:
        """Reduce ``x`` over every rank; every rank gets the same result.
        ``compression``: a :class:`~pmetal.collectives.compression.GradientCompressor`
        (SUM or MEAN only), whose error feedback keeps the residual of
        ``name`` from one call to the next (see docs/compression.md). When
        the group's schedule compresses (``CollectiveConfig.compression``),
        large float SUM/MEAN all_reduces use the group's own compressor,
        its residuals kept per ``name`` (default: per shape and dtype; name
        each tensor when several of one shape are reduced every step)."""
        implicit = compression is None
        if implicit:
            compression = self._scheduled_compressor(x, _op(op))
        if compression is not None:
            from pmetal.collectives.compressed import all_reduce_compressed
            if name is None:
                array, _ = _as_array(x)
                name = f"all_reduce{list(array.shape)}:{array.dtype}" if implicit \
                    else "gradient"
            return all_reduce_compressed(self, x, compression, _op(op), name=name,
                                         timeout=timeout)
        return self._run("all_reduce", x, op, 0, timeout, strategy)

    def _scheduled_compressor(self, x: Any, op: ReduceOp) -> Any:
        """The group's compressor when its schedule compresses this
        all_reduce (see :meth:`Schedule.compression_for`), else None."""
        if self.schedule.compression == "none":
            return None
        array, _ = _as_array(x)
        kind = self.schedule.compression_for(op, array.dtype, array.nbytes)
        if kind == "none":
            return None
        if self._compressor is None:
            from pmetal.collectives.compression import (
                CompressionConfig,
                CompressionStrategy,
                GradientCompressor,
            )
            self._compressor = GradientCompressor(CompressionConfig(
                strategy=CompressionStrategy(kind), ratio=self.schedule.compression_ratio))
        return self._compressor

    def statistics(self) -> dict[str, Any]:
        """Operations run and bytes this rank's links sent and received."""
        stats: dict[str, Any] = {"operations": self._op_id,
                                 "bytes_sent": getattr(self.links, "bytes_sent", 0),
                                 "bytes_received": getattr(self.links, "bytes_received", 0)}
        if self._compressor is not None:
            compressed = self._compressor.statistics()
            stats["compression"] = {"strategy": self.schedule.compression,
                                    "bytes_in": compressed.bytes_in,
                                    "bytes_out": compressed.bytes_out}
        return stats

    def reduce(self, x: Any, root: int = 0, op: ReduceOp | str = ReduceOp.SUM, *,
               timeout: float | None = None, strategy: str | None = None) -> Any:
        """Reduce ``x`` onto ``root``; other ranks' ``x`` is left undefined
        (it held partial sums), as in MPI's in-place reduce."""
        return self._run("reduce", x, op, root, timeout, strategy)

    def broadcast(self, x: Any, root: int = 0, *, timeout: float | None = None,
                  strategy: str | None = None) -> Any:
        """``root``'s ``x`` on every rank (same shape and dtype everywhere)."""
        return self._run("broadcast", x, ReduceOp.SUM, root, timeout, strategy)

    def all_gather(self, x: Any, *, timeout: float | None = None,
                   strategy: str | None = None) -> Any:
        """Every rank's ``x`` stacked in rank order: shape ``(size, *x.shape)``."""
        array, back = _as_array(x)
        n = array.size
        buffer = np.empty(n * self.size, dtype=array.dtype)
        buffer[self.rank * n:(self.rank + 1) * n] = array.reshape(-1)
        self._execute("all_gather", buffer, ReduceOp.SUM, 0, timeout, strategy)
        return back(buffer.reshape((self.size, *array.shape)), fresh=True)

    def reduce_scatter(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                       timeout: float | None = None, strategy: str | None = None) -> Any:
        """Reduce ``x`` over every rank and return this rank's block of the
        result (flat; blocks as :func:`~pmetal.collectives.ops.chunk_bounds`
        splits ``x.size`` elements ``size`` ways)."""
        array, back = _as_array(x)
        buffer = array.reshape(-1).copy()
        self._execute("reduce_scatter", buffer, _op(op), 0, timeout, strategy)
        start, end = chunk_bounds(buffer.size, self.size)[self.rank]
        return back(buffer[start:end].copy(), fresh=True)

    def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier."""
        self._execute("barrier", np.empty(0, np.uint8), ReduceOp.SUM, 0, timeout, None)

    def send(self, x: Any, to_rank: int, *, timeout: float | None = None) -> None:
        """Send ``x`` to ``to_rank`` (matched by that rank's next
        :meth:`recv` from this one); returns once queued."""
        array, _ = _as_array(x)
        self._check_peer(to_rank)
        with self._lock:
            n = self._p2p_sent.get(to_rank, 0)
            self._p2p_sent[to_rank] = n + 1
            flat = np.ascontiguousarray(array).reshape(-1)
            try:
                self.links.send(to_rank, P2P_BASE + n, 0, flat)
                self.links.release(P2P_BASE + n)
            except Exception as exc:
                raise CollectiveError(f"send to rank {to_rank} of group {self.name!r} "
                                      f"failed: {exc}") from exc

    def recv(self, x: Any, from_rank: int, *, timeout: float | None = None) -> Any:
        """Receive into ``x`` (its shape and dtype must match what
        ``from_rank`` sent) the next array ``from_rank`` sent this rank."""
        array, back = _as_array(x)
        self._check_peer(from_rank)
        with self._lock:
            n = self._p2p_received.get(from_rank, 0)
            self._p2p_received[from_rank] = n + 1
            flat = array.reshape(-1)
            deadline = time.monotonic() + (timeout or self.timeout)
            try:
                _chunk, data = self.links.recv(from_rank, P2P_BASE + n, deadline, flat)
            except TimeoutError as exc:
                raise CollectiveError(f"recv from rank {from_rank} of group {self.name!r}: "
                                      "nothing arrived before the deadline") from exc
            except Exception as exc:
                raise CollectiveError(f"recv from rank {from_rank} of group {self.name!r} "
                                      f"failed: {exc}") from exc
            if data.dtype != flat.dtype or data.size != flat.size:
                raise CollectiveError(
                    f"recv from rank {from_rank}: it sent {data.size} x {data.dtype}, this "
                    f"rank expected {flat.size} x {flat.dtype}")
            if data is not flat:
                flat[...] = data
        return back(array, fresh=False)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        close = getattr(self.links, "close", None)
        if close is not None and not self.failed:  # a failure closed them (_fail)
            close(10.0)
        if self._on_close is not None:
            self._on_close()

    # ------------------------------------------------------------- machinery

    def _check_peer(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.size or rank == self.rank:
            raise PMetalValueError(f"rank {rank!r} is not another rank of group "
                                   f"{self.name!r} (ranks 0 to {self.size - 1}, this is "
                                   f"{self.rank})")

    def _run(self, name: str, x: Any, op: ReduceOp | str, root: int,
             timeout: float | None, strategy: str | None) -> Any:
        array, back = _as_array(x)
        if not 0 <= root < self.size:
            raise PMetalValueError(f"root {root} is not a rank of group {self.name!r} "
                                   f"(ranks 0 to {self.size - 1})")
        buffer = array if array.flags.c_contiguous and array.flags.writeable else array.copy()
        self._execute(name, buffer.reshape(-1), _op(op), root, timeout, strategy)
        if buffer is not array:
            if not array.flags.writeable:
                return back(buffer, fresh=True)
            array[...] = buffer
        return back(array, fresh=False)

    def _execute(self, name: str, flat: np.ndarray, op: ReduceOp, root: int,
                 timeout: float | None, strategy: str | None) -> None:
        if self.closed:
            raise CollectiveError(f"group {self.name!r} is closed; form a new one")
        if self.failed:
            raise CollectiveError(f"an earlier operation of group {self.name!r} failed, "
                                  "so it cannot be used again: re-form the group over the "
                                  "live members")
        if strategy is not None and strategy not in ("ring", "tree", "naive"):
            raise PMetalValueError(f"unknown strategy {strategy!r}; use ring, tree or naive")
        with self._lock:
            self._op_id += 1
            plan = self.schedule.plan(name, flat.size, flat.dtype.itemsize, root, strategy)
            started = time.perf_counter()
            try:
                execute(plan, self.rank, flat, self.links, op=op, op_id=self._op_id,
                        timeout=timeout or self.timeout)
            except CollectiveError:
                self._fail()
                raise
            # For the node's metrics (pmetal.tally): by group and strategy.
            TALLY.collective(self.name, plan.strategy, flat.nbytes,
                             time.perf_counter() - started)

    def _fail(self) -> None:
        """An operation failed: the group cannot be used again (its streams
        may hold half a message, its peers disagree on where they are).
        Close the links now, without waiting for queued bytes: every rank
        still waiting on this one then fails at once instead of at its
        deadline, and the failure spreads through the whole group."""
        self.failed = True
        close = getattr(self.links, "close", None)
        if close is not None:
            close(0.0)


def _op(op: ReduceOp | str) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp[str(op).upper()]
    except KeyError:
        raise PMetalValueError(f"unknown reduce op {op!r}; use one of "
                               f"{', '.join(o.name for o in ReduceOp)}") from None


def _as_array(x: Any) -> tuple[np.ndarray, Callable[..., Any]]:
    """``x`` as a numpy array, and how to turn the result back into what
    the caller passed (the same numpy array, or a new MLX array)."""
    if isinstance(x, np.ndarray):
        if x.dtype.name not in DTYPE_CODES:
            raise PMetalTypeError(f"collectives carry arrays of {', '.join(DTYPE_CODES)}, "
                                  f"not {x.dtype}")
        return x, lambda result, fresh: result
    module = type(x).__module__
    if module.startswith("mlx"):
        return _from_mlx(x)
    if isinstance(x, (list, tuple, int, float)):
        array = np.asarray(x)
        if array.dtype.name not in DTYPE_CODES:
            raise PMetalTypeError(f"cannot send {type(x).__name__} of {array.dtype}")
        return array, lambda result, fresh: result
    raise PMetalTypeError(f"collectives take numpy or MLX arrays, not {type(x).__name__}")


def _from_mlx(x: Any) -> tuple[np.ndarray, Callable[..., Any]]:
    import mlx.core as mx
    dtype = x.dtype
    if dtype == mx.bfloat16:
        # numpy has no bfloat16: reduce in float32 (every rank rounds the
        # same float32 result, so they stay bit-identical) and round back.
        array = np.array(x.astype(mx.float32))
    else:
        array = np.array(x)

    def back(result: np.ndarray, fresh: bool) -> Any:
        out = mx.array(result)
        return out.astype(dtype) if out.dtype != dtype else out

    return array, back
