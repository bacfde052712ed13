"""Timing helpers shared by the benchmark suites."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.rjust(w) if i else c.ljust(w)  # noqa: E731
                                        for i, (c, w) in enumerate(zip(r, widths))) + " |"
    out = [f"\n### {title}\n", line(cells[0]),
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def _fmt(c: object) -> str:
    if isinstance(c, float):
        if c >= 100:
            return f"{c:,.0f}"
        if c >= 10:
            return f"{c:.1f}"
        return f"{c:.2f}"
    if isinstance(c, int):
        return f"{c:,}"
    return str(c)


def _thread_ticks(pid: int) -> dict[str, int]:
    """CPU clock ticks used so far by each thread of ``pid``, by thread name
    (Linux /proc)."""
    out: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0) + int(fields[11]) + int(fields[12])  # utime + stime
    return out


def cpu_per_call(call: Callable[[], Any], pids: dict[str, int], count: int) -> dict[str, float]:
    """Microseconds of CPU per call, by process and thread: where a round
    trip's time goes (the Python thread of each side, and ZeroMQ's I/O
    thread of each)."""
    before = {who: _thread_ticks(pid) for who, pid in pids.items()}
    for _ in range(count):
        call()
    after = {who: _thread_ticks(pid) for who, pid in pids.items()}
    us_per_tick = 1e6 / os.sysconf("SC_CLK_TCK") / count
    out = {}
    for who in pids:
        for thread, ticks in after[who].items():
            used = (ticks - before[who].get(thread, 0)) * us_per_tick
            if used >= 0.5:
                kind = "ZeroMQ I/O thread" if thread.startswith("ZMQbg/") else "Python threads"
                out[f"{who}: {kind}"] = out.get(f"{who}: {kind}", 0.0) + used
    return out
