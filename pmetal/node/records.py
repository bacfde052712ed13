"""A node's actors: one record per actor it hosts, its names, and how long
dead ones are remembered.

A record is what the node knows of an actor: its spec, state (pending,
alive, restarting, dead), the worker hosting it, its incarnation, its owner
(the node and pid of the process that created it) and the resources it holds.
Dead records are kept for the last :data:`DEAD_TAIL` actors (``pmetal
status`` shows them, and a handle asking about one learns why it died);
older ones are forgotten, with their names.
"""

from __future__ import annotations

import asyncio
import signal
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pmetal.node.placement import needs
from pmetal.node.zygote import UNKNOWN_EXIT
from pmetal.values import ActorState
from pmetal.wire import ActorLocation, CreateActor

__all__ = ["DEAD_TAIL", "ActorRecord", "ActorTable", "exit_text"]

DEAD_TAIL = 200
"""Dead actors whose records a node keeps (for ``pmetal status`` and for
handles that ask about them); older ones are forgotten."""


@dataclass
class ActorRecord:
    spec: CreateActor
    state: ActorState = ActorState.PENDING   # never MOVED (a lookup's answer only)
    worker_id: str = ""
    incarnation: int = 0
    restarts_left: int = 0
    reason: str = ""
    no_restart: bool = False
    owner: tuple[str, int] = ("", 0)   # (node id, pid) of the process that created it
    owner_client: str = ""         # the creator's client session (pid 0: it holds a lease)
    held: dict[str, float] = field(default_factory=dict)   # resources reserved for it
    pool: Any = None               # the PlacementQueue it holds them from (None: the node's)
    constructing: bool = False     # its constructor runs: _construct owns a worker exit
    moved: bool = False            # ended by a fence; its owner's node restarts it elsewhere
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)   # killed while queued
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def detached(self) -> bool:
        return self.spec.options.get("lifetime") == "detached"

    def location(self, node_id: str, address: str) -> ActorLocation:
        o = self.spec.options
        # A copy a fence ended is "moved" to those who look it up: the actor
        # lives on where its owner's node restarts it (a caller waits for
        # that, up to actors.restart_wait); it did not die.
        state = ActorState.MOVED if self.moved and self.state == ActorState.DEAD else self.state
        return ActorLocation(self.spec.actor_id, state, address, node_id, self.incarnation,
                             o.get("name") or "", self.reason, o.get("class_name") or "",
                             tuple(o.get("methods") or ()), bool(o.get("is_async")),
                             int(o.get("max_task_retries") or 0))

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class ActorTable:
    """Records by actor id and names by name, with the dead tail pruned."""

    def __init__(self) -> None:
        self.actors: dict[str, ActorRecord] = {}
        self.names: dict[str, str] = {}
        self._dead: deque[str] = deque()   # ids of dead actors, oldest first

    def mark_dead(self, record: ActorRecord, reason: str) -> None:
        if record.state != ActorState.DEAD:
            self._dead.append(record.spec.actor_id)
        record.state, record.reason = ActorState.DEAD, reason
        record.notify()
        while len(self._dead) > DEAD_TAIL:
            gone = self.actors.pop(self._dead.popleft(), None)
            name = gone.spec.options.get("name") if gone is not None else ""
            if gone is not None and name and self.names.get(name) == gone.spec.actor_id:
                del self.names[name]

    def describe(self, node_id: str) -> list[dict[str, Any]]:
        return [{"actor_id": a.spec.actor_id, "name": a.spec.options.get("name") or "",
                 "class_name": a.spec.options.get("class_name") or "",
                 "state": a.state, "incarnation": a.incarnation, "reason": a.reason,
                 "node_id": node_id, "owner": _owner_text(a),
                 "lifetime": a.spec.options.get("lifetime") or "non_detached",
                 "resources": needs(a.spec.options)}
                for a in self.actors.values()]


def _owner_text(record: ActorRecord) -> str:
    node, pid = record.owner
    if pid:
        return f"pid {pid} on {node[:8]}"
    if record.owner_client:   # a client on another machine, holding a lease
        return f"client {record.owner_client[:8]} via {node[:8]}"
    return f"node {node[:8]}" if node else "-"



def exit_text(code: int | None) -> str:
    if code is None or code == UNKNOWN_EXIT:
        return "exited (its exit code is unknown: the fork server that started it had died)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
