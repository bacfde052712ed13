"""The failure detector driven by a fake clock: every transition, the
thresholds exactly as configured, the Wi-Fi preset, round-trip degradation,
many peers, subscribers, and the property that status only worsens with
silence."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pmetal.cluster.health import (
    HealthEvent,
    HealthMonitor,
    HealthStatistics,
    HealthStatus,
)
from pmetal.config import HealthConfig
from pmetal.errors import PMetalValueError

H, G, S, D = (HealthStatus.HEALTHY, HealthStatus.DEGRADED, HealthStatus.SUSPECT,
              HealthStatus.DEAD)
LAN = HealthConfig()
WIFI = HealthConfig.wifi()


def monitor(config: HealthConfig = LAN, *peers: str, at: float = 0.0) -> HealthMonitor:
    m = HealthMonitor(config, at)
    for p in peers:
        m.watch(p, at)
    return m


def expected(config: HealthConfig, silence: float) -> HealthStatus:
    # A silence that is a threshold up to float rounding (2.3 - 2.0 < 0.3) crosses it.
    silence += 1e-9
    if silence >= config.dead_after:
        return D
    if silence >= config.suspect_after:
        return S
    return G if silence >= config.degraded_after else H


# Each threshold, a hair before it and exactly on it, for both presets.
THRESHOLDS = [
    (cfg, name, silence, status)
    for name, cfg in (("lan", LAN), ("wifi", WIFI))
    for silence, status in (
        (0.0, H),
        (cfg.interval, H),
        (cfg.degraded_after - 1e-6, H), (cfg.degraded_after, G),
        (cfg.suspect_after - 1e-6, G), (cfg.suspect_after, S),
        (cfg.dead_after - 1e-6, S), (cfg.dead_after, D),
        (cfg.remove_after, D), (1e6, D),
    )
]


@pytest.mark.parametrize(("config", "preset", "silence", "status"), THRESHOLDS,
                         ids=[f"{p}-{s}" for _, p, s, _ in THRESHOLDS])
def test_status_follows_the_configured_thresholds_exactly(
        config: HealthConfig, preset: str, silence: float, status: HealthStatus) -> None:
    m = monitor(config, "a")
    m.tick(silence)
    assert m.status("a") is status


@pytest.mark.parametrize("start", [0.0, 12345.678, 1e6 + 0.1])
def test_dead_exactly_dead_after_the_last_message_on_a_large_clock(start: float) -> None:
    m = monitor(LAN, "a", at=start)
    m.heard("a", start + 0.05)
    m.tick(start + 0.05 + LAN.dead_after)
    assert m.status("a") is D


def test_the_wifi_preset_is_more_patient_than_the_lan_default() -> None:
    assert WIFI.interval == 0.5 and WIFI.dead_after == 5.0
    lan, wifi = monitor(LAN, "a"), monitor(WIFI, "a")
    for m in (lan, wifi):
        m.tick(1.0)
    assert lan.status("a") is D and wifi.status("a") is H
    wifi.tick(4.9)
    assert wifi.status("a") is S
    wifi.tick(5.0)
    assert wifi.status("a") is D


# (times of ticks, with the peer last heard at 0) -> the events they give
SEQUENCES = [
    ([0.1, 0.3, 0.5, 0.8], [(0.3, H, G), (0.5, G, S), (0.8, S, D)]),
    ([0.1, 0.2, 0.29], []),
    ([0.9], [(0.9, H, D)]),                        # a late tick skips states
    ([0.4, 2.0], [(0.4, H, G), (2.0, G, D)]),
    ([0.5, 0.6, 0.7], [(0.5, H, S)]),
]


@pytest.mark.parametrize(("ticks", "events"), SEQUENCES)
def test_ticks_give_one_event_per_change(
        ticks: list[float], events: list[tuple[float, HealthStatus, HealthStatus]]) -> None:
    m = monitor(LAN, "a")
    got = [e for t in ticks for e in m.tick(t)]
    assert [(e.at, e.previous, e.status) for e in got] == events
    assert all(e.node_id == "a" and e.silent_for == pytest.approx(e.at) for e in got)


@pytest.mark.parametrize("status_before", [G, S, D])
def test_a_peer_heard_again_is_healthy_with_an_event(status_before: HealthStatus) -> None:
    m = monitor(LAN, "a")
    silence = {G: 0.35, S: 0.6, D: 3.0}[status_before]
    m.tick(silence)
    assert m.status("a") is status_before
    events = m.heard("a", silence + 0.01)
    assert events == [HealthEvent("a", status_before, H, silence + 0.01,
                                  pytest.approx(silence + 0.01))]
    assert m.status("a") is H
    assert m.tick(silence + 0.02) == []


def test_hearing_resets_the_silence() -> None:
    m = monitor(LAN, "a")
    for t in (0.25, 0.5, 0.75, 1.0, 1.25):
        m.heard("a", t)
        assert m.tick(t + 0.29) == []
    assert m.status("a") is H
    assert [e.status for e in m.tick(1.25 + 0.8)] == [D]


def test_an_old_message_does_not_move_the_last_heard_time_back() -> None:
    m = monitor(LAN, "a")
    m.heard("a", 1.0)
    m.heard("a", 0.5)    # delivered late, carrying an older time
    m.tick(1.79)
    assert m.status("a") is S


def test_rtt_far_above_the_baseline_degrades_a_peer_that_is_heard() -> None:
    m = monitor(LAN, "a")
    t = 0.0
    for _ in range(20):
        t += 0.1
        assert m.heard("a", t, rtt=0.002) == []
    events = []
    for _ in range(20):
        t += 0.1
        events += m.heard("a", t, rtt=0.200)
    assert [(e.previous, e.status) for e in events] == [(H, G)]
    assert m.status("a") is G
    m.tick(t + 0.05)
    assert m.status("a") is G     # heard recently, still slow
    recovered = []
    for _ in range(20):
        t += 0.1
        recovered += m.heard("a", t, rtt=0.002)
    assert [(e.previous, e.status) for e in recovered] == [(G, H)]
    # Silence still wins over speed.
    assert [e.status for e in m.tick(t + LAN.dead_after)] == [D]


@pytest.mark.parametrize(("baseline", "slow", "status"), [
    (0.002, 0.200, G),     # 100x and above 50 ms
    (0.002, 0.040, H),     # 20x but below 50 ms: a LAN hiccup
    (0.030, 0.100, H),     # above 50 ms but only 3.3x: a slow but steady link
    (0.030, 0.130, G),     # 4.3x and above 50 ms
])
def test_rtt_degradation_needs_both_the_factor_and_the_floor(
        baseline: float, slow: float, status: HealthStatus) -> None:
    m = monitor(LAN, "a")
    t = 0.0
    for rtt in [baseline] * 5 + [slow] * 20:
        t += 0.1
        m.heard("a", t, rtt=rtt)
    assert m.status("a") is status


def test_a_few_slow_round_trips_do_not_degrade() -> None:
    m = monitor(LAN, "a")
    for i, rtt in enumerate([0.001] * 15 + [0.5] * 5):
        m.heard("a", 0.1 * (i + 1), rtt=rtt)
    assert m.status("a") is H     # the median of the window is still fast


def test_many_peers_only_the_silent_ones_die() -> None:
    peers = [f"n{i:03d}" for i in range(200)]
    m = monitor(LAN, *peers)
    silent = set(peers[::7])
    t = 0.0
    events: list[HealthEvent] = []
    while t < 1.0:
        t = round(t + 0.1, 10)
        for p in peers:
            if p not in silent:
                events += m.heard(p, t)
        events += m.tick(t)
    assert m.dead() == silent
    assert {e.node_id for e in events} == silent
    assert [e.status for e in events if e.node_id == peers[0]] == [G, S, D]
    stats = m.statistics()
    assert (stats.watched, stats.dead, stats.healthy, stats.deaths) == (
        200, len(silent), 200 - len(silent), len(silent))


def test_forget_and_unknown_peers() -> None:
    m = monitor(LAN, "a", "b")
    m.forget("a")
    assert m.watched() == ["b"]
    assert m.tick(5.0) == [HealthEvent("b", H, D, 5.0, 5.0)]
    assert m.heard("a", 5.1) == []          # a stray message does not bring it back
    with pytest.raises(PMetalValueError, match="does not watch node 'a'"):
        m.status("a")
    m.forget("never-watched")               # harmless


def test_watching_again_does_not_hide_a_silence() -> None:
    m = monitor(LAN, "a")
    m.watch("a", 0.7)
    m.tick(0.8)
    assert m.status("a") is D
    m.forget("a")
    m.watch("a", 0.9)                       # a new incarnation starts afresh
    assert m.status("a") is H and m.tick(1.0) == []


def test_subscribers_get_every_event_and_their_errors_stay_theirs(
        caplog: pytest.LogCaptureFixture) -> None:
    m = monitor(LAN, "a", "b")
    seen: list[HealthEvent] = []
    later: list[HealthEvent] = []

    def broken(event: HealthEvent) -> None:
        raise RuntimeError("subscriber bug")

    m.subscribe(broken)
    unsubscribe = m.subscribe(seen.append)
    m.subscribe(later.append)
    with caplog.at_level(logging.ERROR, logger="pmetal.cluster.health"):
        returned = m.tick(0.8)
    assert [(e.node_id, e.status) for e in returned] == [("a", D), ("b", D)]
    assert seen == returned and later == returned
    assert "subscriber bug" in caplog.text
    unsubscribe()
    unsubscribe()                           # twice is harmless
    back = m.heard("a", 1.0)
    assert seen == returned and later == returned + back
    assert m.statistics().subscriber_errors == 3


def test_summary_and_statistics() -> None:
    m = monitor(LAN, "a", "b")
    for i, rtt in enumerate([0.004, 0.001, 0.002, 0.003, 0.010], start=1):
        m.heard("a", 0.1 * i, rtt=rtt)
    m.heard("a", 0.8)                       # two beats missed (0.6, 0.7)
    m.tick(1.0)
    a, b = m.summary()
    assert (a.node_id, a.status, a.beats, a.missed) == ("a", H, 6, 3)   # + 0.9
    assert a.silent_for == pytest.approx(0.2)
    assert (a.rtt, a.rtt_p90) == (0.003, 0.010)
    assert (b.node_id, b.status, b.rtt, b.beats, b.since) == ("b", D, None, 0, 1.0)
    assert b.missed == 9
    assert m.summary(now=0.0)[0].silent_for == 0.0
    assert json.loads(json.dumps(b.to_dict())) == {
        "node_id": "b", "status": "dead", "silent_for": 1.0, "rtt": None, "rtt_p90": None,
        "beats": 0, "missed": 9, "since": 1.0}
    assert m.statistics() == HealthStatistics(
        watched=2, healthy=1, degraded=0, suspect=0, dead=1, heard=6, events=1, deaths=1,
        returns=0, subscriber_errors=0)
    m.heard("b", 1.1)
    assert m.statistics().returns == 1


def test_removable_after_remove_after_of_silence() -> None:
    m = monitor(LAN, "a", "b")
    m.heard("b", 5.0)
    m.tick(10.0)
    assert m.removable() == ["a"]
    assert m.removable(now=15.0) == ["a", "b"]


def test_severity_orders_the_statuses() -> None:
    assert [s.severity for s in (H, G, S, D)] == [0, 1, 2, 3]


configs = st.tuples(
    st.floats(0.01, 2.0), st.floats(0.0, 3.0), st.floats(0.0, 3.0), st.floats(0.0, 3.0),
).map(lambda t: HealthConfig(interval=t[0], degraded_after=t[0] * 1.01 + t[1],
                             suspect_after=t[0] * 1.01 + t[1] + t[2],
                             dead_after=t[0] * 1.01 + t[1] + t[2] + t[3],
                             remove_after=100.0))


@settings(max_examples=300, deadline=None)
@given(configs, st.lists(st.floats(0.0, 20.0), min_size=2, max_size=10),
       st.lists(st.floats(0.0, 0.5), max_size=25))
def test_status_is_a_monotone_function_of_silence(
        config: HealthConfig, silences: list[float], rtts: list[float]) -> None:
    statuses = []
    for silence in sorted(silences):
        m = HealthMonitor(config, 0.0)
        m.watch("a", 0.0)
        for rtt in rtts:   # the same history of round trips for every silence
            m.heard("a", 0.0, rtt=rtt)
        m.tick(silence)
        statuses.append(m.status("a"))
        if silence >= config.degraded_after:
            assert statuses[-1] is expected(config, silence)
        assert (statuses[-1] is D) == (expected(config, silence) is D)
    assert [s.severity for s in statuses] == sorted(s.severity for s in statuses)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["heard", "tick"]), st.sampled_from("abc"),
                          st.floats(0.0, 2.0)), max_size=40))
def test_status_always_matches_the_silence_since_the_last_message(
        steps: list[tuple[str, str, float]]) -> None:
    """A model check: after any sequence of inputs, every peer's status is
    exactly what its silence says, and the events replay to that status."""
    m = monitor(LAN, *"abc")
    last = dict.fromkeys("abc", 0.0)
    status = dict.fromkeys("abc", H)
    now = 0.0
    for op, peer, dt in steps:
        now += dt
        events = m.heard(peer, now) if op == "heard" else m.tick(now)
        if op == "heard":
            last[peer] = now
        for e in events:
            assert e.previous is status[e.node_id] and e.status is not e.previous
            status[e.node_id] = e.status
        judged = [peer] if op == "heard" else list("abc")
        for p in judged:
            assert m.status(p) is status[p] is expected(LAN, now - last[p])
