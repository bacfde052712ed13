"""The figures of recent requests that /stats shows: rates from the times
given, the oldest dropped past the limit, requests without a token skipped."""

from __future__ import annotations

from pmetal.serve.recent import RecentRequests, RequestFigures


def test_figures_of_one_request() -> None:
    figures = RequestFigures(tokens=11, first_token=0.5, seconds=2.5)
    assert figures.tokens_per_second == 5.0          # 10 tokens after the first in 2 s
    assert RequestFigures(tokens=1, first_token=0.5, seconds=0.5).tokens_per_second is None


def test_the_summary_keeps_the_last_requests_and_skips_empty_ones() -> None:
    recent = RecentRequests(kept=3)
    assert recent.summary() == {"requests": 0, "tokens": 0, "tokens_per_second": None,
                                "time_to_first_token": None}
    recent.add(0, arrived=0.0, first_token=None, ended=5.0)        # no token: not kept
    for i, rate in enumerate((1.0, 2.0, 4.0, 8.0)):               # 9 tokens in 1 + 8/rate s
        recent.add(9, arrived=10.0 * i, first_token=10.0 * i + 1.0,
                   ended=10.0 * i + 1.0 + 8 / rate)
    summary = recent.summary()
    assert summary["requests"] == 3 and summary["tokens"] == 27    # the first one dropped
    assert summary["tokens_per_second"] == 4.0 and summary["time_to_first_token"] == 1.0
