"""The node's event log (pmetal.cluster.eventlog): bounded, typed, repeats
counted rather than stored, joins and leaves from member lists."""

from __future__ import annotations

import itertools

import pytest

from pmetal.cluster.eventlog import COALESCE, ClusterEvent, EventKind, EventLog


def clocked(**kw: int) -> EventLog:
    ticks = itertools.count(1000)
    return EventLog(clock=lambda: float(next(ticks)), **kw)


def test_events_are_typed_values_oldest_first_with_rising_seq() -> None:
    log = clocked()
    log.record(EventKind.ELECTION, "a" * 32, "master in term 7")
    log.record(EventKind.DEATH, "b" * 32, "silent for 0.81 s")
    events = log.events()
    assert [e.kind for e in events] == [EventKind.ELECTION, EventKind.DEATH]
    assert [e.seq for e in events] == [1, 2] and log.seq == 2
    assert all(isinstance(e, ClusterEvent) for e in events)
    assert events[1].to_dict() == {"seq": 2, "kind": "death", "at": 1001.0, "node": "b" * 32,
                                   "detail": "silent for 0.81 s", "count": 1}
    assert log.since(1) == (events[1],)


def test_the_log_keeps_the_newest_events_only() -> None:
    log = clocked(capacity=5)
    for i in range(12):
        log.record(EventKind.DEATH, f"node{i}", "silent")
    assert [e.node for e in log.events()] == [f"node{i}" for i in range(7, 12)]
    with pytest.raises(ValueError, match="at least one"):
        EventLog(capacity=0)


def test_a_repeat_is_counted_and_moves_to_the_end_instead_of_pushing_others_out() -> None:
    log = clocked(capacity=4)
    log.record(EventKind.JOIN, "a", "joined")
    for _ in range(50):   # a misconfigured static peer, refused at every heartbeat
        log.record(EventKind.REFUSAL, "", "10.0.0.9:52416: handshake refused")
        log.record(EventKind.REFUSAL, "", "10.0.0.8:52416: handshake refused")
    events = log.events()
    assert [e.kind for e in events] == [EventKind.JOIN, EventKind.REFUSAL, EventKind.REFUSAL]
    assert [e.count for e in events] == [1, 50, 50]
    assert events[-1].seq == log.seq == 101 and events[-1].at == 1100.0


def test_a_repeat_older_than_the_coalescing_window_is_a_new_event() -> None:
    log = clocked()
    log.record(EventKind.REFUSAL, "", "same")
    for i in range(COALESCE):
        log.record(EventKind.DEATH, f"n{i}", "silent")
    log.record(EventKind.REFUSAL, "", "same")
    assert [e.count for e in log.events() if e.kind is EventKind.REFUSAL] == [1, 1]


def test_member_lists_become_joins_and_leaves() -> None:
    log = clocked()
    log.members([{"node_id": "a"}, {"node_id": "b"}], epoch=1)
    log.members([{"node_id": "a"}, {"node_id": "b"}, {"node_id": "c"}], epoch=2)
    log.members([{"node_id": "a"}, {"node_id": "b", "state": "dead"},
                 {"node_id": "c"}], epoch=3)
    log.members([{"node_id": "a"}, {"node_id": "c"}], epoch=4)   # b removed: nothing new
    assert [(e.kind.value, e.node, e.detail) for e in log.events()] == [
        ("join", "a", "joined the member list (epoch 1)"),
        ("join", "b", "joined the member list (epoch 1)"),
        ("join", "c", "joined the member list (epoch 2)"),
        ("leave", "b", "left the member list (epoch 3)"),
    ]
