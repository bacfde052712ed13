"""A node's actor table: dead actors are remembered for a bounded tail only."""

from __future__ import annotations

from pmetal.node.records import DEAD_TAIL, ActorRecord, ActorTable, exit_text
from pmetal.wire import CreateActor


def _record(i: int, name: str = "") -> ActorRecord:
    return ActorRecord(CreateActor(f"actor-{i}", "cls", "mod:Cls", [], {}, {"name": name}))


def test_dead_records_are_pruned_beyond_the_tail_with_their_names() -> None:
    table = ActorTable()
    alive = _record(-1, "keeper")
    table.actors[alive.spec.actor_id] = alive
    table.names["keeper"] = alive.spec.actor_id
    for i in range(DEAD_TAIL + 5):
        record = _record(i, f"n{i}")
        table.actors[record.spec.actor_id] = record
        table.names[f"n{i}"] = record.spec.actor_id
        table.mark_dead(record, "gone")
        table.mark_dead(record, "gone again")   # marking twice counts once
    assert len(table.actors) == DEAD_TAIL + 1
    assert "actor-0" not in table.actors and "n0" not in table.names
    assert f"actor-{DEAD_TAIL + 4}" in table.actors
    assert table.actors["actor--1"].state == "pending" and table.names["keeper"] == "actor--1"


def test_exit_text_names_codes_and_signals() -> None:
    assert exit_text(7) == "exited with code 7"
    assert exit_text(-9) == "was killed by SIGKILL"
