"""What ``pmetal bench allreduce`` prints: one nccl-tests-like table per
world size and strategy, the first operation of a fresh group, and the
issue's targets against the anchors (torch.distributed gloo measured in
the same run when torch is installed, else the figures of the anchors
README, labelled as such)."""

from __future__ import annotations

import datetime
import importlib.util
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from pmetal.bench.allreduce import (
    BenchSpec,
    MiB,
    WorldResult,
    fmt_size,
    run_world,
    variant,
)

__all__ = ["ANCHORS", "TARGETS", "Options", "run"]

README = "anchors README"
# ../shared/anchors/README.md, three sittings on this kind of machine
# (2 cores, TCP loopback in a loopback-only namespace): (low, high).
ANCHORS: dict[tuple[str, int], dict[str, tuple[float, float]]] = {
    ("gloo", 2): {"4k_us": (1400.0, 2300.0), "busbw": (0.62, 0.77)},
    ("gloo", 4): {"4k_us": (7500.0, 7600.0), "busbw": (0.33, 0.56)},
    ("MPI over TCP", 2): {"4k_us": (34.0, 52.0), "busbw": (0.63, 0.70)},
    ("MPI over TCP", 4): {"4k_us": (138.0, 141.0), "busbw": (0.33, 0.40)},
    ("MPI over shared memory", 2): {"busbw": (1.18, 1.22)},
}
ANCHOR_INIT = {"gloo init_process_group": "5 ms-0.7 s", "MPI_Init": "77-166 ms"}
# The targets, float32 sum: TCP with the same-machine path off,
# and the same-machine path on (2 ranks).
TARGETS = {2: {"4k_us": 300.0, "busbw": 1.0}, 4: {"4k_us": 600.0, "busbw": 0.6}}
TARGET_SAME_MACHINE_BUSBW = 2.0


@dataclass(frozen=True)
class Options:
    worlds: tuple[int, ...] = (2, 4)
    sizes: tuple[int, ...] = ()
    strategies: tuple[str, ...] = ("ring", "tree", "naive", "auto")
    iters: int = 15
    warmup: int = 3
    same_machine: tuple[bool, ...] = (False,)
    anchors: bool = True          # run gloo too when torch is installed
    chunk_bytes: int | None = None
    tree_max_bytes: int | None = None
    timeout: float = 30.0
    sealed: tuple[bool, ...] = (False,)   # TCP links in clear, sealed, or both
    markdown: bool = False
    command: str = "pmetal bench allreduce"


def run(options: Options, out: TextIO | None = None) -> list[WorldResult]:
    """Measure and print (on ``out``, default: standard output at the time
    of the call, not of the import); returns every world's result."""
    gloo = options.anchors and importlib.util.find_spec("torch") is not None
    stream = sys.stdout if out is None else out
    p = lambda *a: print(*a, file=stream, flush=True)
    # Sealing is a TCP matter: the same-machine path is never sealed. The
    # links variants take turns in one set of processes, like the strategies.
    specs = {(world, same): BenchSpec(  # every spec checked before anything runs
        world=world, sizes=options.sizes, strategies=options.strategies,
        iters=options.iters, warmup=options.warmup, same_machine=same,
        chunk_bytes=options.chunk_bytes, tree_max_bytes=options.tree_max_bytes,
        timeout=options.timeout, sealed=(False,) if same else options.sealed)
        for world in options.worlds for same in options.same_machine}
    p(_header(options))
    results: list[WorldResult] = []
    for world in options.worlds:
        for same in options.same_machine:
            spec = specs[(world, same)]
            print(f"pmetal bench allreduce: {world} ranks, same-machine path "
                  f"{'on' if same else 'off'} ...", file=sys.stderr, flush=True)
            result = run_world(spec)
            results.append(result)
            for name in result.rows:
                p(_table(result, name, options.markdown))
            if len(spec.sealed) > 1:
                p(_sealing(result, options.markdown))
        if gloo:
            spec = BenchSpec(world=world, sizes=options.sizes, strategies=("auto",),
                             iters=options.iters, warmup=options.warmup, system="gloo")
            print(f"pmetal bench allreduce: gloo, {world} ranks ...", file=sys.stderr,
                  flush=True)
            result = run_world(spec)
            results.append(result)
            p(_table(result, "gloo", options.markdown))
    p(_cold(results, options.markdown))
    p(_targets(results, gloo, options.markdown))
    p(f"\nload average at the end: {_load()}; memcpy 64 MiB at the end: {_memcpy()}")
    return results


# ------------------------------------------------------------------ tables

def _grid(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool,
          left: int = 0) -> str:
    """Right-aligned columns (the first ``left`` left-aligned); markdown
    pipes when asked."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("---" if i < left else "---:" for i in range(len(header)))
                 + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) if i < left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), *(line(r) for r in rows)])


def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:,.1f}" if us < 10_000 else f"{us:,.0f}"


def _table(result: WorldResult, name: str, markdown: bool) -> str:
    spec = result.spec
    sealed = name.endswith(", sealed")
    path = (f"same-machine path on ({result.links})" if spec.same_machine
            else f"TCP 127.0.0.1 ({result.links_sealed if sealed else result.links})")
    title = (f"{spec.world} ranks, {name}" + ("" if name == "gloo" else f", {path}")
             + f": median of {spec.iters} after {spec.warmup} warm-ups, slowest rank")
    auto = name.split(",")[0] == "auto"
    header = ["size (B)", "count", "type", "redop", "time (us)", "min-max (us)",
              "algbw (GB/s)", "busbw (GB/s)", "#wrong", *(["picks"] if auto else [])]
    rows = []
    for row in result.rows[name]:
        rows.append([str(row.size), str(row.count), "float", "sum", _us(row.time),
                     f"{_us(row.fastest)}-{_us(row.slowest)}", f"{row.algbw:.3f}",
                     f"{row.busbw:.3f}", str(row.wrong),
                     *([_auto_pick(spec, row.size)] if auto else [])])
    heading = f"\n### {title}\n" if markdown else f"\n# {title}"
    return heading + "\n" + _grid(header, rows, markdown)


def _auto_pick(spec: BenchSpec, size: int) -> str:
    from pmetal.collectives.group import Schedule
    from pmetal.config import load_config
    config = load_config().collectives
    tree_max = config.tree_max_bytes if spec.tree_max_bytes is None else spec.tree_max_bytes
    return Schedule(name="bench", world=spec.world, tree_max_bytes=tree_max).strategy_for(
        "all_reduce", size)


def _cold(results: Sequence[WorldResult], markdown: bool) -> str:
    header = ["system", "ranks", "imported (ms)", "group formed (ms)",
              "first 4 KiB result (ms)", "connect after the last rank ready (ms)",
              "first op alone (ms)", "#wrong"]
    rows = []
    for r in results:
        c, spec = r.cold, r.spec
        system = spec.system + (", same-machine on" if spec.same_machine else "")
        rows.append([system, str(spec.world), f"{c.imported * 1e3:.0f}",
                     f"{c.connected * 1e3:.0f}", f"{c.first * 1e3:.0f}",
                     f"{c.connect_after_ready * 1e3:.1f}", f"{c.first_op * 1e3:.2f}",
                     str(c.wrong)])
    title = ("First operation of a fresh group: from the spawn of the rank processes, "
             "slowest rank")
    notes = (f"({README}, not this run: {', '.join(f'{k} {v}' for k, v in ANCHOR_INIT.items())})")
    heading = f"\n### {title}\n" if markdown else f"\n# {title}"
    gap = "\n\n" if markdown else "\n"  # markdown: a line after a table must not join it
    return heading + "\n" + _grid(header, rows, markdown, left=1) + gap + notes


def _find(results: Sequence[WorldResult], world: int, *, system: str = "pmetal",
          same_machine: bool = False) -> WorldResult | None:
    for r in results:
        if (r.spec.world, r.spec.system, r.spec.same_machine) == (world, system, same_machine):
            return r
    return None


def _sealing(result: WorldResult, markdown: bool) -> str:
    """The cost of sealing: each size's all_reduce (auto, else the first
    strategy) over TCP links in clear and sealed, side by side."""
    name = "auto" if "auto" in result.spec.strategies else result.spec.strategies[0]
    rows = []
    for a, b in zip(result.rows[name], result.rows[variant(name, True)], strict=True):
        rows.append([str(a.size), _us(a.time), _us(b.time), f"{b.time / a.time:.2f}x",
                     f"{a.busbw:.3f}", f"{b.busbw:.3f}"])
    title = (f"{result.spec.world} ranks, {name}: TCP links in clear against sealed "
             "(AES-256-GCM), taking turns in one run")
    heading = f"\n### {title}\n" if markdown else f"\n# {title}"
    return heading + "\n" + _grid(["size (B)", "clear (us)", "sealed (us)", "sealed/clear",
                                   "busbw clear (GB/s)", "busbw sealed (GB/s)"], rows,
                                  markdown)


def _value(result: WorldResult | None, name: str, size: int, what: str) -> float | None:
    if result is None or name not in result.rows:
        return None
    for row in result.rows[name]:
        if row.size == size:
            return row.time * 1e6 if what == "4k_us" else row.busbw
    return None


def _fmt(what: str, value: float) -> str:
    return f"{value:,.0f}" if what == "4k_us" else f"{value:.2f}"


def _versus(what: str, ours: float | None, theirs: tuple[float, float] | None) -> str:
    """How many times better pmetal is (time: theirs / ours; bandwidth:
    ours / theirs)."""
    if ours is None or theirs is None or not ours:
        return "-"
    lo, hi = sorted((t / ours) if what == "4k_us" else (ours / t) for t in theirs if t)
    return f"{lo:.2f}x" if abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}x"


def _targets(results: Sequence[WorldResult], gloo_ran: bool, markdown: bool) -> str:
    header = ["measure", "ranks", "pmetal auto", "best strategy", "target", "met",
              "gloo", "vs gloo", "MPI", "vs MPI"]
    rows = []
    checks = [(w, False, what) for w in sorted(TARGETS) for what in ("4k_us", "busbw")]
    checks.append((2, True, "busbw"))
    for world, same, what in checks:
        ours = _find(results, world, same_machine=same)
        if ours is None:
            continue
        size = 4096 if what == "4k_us" else 64 * MiB
        auto = _value(ours, "auto", size, what)
        best = None
        for name in ours.rows:
            if name.endswith(", sealed"):
                continue        # the targets are the links' own speed
            v = _value(ours, name, size, what)
            if v is not None and (best is None or (v < best[1] if what == "4k_us"
                                                   else v > best[1])):
                best = (name, v)
        if same:
            target, mpi_name = TARGET_SAME_MACHINE_BUSBW, "MPI over shared memory"
        else:
            target, mpi_name = TARGETS[world][what], "MPI over TCP"
        met = ("not measured" if auto is None else
               ("yes" if (auto < target if what == "4k_us" else auto >= target) else "NO"))
        gloo_run = _value(_find(results, world, system="gloo"), "gloo", size, what)
        if gloo_run is not None:
            gloo_text, gloo_range = f"{_fmt(what, gloo_run)} (this run)", (gloo_run, gloo_run)
        else:
            gloo_range = None if same else ANCHORS[("gloo", world)][what]
            gloo_text = "-" if gloo_range is None else (
                f"{_fmt(what, gloo_range[0])}-{_fmt(what, gloo_range[1])} ({README})")
        mpi_range = ANCHORS.get((mpi_name, world), {}).get(what)
        mpi_text = "-" if mpi_range is None else (
            f"{_fmt(what, mpi_range[0])}-{_fmt(what, mpi_range[1])} "
            f"({mpi_name.removeprefix('MPI ')}, {README})")
        measure = ("4 KiB all_reduce time (us)" if what == "4k_us" else
                   "64 MiB all_reduce busbw (GB/s)" + (", same-machine path on" if same
                                                        else ""))
        rows.append([measure, str(world), "-" if auto is None else _fmt(what, auto),
                     "-" if best is None else f"{best[0]} {_fmt(what, best[1])}",
                     ("< " if what == "4k_us" else ">= ") + _fmt(what, target), met,
                     gloo_text, _versus(what, auto, gloo_range), mpi_text,
                     _versus(what, auto, mpi_range)])
    title = "Targets (float32 sum; TCP loopback with the same-machine path off unless said)"
    heading = f"\n### {title}\n" if markdown else f"\n# {title}"
    lines = [heading, _grid(header, rows, markdown, left=1) + ("\n" if markdown else "")]
    if not gloo_ran:
        lines.append("torch.distributed gloo: " + (
            "not run (--anchors off)" if importlib.util.find_spec("torch") else
            "not installed") + f"; its figures above are from the {README}, not this run")
    lines.append("mpi4py: " + ("installed; this command does not launch mpirun (run the "
                               "anchors' bench_mpi.py)" if importlib.util.find_spec("mpi4py")
                               else "not installed") + f"; MPI figures are from the {README}")
    return "\n".join(lines)


# ------------------------------------------------------------------ header

def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def _memcpy() -> str:
    """One thread's 64 MiB copy now (median of 7): how much memory
    bandwidth the machine has left for this sitting; large all_reduces
    move each byte several times through memory."""
    import time

    import numpy as np
    a = np.ones(64 * MiB // 4, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - start)
    return f"{64 * MiB / sorted(times)[3] / 1e9:.1f} GB/s (anchors README: 4.9-6.0)"


def _header(options: Options) -> str:
    import pmetal
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    sizes = options.sizes
    lines = [
        f"# pmetal bench allreduce, {now}: float32 sum over 127.0.0.1, ranks as processes",
        f"# command: {options.command}",
        (f"# pmetal {pmetal.__version__} ({os.path.dirname(pmetal.__file__)}), Python "
         f"{platform.python_version()}, {os.cpu_count()} CPUs, load average {_load()}"),
        (f"# sizes {fmt_size(sizes[0])} to {fmt_size(sizes[-1])}; each repetition starts "
         "after a barrier and times 50 back-to-back operations up to 4 KiB, 10 up to "
         "256 KiB, 1 above; time = the slowest rank's per operation"),
        f"# memcpy 64 MiB, one thread, now: {_memcpy()}",
        ("# algbw = size / time, busbw = algbw x 2(n-1)/n (nccl-tests), GB/s = 1e9 B/s; "
         "#wrong = elements differing from the exact sum, every repetition, every rank"),
    ]
    return "\n".join(lines)
