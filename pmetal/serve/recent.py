"""How fast the server's recent requests went: what ``GET /stats`` shows
under ``recent``, and the node's dashboard beside its chat page.

What it owns: the figures of the last :data:`KEPT` requests that produced
a token (their tokens, time to the first token, decode rate), kept by
:class:`RecentRequests` as the server's requests end, on the server's
event loop (no lock: one thread adds and reads). The batcher's own
counters (``/stats`` beside this) count every request since the start;
these say how the last few went, which is what a person watching wants.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import Any

__all__ = ["KEPT", "RecentRequests", "RequestFigures"]

KEPT = 32
"""Requests whose figures are kept."""


@dataclass(frozen=True)
class RequestFigures:
    """One request: ``tokens`` produced, seconds from its arrival to its
    first token (``first_token``) and to its end (``seconds``)."""

    tokens: int
    first_token: float
    seconds: float

    @property
    def tokens_per_second(self) -> float | None:
        """Decode rate: the tokens after the first over the time they took
        (None for an answer of one token)."""
        decoding = self.seconds - self.first_token
        if self.tokens < 2 or decoding <= 0:
            return None
        return (self.tokens - 1) / decoding


class RecentRequests:
    """The figures of the last :data:`KEPT` requests (see the module docstring)."""

    def __init__(self, kept: int = KEPT) -> None:
        self._figures: collections.deque[RequestFigures] = collections.deque(maxlen=kept)

    def add(self, tokens: int, arrived: float, first_token: float | None,
            ended: float) -> None:
        """A request that ended at ``ended`` (monotonic seconds, as
        ``arrived`` and ``first_token``); one without a token is not kept."""
        if tokens < 1 or first_token is None:
            return
        self._figures.append(RequestFigures(tokens, first_token - arrived, ended - arrived))

    def summary(self) -> dict[str, Any]:
        """``requests`` kept, their ``tokens``, the median
        ``tokens_per_second`` (decode rate) and ``time_to_first_token``
        (seconds); the medians are None without requests."""
        figures = list(self._figures)
        rates = [r for f in figures if (r := f.tokens_per_second) is not None]
        return {"requests": len(figures), "tokens": sum(f.tokens for f in figures),
                "tokens_per_second": statistics.median(rates) if rates else None,
                "time_to_first_token": (statistics.median(f.first_token for f in figures)
                                        if figures else None)}
