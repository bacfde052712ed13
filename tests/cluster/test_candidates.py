"""The candidate table (pmetal.cluster.candidates) on a clock the test turns:
caps, backoff, giving up, rest, withdrawal; and the log rate limit."""

from __future__ import annotations

import logging
import random

import pytest

from pmetal.cluster.candidates import Candidates, LogLimiter
from pmetal.config import ConfigError, DiscoveryConfig, load_config

CFG = DiscoveryConfig(max_candidates=4, backoff=1.0, backoff_max=8.0, give_up=30.0)
A, B = "tcp://10.0.0.1:7420", "tcp://10.0.0.2:7420"


def table(cfg: DiscoveryConfig = CFG) -> Candidates:
    return Candidates(cfg, random.Random(7))


def dial_and_fail(t: Candidates, address: str, now: float) -> bool:
    assert t.due(now, 10) == [address]
    return t.failed(address, now)


def test_one_address_is_one_candidate_however_many_records_name_it() -> None:
    t = table()
    for k in range(500):
        assert t.hint(A, f"id{k}", 0.0)
    assert len(t) == 1 and t.due(0.0, 10) == [A]
    assert t.due(0.0, 10) == []   # being dialled: not twice at once


def test_the_table_is_capped_and_what_is_left_out_is_counted() -> None:
    t = table()
    for k in range(10):
        t.hint(f"tcp://10.0.1.{k}:1", "x", 0.0)
    assert len(t) == CFG.max_candidates
    assert t.statistics().left_out == 10 - CFG.max_candidates
    assert len(t.due(0.0, 2)) == 2   # at most the room asked for


def test_failures_back_off_exponentially_with_jitter_then_give_up() -> None:
    t = table()
    t.hint(A, "x", 0.0)
    now, delays = 0.0, []
    while True:
        if dial_and_fail(t, A, now):
            break
        cand = t.get(A)
        assert cand is not None
        delays.append(cand.next_try - now)
        assert t.due(cand.next_try - 1e-6, 10) == []   # not before its time
        now = cand.next_try
    caps = [min(CFG.backoff_max, CFG.backoff * 2 ** k) for k in range(len(delays))]
    assert all(cap / 2 <= d <= cap for d, cap in zip(delays, caps)), (delays, caps)
    assert now >= CFG.give_up and A not in t
    # 30 s of trying costs a handful of dials, not one per beat (0.1 s).
    assert t.statistics().dials == len(delays) + 1 <= 10
    assert t.statistics().given_up == 1


def test_a_given_up_address_rests_while_records_name_it() -> None:
    t = table()
    t.hint(A, "x", 0.0)
    now = 0.0
    while not dial_and_fail(t, A, now):
        now = t.get(A).next_try   # type: ignore[union-attr]
    # The record stays current (hinted every second): never dialled again.
    for k in range(1, 200):
        assert not t.hint(A, "x", now + k)
        assert t.due(now + k, 10) == []
    # No record for give_up seconds: a new one starts afresh.
    later = now + 199 + CFG.give_up
    assert t.hint(A, "x", later) and t.due(later, 10) == [A]


def test_withdrawal_ends_a_candidate_but_not_its_backoff() -> None:
    t = table()
    t.hint(A, "x", 0.0)
    t.hint(A, "y", 0.0)
    dial_and_fail(t, A, 0.0)
    next_try = t.get(A).next_try   # type: ignore[union-attr]
    assert not t.withdraw(A, "x")          # "y" still names it
    assert t.withdraw(A, "y") and A not in t
    assert t.statistics().withdrawn == 1
    # Announced again at once: the backoff goes on where it was.
    t.hint(A, "x", 0.1)
    assert t.due(0.1, 10) == [] and t.due(next_try, 10) == [A]


def test_proven_ends_the_candidate_with_its_claims() -> None:
    t = table()
    t.hint(A, "x", 0.0, {"incarnation": 3})
    t.hint(B, "y", 0.0)
    assert t.due(0.0, 10) == [A, B] or set(t.due(0.0, 10)) <= {A, B}
    assert t.proven(A) == {"x": {"incarnation": 3}}
    assert A not in t and B in t


def test_discovery_settings_are_validated() -> None:
    assert load_config({"PMETAL_DISCOVERY_GIVE_UP": "5"}).discovery.give_up == 5.0
    with pytest.raises(ConfigError, match="discovery.backoff_max"):
        DiscoveryConfig(backoff=10.0, backoff_max=1.0)
    with pytest.raises(ConfigError, match="discovery.max_candidates"):
        DiscoveryConfig(max_candidates=0)


def test_log_limiter_per_source_and_in_all(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("pmetal.test.limiter")
    caplog.set_level(logging.INFO, logger=logger.name)
    limit = LogLimiter(logger, per_source=2, total=5, period=60.0)
    for k in range(100):
        limit.log(0.0 + k * 0.01, "10.0.0.9", logging.WARNING, "record %d", k)
    assert [r.getMessage() for r in caplog.records] == ["record 0", "record 1"]
    for k in range(100):
        limit.log(1.0, f"10.0.1.{k}", logging.WARNING, "from %d", k)
    # 2 + 3 more sources, then the total holds; the first line let through
    # after lines were held back says how many.
    assert [r.getMessage() for r in caplog.records[2:]] == [
        "from 0 (98 similar lines held back)", "from 1", "from 2"]
    caplog.clear()
    limit.log(61.0, "10.0.0.9", logging.WARNING, "again")   # a new period
    assert caplog.records[0].getMessage() == "again (97 similar lines held back)"
