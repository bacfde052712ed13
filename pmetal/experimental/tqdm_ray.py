"""Ray's ``ray.experimental.tqdm_ray.tqdm``: a progress bar for tasks and
actors.

Ray's version sends each bar's state to the driver, which draws all bars
together. pmetal has no such channel: a worker's standard error is its
node's (the driver's terminal when the node is embedded in the driver), so
this bar writes whole lines there, ``desc: n/total [pct%]``, at most once
per ``flush_interval_s`` and once more when it closes. Lines from several
workers interleave but never garble one another, which carriage-return
bars of several processes on one terminal would. The constructor and the
methods are Ray's (``update``, ``set_description``, ``refresh``, ``close``,
iteration); ``position`` and ``unit`` are accepted and ``unit`` is shown.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from pmetal.errors import PMetalTypeError, PMetalValueError

__all__ = ["tqdm"]


class tqdm:   # (lower case: Ray's and tqdm's name)
    """``for x in tqdm(iterable, desc="name"): ...`` or ``bar.update(n)``."""

    def __init__(self, iterable: Iterable[Any] | None = None, desc: str | None = None,
                 total: int | None = None, unit: str | None = None,
                 position: int | None = None, flush_interval_s: float = 1.0,
                 file: TextIO | None = None) -> None:
        if total is not None and (type(total) is not int or total < 0):
            raise PMetalValueError(f"tqdm: total must be a non-negative int, not {total!r}")
        if isinstance(flush_interval_s, bool) or not isinstance(flush_interval_s, (int, float)) \
                or not flush_interval_s >= 0:
            raise PMetalTypeError(f"tqdm: flush_interval_s must be a number >= 0, not "
                                  f"{flush_interval_s!r}")
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.iterable = iterable
        self.desc = desc or ""
        self.total = total
        self.unit = unit or "it"
        self.position = position
        self.n = 0
        self._interval = float(flush_interval_s)
        self._file = file
        self._shown = -1.0   # time of the last line (-1: none yet)
        self._closed = False

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise PMetalTypeError("tqdm: nothing to iterate; give it an iterable, or call "
                                  "update(n) on a bar made with total=")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def update(self, n: int = 1) -> None:
        """``n`` more done; a line if ``flush_interval_s`` passed since the last."""
        self.n += n
        now = time.monotonic()
        if self._shown < 0 or now - self._shown >= self._interval:
            self._show(now)

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""
        if refresh:
            self.refresh()

    def refresh(self) -> None:
        self._show(time.monotonic())

    def close(self) -> None:
        """The last line (once)."""
        if not self._closed:
            self._closed = True
            self._show(time.monotonic())

    def line(self) -> str:
        """What the bar shows now."""
        head = f"{self.desc}: " if self.desc else ""
        if self.total:
            return f"{head}{self.n}/{self.total} {self.unit} [{100 * self.n // self.total}%]"
        return f"{head}{self.n} {self.unit}"

    def _show(self, now: float) -> None:
        self._shown = now
        out = self._file or sys.stderr
        print(self.line(), file=out, flush=True)

    def __enter__(self) -> tqdm:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"tqdm({self.line()!r})"
