"""``pmetal bench allreduce``: all_reduce timed the way nccl-tests and the
anchors (``../shared/anchors``) time it, so that the figures compare.

Layout: every rank is its own process (``python -m pmetal.bench.allreduce
--worker JOB``) on 127.0.0.1, forming a group with
:class:`~pmetal.collectives.spmd.RingBackend` as a user's script would.
One set of processes per world size (and same-machine setting) measures
every size and every strategy, the strategies taking turns repetition by
repetition so that a noisy machine hurts them alike: ``ring``, ``tree``,
``naive`` are forced per call, ``auto`` is the group's own choice.

Each size: warm-up repetitions, then ``iters`` timed ones; each starts
after a barrier and times ``batch_for(size)`` back-to-back operations
(small ones are batched, like the anchors, so that the barrier's wake-up
skew does not dominate). A repetition's time per operation is the slowest
rank's; the table shows the median over repetitions. algbw = bytes /
time, busbw = algbw x 2(n-1)/n (nccl-tests' convention: comparable across
world sizes), GB/s = 1e9 B/s.

Results are checked, not assumed: rank ``r`` fills element ``i`` with
``(i + 37 r) mod 251`` (a prime period, so no block boundary of any
strategy lines up with it), whose float32 sum is exact; every repetition
of every operation is compared with the known sum, and ``#wrong`` counts
the elements that differ, over every rank.

The first operation of a fresh group is measured too (users see that
first): from the spawn of the processes to the group formed and to the
first 4 KiB all_reduce's result on the slowest rank.

``--system gloo`` runs the same loop over torch.distributed's gloo (when
torch is installed) in the same process layout. Its rendezvous (torch's
TCPStore on rank 0) listens on every interface whatever address it is
given; the anchors run it in a loopback-only network namespace for that
reason, and ``--anchors off`` skips it. Untested here: torch is not
installed on the machine this was written on.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from pmetal.errors import CollectiveError, ConfigError

if TYPE_CHECKING:  # numpy is imported where it is used: 'pmetal --help' need not pay it
    import numpy as np

__all__ = ["STRATEGIES", "BenchSpec", "ColdStart", "Row", "WorldResult", "batch_for",
           "parse_size", "run_world", "sizes_between", "variant"]

KiB, MiB = 1024, 1 << 20
STRATEGIES = ("ring", "tree", "naive", "auto")
SYSTEMS = ("pmetal", "gloo")
FIRST_OP_BYTES = 4 * KiB
_PERIOD = 251
_HOST = "127.0.0.1"


@dataclass(frozen=True)
class BenchSpec:
    """One set of rank processes: what they measure and how."""
    world: int
    sizes: tuple[int, ...]
    strategies: tuple[str, ...] = STRATEGIES
    iters: int = 15
    warmup: int = 3
    same_machine: bool = False
    system: str = "pmetal"
    chunk_bytes: int | None = None       # None: the configuration's
    tree_max_bytes: int | None = None    # None: the configuration's
    timeout: float = 30.0                # per operation (CollectiveConfig.timeout)
    # The TCP links measured, taking turns with the strategies: (False,) in
    # clear, (True,) sealed (link_encryption "on"), (False, True) both.
    sealed: tuple[bool, ...] = (False,)

    def __post_init__(self) -> None:
        if self.world < 2:
            raise ConfigError(f"--world {self.world}: an all_reduce benchmark needs at "
                              "least 2 ranks")
        if not self.sizes or any(s < 4 or s % 4 for s in self.sizes):
            raise ConfigError(f"sizes {list(self.sizes)}: each must be a multiple of 4 bytes "
                              "(float32 elements), at least 4")
        unknown = set(self.strategies) - set(STRATEGIES)
        if unknown or not self.strategies:
            raise ConfigError(f"strategies {sorted(unknown) or '(none)'}: choose from "
                              f"{', '.join(STRATEGIES)}")
        if self.system not in SYSTEMS:
            raise ConfigError(f"system {self.system!r}: choose from {', '.join(SYSTEMS)}")
        if not self.sealed or (any(self.sealed) and (self.same_machine
                                                     or self.system != "pmetal")):
            raise ConfigError("sealed links are pmetal's TCP links: not with the same-machine "
                              "path (shared memory, never sealed) nor with gloo")
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError(f"--iters {self.iters} / --warmup {self.warmup}: iters must "
                              "be at least 1, warmup at least 0")


def variant(strategy: str, sealed: bool) -> str:
    """A row's name: the strategy, and whether its links were sealed."""
    return strategy + (", sealed" if sealed else "")


def batch_for(size: int) -> int:
    """Operations per timed repetition (the anchors' rule)."""
    return 50 if size <= 4 * KiB else 10 if size <= 256 * KiB else 1


def sizes_between(min_bytes: int, max_bytes: int, factor: int = 4) -> tuple[int, ...]:
    """``min_bytes``, x ``factor``, ..., up to ``max_bytes`` (nccl-tests' -b/-e/-f)."""
    if min_bytes < 4 or max_bytes < min_bytes or factor < 2:
        raise ConfigError(f"sizes {min_bytes}..{max_bytes} x{factor}: need 4 <= min <= max "
                          "and a factor of at least 2")
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= factor
    return tuple(out)


def parse_size(text: str) -> int:
    """``4``, ``4K``, ``64M``, ``64MiB``, ``1G`` -> bytes (powers of two)."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": KiB, "M": MiB, "G": 1 << 30}.get(raw[-1:], 1)
    number = raw[:-1] if scale > 1 else raw
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise ConfigError(f"size {text!r}: write bytes, or a number with K, M or G "
                          "(e.g. 4, 1K, 64M)") from None
    return value


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


# ------------------------------------------------------------ the ranks

def _inputs(n: int, rank: int) -> np.ndarray:
    import numpy as np
    return ((np.arange(n, dtype=np.int64) + 37 * rank) % _PERIOD).astype(np.float32)


def _expected(n: int, world: int) -> np.ndarray:
    import numpy as np
    total = np.zeros(n, np.float32)
    for rank in range(world):
        total += _inputs(n, rank)  # integers below 2**24: exact in float32
    return total


class _PmetalComm:
    """A rank of a pmetal group, formed as a user's script forms it; one
    group per links variant of ``spec.sealed`` (``nodes[sealed]``)."""

    def __init__(self, spec: BenchSpec, rank: int, nodes: dict[bool, Sequence[str]]) -> None:
        from pmetal.collectives.spmd import (
            DistributedConfig,
            DistributedContext,
            RingBackend,
        )
        from pmetal.config import load_config
        base = load_config().collectives
        self.ctxs = {}
        for sealed in spec.sealed:
            # On 127.0.0.1 "auto" leaves the links in clear; "on" seals them.
            config = replace(base, strategy="auto", shared_memory=spec.same_machine,
                             timeout=spec.timeout,
                             link_encryption="on" if sealed else "auto",
                             chunk_bytes=spec.chunk_bytes or base.chunk_bytes,
                             tree_max_bytes=(base.tree_max_bytes if spec.tree_max_bytes is None
                                             else spec.tree_max_bytes))
            self.ctxs[sealed] = DistributedContext(RingBackend(DistributedConfig(
                nodes=list(nodes[sealed]), rank=rank, collectives=config,
                name="bench-allreduce" + ("-sealed" if sealed else ""))))
        self.first = self.ctxs[spec.sealed[0]]

    def connect(self) -> None:
        for ctx in self.ctxs.values():
            ctx.connect_blocking()

    def links(self, sealed: bool) -> str:
        """What carries the data (TcpLinks, sealed or not; ShmLinks)."""
        links = self.ctxs[sealed].group.links
        locks = getattr(links, "sealed", {})
        return type(links).__name__ + (", sealed" if any(locks.values()) else "")

    def wrap(self, buffer: np.ndarray) -> Any:
        return buffer

    def all_reduce(self, handle: Any, strategy: str, sealed: bool = False) -> None:
        self.ctxs[sealed].group.all_reduce(handle,
                                           strategy=None if strategy == "auto" else strategy)

    def barrier(self) -> None:
        self.first.group.barrier()

    def close(self) -> None:
        for ctx in self.ctxs.values():
            ctx.close()


class _GlooComm:
    """A rank of torch.distributed's gloo, as the anchors run it (one
    thread, loopback only); the strategy is gloo's own."""

    def __init__(self, spec: BenchSpec, rank: int, nodes: dict[bool, Sequence[str]]) -> None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        self.torch, self.dist = torch, dist
        self.rank, self.world, self.store = rank, spec.world, nodes[False][0]

    def links(self, sealed: bool) -> str:
        return "gloo"

    def connect(self) -> None:
        self.dist.init_process_group("gloo", init_method=f"tcp://{self.store}",
                                     rank=self.rank, world_size=self.world)

    def wrap(self, buffer: np.ndarray) -> Any:
        return self.torch.from_numpy(buffer)  # shares the buffer: the check sees the result

    def all_reduce(self, handle: Any, strategy: str, sealed: bool = False) -> None:
        self.dist.all_reduce(handle)

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()


_COMMS = {"pmetal": _PmetalComm, "gloo": _GlooComm}


def _measure(comm: Any, spec: BenchSpec, size: int, source: np.ndarray,
             expected: np.ndarray) -> dict[str, dict[str, Any]]:
    """One size on this rank, every strategy over every links variant:
    per-operation seconds of each timed repetition, and the wrong elements
    of every repetition, by :func:`variant` name. The variants take turns
    repetition by repetition, so that a busy spell of the machine hits
    them alike."""
    import numpy as np
    k = batch_for(size)
    buffers = [np.empty_like(source) for _ in range(k)]
    handles = [comm.wrap(b) for b in buffers]
    variants = [(s, sealed) for sealed in spec.sealed for s in spec.strategies]
    out: dict[str, dict[str, Any]] = {variant(s, sealed): {"times": [], "wrong": 0}
                                      for s, sealed in variants}
    for rep in range(spec.warmup + spec.iters):
        for strategy, sealed in variants:
            got = out[variant(strategy, sealed)]
            for b in buffers:
                np.copyto(b, source)
            comm.barrier()
            start = time.perf_counter()
            for h in handles:
                comm.all_reduce(h, strategy, sealed)
            elapsed = time.perf_counter() - start
            got["wrong"] += sum(int(np.count_nonzero(b != expected)) for b in buffers)
            if rep >= spec.warmup:
                got["times"].append(elapsed / k)
    return out


def _worker(job_path: str) -> None:
    started = time.time()
    with open(job_path) as f:
        job = json.load(f)
    spec = _spec_from_json(job["spec"])
    rank = job["rank"]
    nodes = {sealed: job["nodes"]["sealed" if sealed else "clear"] for sealed in (False, True)}
    comm = _COMMS[spec.system](spec, rank, nodes)
    imported = time.time()
    comm.connect()
    connected = time.time()
    links = {("sealed" if sealed else "clear"): comm.links(sealed) for sealed in spec.sealed}
    n = FIRST_OP_BYTES // 4
    first = _inputs(n, rank)
    comm.all_reduce(comm.wrap(first), "auto", spec.sealed[0])
    first_done = time.time()
    import numpy as np
    first_wrong = int(np.count_nonzero(first != _expected(n, spec.world)))
    results: dict[str, dict[str, Any]] = {}
    for size in spec.sizes:
        source, expected = _inputs(size // 4, rank), _expected(size // 4, spec.world)
        for name, got in _measure(comm, spec, size, source, expected).items():
            results[f"{name}/{size}"] = got
    comm.barrier()
    comm.close()
    with open(job["out"], "w") as f:
        json.dump({"rank": rank, "started": started, "imported": imported,
                   "connected": connected, "first_done": first_done,
                   "first_wrong": first_wrong, "links": links, "results": results},
                  f)


def _spec_from_json(data: dict[str, Any]) -> BenchSpec:
    return BenchSpec(**{**data, "sizes": tuple(data["sizes"]),
                        "strategies": tuple(data["strategies"]),
                        "sealed": tuple(data["sealed"])})


# ------------------------------------------------------------ the driver

@dataclass(frozen=True)
class Row:
    """One line of a table: ``time`` the median over repetitions of the
    slowest rank's seconds per operation; ``fastest``/``slowest`` its
    range."""
    size: int
    count: int
    time: float
    fastest: float
    slowest: float
    algbw: float
    busbw: float
    wrong: int
    reps: int


@dataclass(frozen=True)
class ColdStart:
    """Seconds from the spawn of the rank processes (slowest rank):
    ``imported`` Python, numpy and pmetal loaded; ``connected`` group
    formed; ``first`` first 4 KiB all_reduce's result. ``connect`` the
    slowest rank's connect call; ``connect_after_ready`` from the last
    rank ready to connect to the group formed on every rank."""
    imported: float
    connected: float
    first: float
    connect: float
    connect_after_ready: float
    first_op: float
    wrong: int


@dataclass(frozen=True)
class WorldResult:
    spec: BenchSpec
    rows: dict[str, list[Row]]   # by variant name ("gloo" for --system gloo)
    cold: ColdStart
    links: str = ""              # what carried the data, by type (rank 0's)
    links_sealed: str = ""       # the same, of the sealed variant


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((_HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _worker_env() -> dict[str, str]:
    """The workers import the same pmetal as this process (a checkout on
    PYTHONPATH included)."""
    import pmetal
    root = os.path.dirname(os.path.dirname(os.path.abspath(pmetal.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_world(spec: BenchSpec, *, deadline: float = 900.0) -> WorldResult:
    """Spawn ``spec.world`` rank processes, wait for their measurements
    (at most ``deadline`` seconds) and merge them. Raises
    :class:`~pmetal.errors.CollectiveError` naming the rank that failed,
    with the end of its output."""
    ports = _free_ports(2 * spec.world)
    nodes = {"clear": [f"{_HOST}:{p}" for p in ports[:spec.world]],
             "sealed": [f"{_HOST}:{p}" for p in ports[spec.world:]]}
    with tempfile.TemporaryDirectory(prefix="pmetal-bench-allreduce-") as tmp:
        jobs, logs = [], []
        for rank in range(spec.world):
            path = os.path.join(tmp, f"job{rank}.json")
            with open(path, "w") as f:
                json.dump({"spec": asdict(spec), "rank": rank, "nodes": nodes,
                           "out": os.path.join(tmp, f"out{rank}.json")}, f)
            jobs.append(path)
            logs.append(open(os.path.join(tmp, f"log{rank}.txt"), "w+b"))  # noqa: SIM115
        env = _worker_env()
        procs: list[subprocess.Popen[bytes]] = []
        spawned = time.time()
        try:
            for rank in range(spec.world):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "pmetal.bench.allreduce", "--worker", jobs[rank]],
                    stdin=subprocess.DEVNULL, stdout=logs[rank], stderr=subprocess.STDOUT,
                    env=env))
            end = time.monotonic() + deadline
            for rank, proc in enumerate(procs):
                try:
                    proc.wait(timeout=max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise CollectiveError(
                        f"bench allreduce: rank {rank} of {spec.world} did not finish within "
                        f"{deadline:g} s; fewer sizes (--max-bytes) or --iters, or a "
                        "quieter machine") from None
            failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
            if failed:
                rank, code = failed[0]
                logs[rank].seek(0)
                tail = logs[rank].read().decode(errors="replace").strip()[-2000:]
                raise CollectiveError(f"bench allreduce: rank {rank} of {spec.world} "
                                      f"({spec.system}) exited with status {code}:\n{tail}")
            outs = []
            for rank in range(spec.world):
                with open(os.path.join(tmp, f"out{rank}.json")) as f:
                    outs.append(json.load(f))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
            for log in logs:
                log.close()
    return _merge(spec, spawned, outs)


def _merge(spec: BenchSpec, spawned: float, outs: list[dict[str, Any]]) -> WorldResult:
    rows: dict[str, list[Row]] = {}
    keys = [variant(s, sealed) for sealed in spec.sealed for s in spec.strategies]
    names = ["gloo"] if spec.system == "gloo" else keys
    for name, key in zip(names, keys):
        for size in spec.sizes:
            per_rank = [o["results"][f"{key}/{size}"] for o in outs]
            slowest = [max(reps) for reps in zip(*(r["times"] for r in per_rank))]
            t = statistics.median(slowest)
            algbw = size / t / 1e9
            rows.setdefault(name, []).append(Row(
                size=size, count=size // 4, time=t, fastest=min(slowest),
                slowest=max(slowest), algbw=algbw,
                busbw=algbw * 2 * (spec.world - 1) / spec.world,
                wrong=sum(r["wrong"] for r in per_rank), reps=len(slowest)))
    cold = ColdStart(
        imported=max(o["imported"] for o in outs) - spawned,
        connected=max(o["connected"] for o in outs) - spawned,
        first=max(o["first_done"] for o in outs) - spawned,
        connect=max(o["connected"] - o["imported"] for o in outs),
        connect_after_ready=max(o["connected"] for o in outs)
        - max(o["imported"] for o in outs),
        first_op=max(o["first_done"] - o["connected"] for o in outs),
        wrong=sum(o["first_wrong"] for o in outs))
    return WorldResult(spec=spec, rows=rows, cold=cold, links=outs[0]["links"].get("clear", ""),
                       links_sealed=outs[0]["links"].get("sealed", ""))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pmetal.bench.allreduce --worker JOB``: one rank (the
    command for people is ``pmetal bench allreduce``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "--worker":
        print("this module runs one rank of 'pmetal bench allreduce'; run that command",
              file=sys.stderr)
        return 2
    _worker(args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
