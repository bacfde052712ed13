"""One rank of the SPMD tests (tests/collectives/test_spmd_processes.py):
a real process that forms groups over TCP with
:class:`~pmetal.RingBackend` and checks its own results.

Run by path (``python tests/collectives/spmd_worker.py MODE JSON``), the
argument a JSON object (``rank``, the ``nodes`` and the settings below),
so that the same script serves loopback and the namespace hosts:

- ``matrix``: every operation, root, reduce operator, dtype and size under
  every strategy (``groups`` maps a strategy to the nodes of the group
  forced to it; "auto" is the automatic choice), in one process lifetime.
  Inputs are drawn from a seed per case and rank, so this rank computes
  every rank's input and the expected result itself (numpy's reduction of
  the stacked inputs in the buffer's dtype) and asserts on its own result.
  Writes ``out`` (JSON): the failures by case name and, per case whose
  result every rank shares, a hash of the result bytes (the test compares
  them across ranks: bit-identical).
- ``loop``: all_reduce of ``mib`` MiB over and over, a JSON line after
  each (``{"op": n}``) so the test can kill or stop a rank mid-operation.
  When an operation raises it prints the error and the time, then reads
  one JSON line from stdin (the survivors' new ``nodes`` and ``rank``),
  re-forms the group there and checks one all_reduce.
- ``connect``: form the group and run one all_reduce; print the outcome
  (the refusal tests).
- ``mismatch``: one all_reduce per strategy of the ``n`` and ``dtype``
  given, which the test makes differ between ranks; print each outcome.

Every line this script prints on stdout is one JSON object.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from pmetal import CollectiveConfig, DistributedConfig, DistributedContext, RingBackend
from pmetal.collectives.ops import ReduceOp, chunk_bounds
from pmetal.errors import CollectiveError, PMetalError

DTYPES = ("float16", "float32", "float64", "int32", "int64")
OPS = tuple(ReduceOp)
CHUNK_BYTES = 4096  # small, so that a few KiB already pipeline the ring
TREE_MAX_BYTES = 1024  # "auto" takes the tree below, the ring above
TOLERANCE = {"float16": (5e-3, 1e-3), "float32": (1e-5, 1e-6), "float64": (1e-12, 1e-12)}


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def make_context(spec: dict[str, Any], nodes: list[str], rank: int, strategy: str = "auto",
                 timeout: float | None = None) -> DistributedContext:
    collectives = CollectiveConfig(strategy=strategy, chunk_bytes=spec.get("chunk_bytes",
                                                                           CHUNK_BYTES),
                                   tree_max_bytes=TREE_MAX_BYTES,
                                   timeout=timeout or spec.get("timeout", 30.0),
                                   connect_timeout=spec.get("connect_timeout", 30.0),
                                   # TCP unless a test asks for the same-machine path:
                                   # loopback ranks would otherwise take shared memory.
                                   shared_memory=spec.get("shared_memory", False))
    psk = spec.get("psk")
    config = DistributedConfig(nodes=nodes, rank=rank, collectives=collectives,
                               psk=bytes.fromhex(psk) if psk else None)
    ctx = DistributedContext(RingBackend(config))
    ctx.connect_blocking()
    return ctx


# ----------------------------------------------------------------- inputs

def sizes_for(world: int, itemsize: int) -> list[int]:
    """0, 1, fewer elements than ranks, not divisible by the world, and
    enough that every ring block is pipelined in several chunks."""
    large = world * (2 * CHUNK_BYTES // itemsize) + world + 3
    return sorted({0, 1, world - 1, 3 * world + 2, large})


def inputs(case: str, world: int, n: int, dtype: str) -> list[np.ndarray]:
    """Every rank's input of ``case``: the same on every rank."""
    out = []
    for rank in range(world):
        rng = np.random.default_rng([zlib.crc32(case.encode()), rank])
        if dtype.startswith("float"):
            # In [0.5, 1.5): no cancellation, products stay in range.
            out.append(rng.uniform(0.5, 1.5, n).astype(dtype))
        else:
            # The whole range: sums and products wrap, exactly as numpy's.
            info = np.iinfo(dtype)
            out.append(rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True))
    return out


def reference(op: ReduceOp, stack: list[np.ndarray]) -> np.ndarray:
    """numpy's reduction of the ranks' inputs, in their dtype."""
    a = np.stack(stack)
    dtype = a.dtype
    with np.errstate(over="ignore", invalid="ignore"):
        if op is ReduceOp.MAX:
            return np.maximum.reduce(a, axis=0)
        if op is ReduceOp.MIN:
            return np.minimum.reduce(a, axis=0)
        if op is ReduceOp.PRODUCT:
            return np.multiply.reduce(a, axis=0, dtype=dtype)
        total = np.add.reduce(a, axis=0, dtype=dtype)
        if op is ReduceOp.MEAN and len(stack) > 1:
            if np.issubdtype(dtype, np.integer):
                return np.floor_divide(total, dtype.type(len(stack)))
            return np.divide(total, dtype.type(len(stack)))
        return total


def agrees(got: np.ndarray, want: np.ndarray, exact: bool) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if exact or not np.issubdtype(want.dtype, np.floating):
        return bool(np.array_equal(got, want))
    rtol, atol = TOLERANCE[want.dtype.name]
    return bool(np.allclose(got, want, rtol=rtol, atol=atol))


def digest(a: Any) -> str:
    return hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=8).hexdigest()


# ----------------------------------------------------------------- matrix

class Matrix:
    def __init__(self, world: int, rank: int, dtypes: tuple[str, ...] = DTYPES) -> None:
        self.world = world
        self.dtypes = dtypes
        self.rank = rank
        self.failures: list[str] = []
        self.hashes: dict[str, str] = {}
        self.cases = 0

    def check(self, case: str, ok: bool, detail: str = "") -> None:
        self.cases += 1
        if not ok:
            self.failures.append(f"{case}: {detail}" if detail else case)

    def run_case(self, case: str, body: Callable[[], None]) -> None:
        try:
            body()
        except PMetalError as exc:
            # The group is unusable after a failed operation (the ranks'
            # operation counters may disagree): stop the whole matrix.
            self.failures.append(f"{case}: raised {type(exc).__name__}: {exc}")
            raise

    def strategy(self, ctx: DistributedContext, label: str) -> None:
        w = self.world
        for dtype in self.dtypes:
            itemsize = np.dtype(dtype).itemsize
            for n in sizes_for(w, itemsize):
                for op in OPS:
                    self.all_reduce(ctx, f"{label}/all_reduce/{dtype}/{op.name}/n{n}", n,
                                    dtype, op)
                    self.reduce_scatter(ctx, f"{label}/reduce_scatter/{dtype}/{op.name}/n{n}",
                                        n, dtype, op)
                for root in range(w):
                    for op in OPS:
                        self.reduce(ctx, f"{label}/reduce/{dtype}/{op.name}/root{root}/n{n}",
                                    n, dtype, op, root)
                    self.broadcast(ctx, f"{label}/broadcast/{dtype}/root{root}/n{n}", n,
                                   dtype, root)
                if label.endswith("/auto"):
                    # The per-operation override of the group's strategy.
                    for strategy in ("ring", "tree", "naive"):
                        self.all_reduce(ctx, f"{label}/all_reduce/{dtype}/SUM/n{n}/"
                                        f"override-{strategy}", n, dtype, ReduceOp.SUM,
                                        strategy)
                self.all_gather(ctx, f"{label}/all_gather/{dtype}/n{n}", n, dtype)
                self.send_recv(ctx, f"{label}/send_recv/{dtype}/n{n}", n, dtype)
            self.barrier(ctx, f"{label}/barrier/{dtype}")

    def all_reduce(self, ctx: DistributedContext, case: str, n: int, dtype: str,
                   op: ReduceOp, strategy: str | None = None) -> None:
        xs = inputs(case, self.world, n, dtype)
        x = xs[self.rank].copy()

        def body() -> None:
            got = ctx.all_reduce_blocking(x, op, strategy=strategy)
            self.check(case + "/in-place", got is x, "the numpy array did not come back")
            self.check(case, agrees(x, reference(op, xs), op in (ReduceOp.MAX, ReduceOp.MIN)),
                       f"got {x[:4]}..., want {reference(op, xs)[:4]}...")
            self.hashes[case] = digest(x)
        self.run_case(case, body)

    def reduce_scatter(self, ctx: DistributedContext, case: str, n: int, dtype: str,
                       op: ReduceOp) -> None:
        xs = inputs(case, self.world, n, dtype)
        x = xs[self.rank].copy()

        def body() -> None:
            got = ctx.reduce_scatter_blocking(x, op)
            start, end = chunk_bounds(n, self.world)[self.rank]
            want = reference(op, xs)[start:end]
            self.check(case, agrees(np.asarray(got), want, op in (ReduceOp.MAX, ReduceOp.MIN)),
                       f"block {start}:{end} got {np.asarray(got)[:4]}, want {want[:4]}")
            self.check(case + "/input-untouched", np.array_equal(x, xs[self.rank]))
        self.run_case(case, body)

    def reduce(self, ctx: DistributedContext, case: str, n: int, dtype: str, op: ReduceOp,
               root: int) -> None:
        xs = inputs(case, self.world, n, dtype)
        x = xs[self.rank].copy()

        def body() -> None:
            got = ctx.reduce_blocking(x, root, op)
            self.check(case + "/in-place", got is x)
            if self.rank == root:
                self.check(case, agrees(x, reference(op, xs),
                                        op in (ReduceOp.MAX, ReduceOp.MIN)),
                           f"got {x[:4]}, want {reference(op, xs)[:4]}")
        self.run_case(case, body)

    def broadcast(self, ctx: DistributedContext, case: str, n: int, dtype: str,
                  root: int) -> None:
        xs = inputs(case, self.world, n, dtype)
        x = xs[self.rank].copy()

        def body() -> None:
            got = ctx.broadcast_blocking(x, root)
            self.check(case + "/in-place", got is x)
            self.check(case, agrees(x, xs[root], exact=True), f"got {x[:4]}, want "
                       f"{xs[root][:4]}")
            self.hashes[case] = digest(x)
        self.run_case(case, body)

    def all_gather(self, ctx: DistributedContext, case: str, n: int, dtype: str) -> None:
        xs = inputs(case, self.world, n, dtype)
        x = xs[self.rank].copy()

        def body() -> None:
            got = np.asarray(ctx.all_gather_blocking(x))
            self.check(case, agrees(got, np.stack(xs), exact=True),
                       f"shape {got.shape} {got.dtype}")
            self.hashes[case] = digest(got)
        self.run_case(case, body)

    def send_recv(self, ctx: DistributedContext, case: str, n: int, dtype: str) -> None:
        """Every rank sends its input to every other rank, twice (the
        second must not overtake the first), runs an all_reduce (its
        messages arrive behind the point-to-point ones on the same
        connections), then receives from each."""
        xs = inputs(case, self.world, n, dtype)
        others = [r for r in range(self.world) if r != self.rank]

        def body() -> None:
            for to in others:
                ctx.send_blocking(xs[self.rank], to)
                ctx.send_blocking(xs[self.rank][::-1].copy(), to)
            between = np.full(3, self.rank + 1, np.int64)
            ctx.all_reduce_blocking(between)
            self.check(case + "/all_reduce-between",
                       bool(np.all(between == self.world * (self.world + 1) // 2)))
            for sender in others:
                first = np.empty(n, dtype)
                second = np.empty(n, dtype)
                got = ctx.recv_blocking(first, sender)
                self.check(case + f"/from{sender}/in-place", got is first)
                ctx.recv_blocking(second, sender)
                self.check(case + f"/from{sender}", np.array_equal(first, xs[sender])
                           and np.array_equal(second, xs[sender][::-1]))
        self.run_case(case, body)

    def barrier(self, ctx: DistributedContext, case: str) -> None:
        self.run_case(case, lambda: ctx.barrier_blocking())
        self.check(case, True)

    def layouts(self, ctx: DistributedContext, label: str) -> None:
        """Arrays of any shape; a strided view is reduced in place (into its
        base); a read-only array is left alone and the result returned."""
        case = f"{label}/layouts"
        w, r = self.world, self.rank
        xs = inputs(case, w, 6 * 5, "int64")
        want = reference(ReduceOp.SUM, xs).reshape(6, 5)

        def body() -> None:
            grid = xs[r].reshape(6, 5).copy()
            got = ctx.all_reduce_blocking(grid)
            self.check(case + "/2d", got is grid and np.array_equal(grid, want))
            base = xs[r].reshape(6, 5).copy()
            view = base[::2, 1::2]
            got = ctx.all_reduce_blocking(view)
            expect = xs[r].reshape(6, 5).copy()
            expect[::2, 1::2] = want[::2, 1::2]
            self.check(case + "/strided", got is view and np.array_equal(base, expect),
                       f"got {base}, want {expect}")
            frozen = xs[r].reshape(6, 5).copy()
            frozen.flags.writeable = False
            got = ctx.all_reduce_blocking(frozen)
            self.check(case + "/read-only", got is not frozen
                       and np.array_equal(frozen, xs[r].reshape(6, 5))
                       and np.array_equal(got, want))
            gathered = ctx.all_gather_blocking(xs[r].reshape(6, 5))
            self.check(case + "/all_gather-2d", gathered.shape == (w, 6, 5)
                       and np.array_equal(gathered.reshape(w, -1), np.stack(xs)))
            self.hashes[case] = digest(grid) + digest(view) + digest(got)
        self.run_case(case, body)

    def asyncio_api(self, ctx: DistributedContext, label: str) -> None:
        """The awaitable twins give what the blocking ones give."""
        import asyncio
        case = f"{label}/asyncio"
        w, r = self.world, self.rank
        xs = inputs(case, w, 3 * w + 2, "float32")

        async def body() -> None:
            x = xs[r].copy()
            got = await ctx.all_reduce(x, "max")
            self.check(case + "/all_reduce", got is x and agrees(x, reference(ReduceOp.MAX, xs),
                                                                  exact=True))
            y = xs[r].copy()
            await ctx.broadcast(y, root=w - 1)
            self.check(case + "/broadcast", np.array_equal(y, xs[w - 1]))
            gathered = await ctx.all_gather(xs[r])
            self.check(case + "/all_gather", np.array_equal(gathered, np.stack(xs)))
            block = await ctx.reduce_scatter(xs[r], "min")
            start, end = chunk_bounds(xs[r].size, w)[r]
            self.check(case + "/reduce_scatter",
                       np.array_equal(block, reference(ReduceOp.MIN, xs)[start:end]))
            await ctx.barrier()
            if w > 1:
                await ctx.send(xs[r], (r + 1) % w)
                into = np.empty_like(xs[r])
                await ctx.recv(into, (r - 1) % w)
                self.check(case + "/send_recv", np.array_equal(into, xs[(r - 1) % w]))
            self.hashes[case] = digest(x) + digest(y) + digest(gathered)
        self.run_case(case, lambda: asyncio.run(body()))

    def mlx(self, ctx: DistributedContext, label: str) -> None:
        """MLX arrays come back as new MLX arrays of their dtype, reduced."""
        for dtype in ("float32", "bfloat16"):
            for n in (1, 3 * self.world + 2):
                self.mlx_all_reduce(ctx, f"{label}/mlx/all_reduce/{dtype}/n{n}", n, dtype)

    def mlx_all_reduce(self, ctx: DistributedContext, case: str, n: int, dtype: str) -> None:
        import mlx.core as mx
        mx_dtype = getattr(mx, dtype)
        # Every rank's input as this dtype, and their sum in float32.
        xs = [mx.array(a).astype(mx_dtype) for a in inputs(case, self.world, n, "float32")]
        want = np.add.reduce(np.stack([np.array(a.astype(mx.float32)) for a in xs]), axis=0)

        def body() -> None:
            got = ctx.all_reduce_blocking(xs[self.rank])
            self.check(case + "/type", isinstance(got, mx.array) and got.dtype == mx_dtype,
                       f"got {type(got)} {getattr(got, 'dtype', None)}")
            values = np.array(got.astype(mx.float32))
            rtol = 2e-2 if dtype == "bfloat16" else 1e-5
            self.check(case, bool(np.allclose(values, want, rtol=rtol)),
                       f"got {values[:4]}, want {want[:4]}")
            self.hashes[case] = digest(values)
        self.run_case(case, body)


def run_matrix(spec: dict[str, Any]) -> None:
    rank = spec["rank"]
    groups: dict[str, list[str]] = spec["groups"]
    world = len(next(iter(groups.values())))
    matrix = Matrix(world, rank, tuple(spec.get("dtypes", DTYPES)))
    try:
        import mlx.core  # noqa: F401
        have_mlx = True
    except ImportError:
        have_mlx = False
    start = time.monotonic()
    timings = {}
    try:
        for strategy, nodes in groups.items():
            t0 = time.monotonic()
            with make_context(spec, nodes, rank, strategy) as ctx:
                matrix.strategy(ctx, f"w{world}/{strategy}")
                matrix.asyncio_api(ctx, f"w{world}/{strategy}")
                matrix.layouts(ctx, f"w{world}/{strategy}")
                if have_mlx and strategy == "auto":
                    matrix.mlx(ctx, f"w{world}/{strategy}")
            timings[strategy] = round(time.monotonic() - t0, 2)
    except PMetalError:
        pass  # recorded as a failure by run_case
    with open(spec["out"], "w") as f:
        json.dump({"rank": rank, "failures": matrix.failures, "hashes": matrix.hashes,
                   "cases": matrix.cases, "mlx": have_mlx, "timings": timings,
                   "seconds": round(time.monotonic() - start, 2)}, f)
    emit(done=True, failures=len(matrix.failures), cases=matrix.cases)


# ------------------------------------------------------------------- loop

def run_loop(spec: dict[str, Any]) -> None:
    """See the module docstring."""
    rank, nodes = spec["rank"], spec["nodes"]
    n = spec["mib"] * (1 << 20) // 4
    ctx = make_context(spec, nodes, rank, timeout=spec["timeout"])
    x = np.empty(n, np.float32)
    op = 0
    try:
        while True:
            x.fill(rank + 1)
            ctx.all_reduce_blocking(x)
            op += 1
            expected = len(nodes) * (len(nodes) + 1) / 2
            if not np.all(x == expected):
                emit(wrong=op, got=float(x[0]), want=expected)
                return
            emit(op=op)
    except CollectiveError as exc:
        failed_at = time.time()
        causes = []
        cause: BaseException | None = exc.__cause__
        while cause is not None:
            causes.append(type(cause).__name__)
            cause = cause.__cause__
        emit(error=type(exc).__name__, message=str(exc), causes=causes, t=failed_at, op=op)
    # The test answers with the survivors' world once every survivor has
    # failed (the old group stays open until then: no survivor learns of
    # the failure from another's close).
    line = sys.stdin.readline()
    if not line:
        emit(reformed=False, why="stdin closed")
        return
    new = json.loads(line)
    ctx.close()
    start = time.monotonic()
    new_rank, new_nodes = new["rank"], new["nodes"]
    with make_context(spec, new_nodes, new_rank, timeout=spec["timeout"]) as again:
        y = np.full(1 << 16, new_rank + 1, np.float32)
        again.all_reduce_blocking(y)
        size = len(new_nodes)
        z = np.full(7, 2 ** new_rank, np.int64)
        again.all_reduce_blocking(z, "max")
        emit(reformed=True, world=again.world_size,
             ok=bool(np.all(y == size * (size + 1) / 2) and np.all(z == 2 ** (size - 1))),
             seconds=round(time.monotonic() - start, 3))


# ---------------------------------------------------------------- connect

def run_connect(spec: dict[str, Any]) -> None:
    start = time.monotonic()
    try:
        with make_context(spec, spec["nodes"], spec["rank"],
                          spec.get("strategy", "auto")) as ctx:
            x = np.arange(5, dtype=np.int64)
            ctx.all_reduce_blocking(x)
            emit(ok=bool(np.all(x == np.arange(5) * ctx.world_size)),
                 elapsed=round(time.monotonic() - start, 3))
    except PMetalError as exc:
        emit(error=type(exc).__name__, message=str(exc),
             elapsed=round(time.monotonic() - start, 3))


# --------------------------------------------------------------- mismatch

def run_mismatch(spec: dict[str, Any]) -> None:
    """all_reduce of ``n`` x ``dtype`` (the test gives ranks different
    ones) in a group per strategy; print each outcome."""
    for strategy, nodes in spec["groups"].items():
        with make_context(spec, nodes, spec["rank"], strategy,
                          timeout=spec["timeout"]) as ctx:
            start = time.monotonic()
            try:
                ctx.all_reduce_blocking(np.ones(spec["n"], spec["dtype"]))
                emit(strategy=strategy, ok=True)
            except PMetalError as exc:
                emit(strategy=strategy, error=type(exc).__name__, message=str(exc),
                     elapsed=round(time.monotonic() - start, 3))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    {"matrix": run_matrix, "loop": run_loop, "connect": run_connect,
     "mismatch": run_mismatch}[mode](spec)


if __name__ == "__main__":
    main()
