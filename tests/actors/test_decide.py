"""The master's decision (pmetal.node.scheduler.Scheduler.decide) carries
out nothing once its master has lost the role or the term it began in.

The scheduler here is the real one; the node around it is a stand-in whose
election state the test changes while the decision waits on a member (its
lookup or its resources round), which is how a master is deposed mid-
decision in a real cluster (tests/cluster/test_two_nodes.py and the
seeded simulation in tests/cluster/test_actor_sim.py cover the rest).
Nothing here sleeps: every step waits on an event the test sets.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pmetal.cluster.view import MemberEntry, MemberState
from pmetal.node.scheduler import Scheduler
from pmetal.config import load_config
from pmetal.wire import (
    ActorLocation,
    CreateActor,
    Failure,
    LookupActor,
    Message,
    Resources,
    ResourcesRequest,
)

ME, OTHER, THIRD = "a" * 32, "b" * 32, "c" * 32


@dataclass
class _State:
    members: list[MemberEntry]


@dataclass
class _Cluster:
    term: int = 7
    master: str = ME
    dead_ids: set[str] = field(default_factory=set)
    members: list[str] = field(default_factory=lambda: [ME, OTHER, THIRD])

    def is_master(self) -> bool:
        return self.master == ME

    @property
    def state(self) -> _State:
        return _State([MemberEntry(n, state=MemberState.DEAD if n in self.dead_ids
                                   else MemberState.ALIVE) for n in self.members])

    def dead(self) -> set[str]:
        return set(self.dead_ids)


@dataclass
class _Member:
    node_id: str
    resources: dict[str, float] = field(default_factory=lambda: {"CPU": 4.0})


class _Membership:
    """Members that answer when the test lets them (``answering``), after
    ``release`` is set; the creations placed on them are recorded."""

    def __init__(self, answering: set[str]) -> None:
        self.members = {n: _Member(n) for n in (OTHER, THIRD)}
        self.answering = answering
        self.release = asyncio.Event()
        self.asked = asyncio.Event()
        self.created: list[tuple[str, CreateActor]] = []
        self.hosted: dict[str, ActorLocation] = {}

    def find(self, node_id: str) -> _Member | None:
        return self.members.get(node_id)

    def total_resources(self, own: dict[str, float]) -> dict[str, float]:
        return own

    async def find_actor(self, body: LookupActor) -> ActorLocation | None:
        self.asked.set()
        await self.release.wait()
        return self.hosted.get(body.actor_id)

    async def ask(self, member: _Member, body: Message) -> Message:
        if isinstance(body, ResourcesRequest):
            self.asked.set()
            await self.release.wait()
            if member.node_id not in self.answering:
                await asyncio.Event().wait()   # silent: the scheduler's timeout ends it
            return Resources(total={"CPU": 4.0}, available={"CPU": 4.0}, queued=0)
        assert isinstance(body, CreateActor)
        self.created.append((member.node_id, body))
        loc = ActorLocation(body.actor_id, "alive", "tcp://x:1", member.node_id)
        self.hosted[body.actor_id] = loc
        return loc


class _Actors:
    def __init__(self) -> None:
        self.actors: dict[str, Any] = {}
        self.available = {"CPU": 0.0}     # the master is full: members get the actors
        self.resources = {"CPU": 1.0}
        self.queue: list[Any] = []
        self.created: list[CreateActor] = []

    def alive(self) -> int:
        return 0

    async def create(self, spec: CreateActor) -> Message:
        self.created.append(spec)
        return ActorLocation(spec.actor_id, "alive", "tcp://x:1", ME)


class _Node:
    def __init__(self, answering: set[str]) -> None:
        self.node_id = ME
        self.resources = {"CPU": 1.0}
        self.config = load_config()
        self.cluster = _Cluster()
        self.membership = _Membership(answering)
        self.actors = _Actors()


def _spec(actor_id: str = "act-1") -> CreateActor:
    return CreateActor(actor_id, "cls", "builtins:dict", [], {},
                       {"owner_node": OTHER, "class_name": "dict", "num_cpus": 1.0})


async def _deposed_while_waiting(change: Any, answering: set[str]) -> tuple[Message, _Node]:
    node = _Node(answering)
    scheduler = Scheduler(node)   # type: ignore[arg-type]
    decision = asyncio.ensure_future(scheduler.decide(_spec(), origin=OTHER))
    await asyncio.wait_for(node.membership.asked.wait(), 5.0)
    change(node.cluster)
    node.membership.release.set()
    return await asyncio.wait_for(decision, 10.0), node


def test_a_master_that_steps_down_during_the_lookup_places_nothing() -> None:
    def step_down(c: _Cluster) -> None:
        c.master = ""
    reply, node = asyncio.run(_deposed_while_waiting(step_down, {OTHER, THIRD}))
    assert isinstance(reply, Failure) and reply.error_type == "NotMasterError", reply
    assert node.membership.created == [] and node.actors.created == []


def test_a_master_reelected_in_a_newer_term_places_nothing_of_the_old_one() -> None:
    def new_term(c: _Cluster) -> None:
        c.term += 1
    reply, node = asyncio.run(_deposed_while_waiting(new_term, {OTHER, THIRD}))
    assert isinstance(reply, Failure) and reply.error_type == "StaleTermError", reply
    assert "term 7" in reply.message and "term 8" in reply.message
    assert node.membership.created == [] and node.actors.created == []


def test_a_master_that_a_majority_does_not_answer_places_nothing() -> None:
    reply, node = asyncio.run(_deposed_while_waiting(lambda c: None, set()))
    assert isinstance(reply, Failure) and reply.error_type == "NotMasterError", reply
    assert "only 1 of its 3 members answered" in reply.message
    assert node.membership.created == [] and node.actors.created == []


def test_a_master_of_two_whose_peer_is_dead_places_alone() -> None:
    def two(c: _Cluster) -> None:
        c.members = [ME, OTHER]
        c.dead_ids = {OTHER}
    node = _Node(set())
    node.membership.members = {}   # the dead peer is no member any more
    two(node.cluster)
    node.actors.available = {"CPU": 1.0}
    node.membership.release.set()
    reply = asyncio.run(Scheduler(node).decide(_spec(), origin=OTHER))   # type: ignore[arg-type]
    assert isinstance(reply, ActorLocation) and reply.node_id == ME, reply
    assert [s.options["term"] for s in node.actors.created] == [7]


def test_two_decisions_for_one_actor_place_it_once() -> None:
    async def run() -> tuple[list[Message], _Node]:
        node = _Node({OTHER, THIRD})
        scheduler = Scheduler(node)   # type: ignore[arg-type]
        first = asyncio.ensure_future(scheduler.decide(_spec(), origin=OTHER))
        second = asyncio.ensure_future(scheduler.decide(_spec(), origin=OTHER))
        await asyncio.wait_for(node.membership.asked.wait(), 5.0)
        node.membership.release.set()
        return list(await asyncio.wait_for(asyncio.gather(first, second), 10.0)), node
    replies, node = asyncio.run(run())
    assert all(isinstance(r, ActorLocation) for r in replies), replies
    assert len(node.membership.created) == 1
    assert replies[0].node_id == replies[1].node_id   # type: ignore[union-attr]


def test_a_copy_that_a_fence_ended_is_placed_again() -> None:
    """A member answers the master's lookup with the copy a fence ended
    there ("moved"): that is no copy to keep, the actor is placed anew
    (the restart of an actor lost to a fence)."""
    async def run() -> tuple[Message, _Node]:
        node = _Node({OTHER, THIRD})
        node.membership.hosted["act-1"] = ActorLocation("act-1", "moved", "", THIRD)
        node.membership.release.set()
        scheduler = Scheduler(node)   # type: ignore[arg-type]
        return await asyncio.wait_for(scheduler.decide(_spec(), origin=OTHER), 10.0), node
    reply, node = asyncio.run(run())
    assert isinstance(reply, ActorLocation) and reply.state == "alive", reply
    assert len(node.membership.created) == 1
