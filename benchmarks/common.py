"""Timing helpers shared by the benchmark suites."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


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
