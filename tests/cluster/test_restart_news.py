"""The scheduler's restart of an actor whose node died, when the news of
that death comes in two parts: the master's list holds the node dead first
(the restart is sent, and fails: the actor's placement group still named the
dead node), then this node's own detector declares it dead while that
restart is still being placed. The detector's verdict found nothing to
restart (the actor was in the restart's hands); the failed restart must
decide again, or nobody restarts the actor until the next list change (seen
in CI: "no actor ... in this cluster" for the actor of a lost bundle).

The Scheduler runs for real; what stands in is the node around it (its
cluster view, its task group) and the placement itself, whose answers the
test orders."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from pmetal.cluster.events import ElectionState, Role
from pmetal.cluster.view import MemberEntry, MemberState
from pmetal.config import load_config
from pmetal.node.scheduler import Scheduler, _Placed
from pmetal.values import ActorState, FailureKind
from pmetal.wire import ActorLocation, CreateActor, Failure

ME, DOOMED, OTHER = "a" * 32, "b" * 32, "c" * 32
ACTOR = "actor-1"


class _Node:
    """What the Scheduler reads of its node: the view, the detector's dead
    set, the config and a task group."""

    def __init__(self) -> None:
        self.node_id = ME
        self.config = load_config(env={})
        self.tasks: list[asyncio.Task[Any]] = []
        self.cluster = SimpleNamespace(state=_state(ALIVE=True), dead=lambda: self.dead)
        self.dead: set[str] = set()

    def _cancellable_task(self, coro: Any) -> None:
        self.tasks.append(asyncio.ensure_future(coro))


def _state(ALIVE: bool) -> ElectionState:
    doomed = MemberState.ALIVE if ALIVE else MemberState.DEAD
    members = (MemberEntry(ME), MemberEntry(DOOMED, state=doomed), MemberEntry(OTHER))
    return ElectionState(term=2, role=Role.FOLLOWER, master=OTHER, epoch=3, members=members,
                         voted_for="")


async def _settled(node: Any, timeout: float = 5.0) -> None:
    """Until every task the scheduler started (and those they started)
    ended; AssertionError if they still start new ones after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while pending := [t for t in node.tasks if not t.done()]:
        left = deadline - asyncio.get_running_loop().time()
        assert left > 0, f"restarts still being started after {timeout} s ({len(node.tasks)})"
        await asyncio.wait_for(asyncio.gather(*pending), left)


def test_a_restart_that_failed_while_the_detector_spoke_decides_again() -> None:
    async def scenario() -> list[CreateActor]:
        node: Any = _Node()
        scheduler = Scheduler(node)
        spec = CreateActor(ACTOR, "Where", "m:Where", [], {}, {"max_restarts": -1})
        scheduler.elsewhere[ACTOR] = _Placed(spec, DOOMED, 0, -1)
        placed: list[CreateActor] = []
        first_sent, release_first = asyncio.Event(), asyncio.Event()

        async def place(s: CreateActor) -> Any:
            placed.append(s)
            if len(placed) == 1:
                first_sent.set()
                await release_first.wait()
                return Failure(FailureKind.PLACEMENT, "PlacementError",
                               f"node affinity: node {DOOMED} is dead")
            return ActorLocation(ACTOR, ActorState.ALIVE, node_id=OTHER, incarnation=1)
        scheduler.place = place   # type: ignore[method-assign]

        # 1. The master's list holds the node dead: the restart is sent.
        node.cluster.state = _state(ALIVE=False)
        scheduler.view_changed(node.cluster.state)
        await asyncio.wait_for(first_sent.wait(), 5)
        # 2. Our detector agrees while that restart is in flight.
        node.dead.add(DOOMED)
        scheduler.node_dead(DOOMED)
        # 3. The first restart fails (its bundle still named the dead node).
        release_first.set()
        await _settled(node)
        return placed

    placed = asyncio.run(scenario())
    assert len(placed) == 2, "the failed restart was not decided again"
    assert [s.options["incarnation"] for s in placed] == [1, 1]


def test_a_restart_that_failed_with_no_news_waits_for_the_next_change() -> None:
    """Without news while it was placed, a failed restart is kept for the
    next list change (a minority side's copy may live on), not retried."""
    async def scenario() -> tuple[int, bool]:
        node: Any = _Node()
        scheduler = Scheduler(node)
        spec = CreateActor(ACTOR, "Where", "m:Where", [], {}, {"max_restarts": -1})
        scheduler.elsewhere[ACTOR] = _Placed(spec, DOOMED, 0, -1)
        placed: list[CreateActor] = []

        async def place(s: CreateActor) -> Any:
            placed.append(s)
            return Failure(FailureKind.PLACEMENT, "PlacementError", "no master was elected")
        scheduler.place = place   # type: ignore[method-assign]
        node.cluster.state = _state(ALIVE=False)
        scheduler.view_changed(node.cluster.state)
        await _settled(node)
        return len(placed), ACTOR in scheduler.elsewhere

    assert asyncio.run(scenario()) == (1, True)


def test_two_restarts_that_fail_after_news_do_not_set_each_other_off() -> None:
    """Deciding again is not news: two restarts that failed after the
    detector spoke are tried again, and do not set each other off for ever
    (each failure counted as news restarted the other, in flight, again)."""
    async def scenario() -> list[CreateActor]:
        node: Any = _Node()
        scheduler = Scheduler(node)
        for actor in ("actor-a", "actor-b"):
            spec = CreateActor(actor, "Where", "m:Where", [], {}, {"max_restarts": -1})
            scheduler.elsewhere[actor] = _Placed(spec, DOOMED, 0, -1)
        placed: list[CreateActor] = []
        sent = [asyncio.Event() for _ in range(3)]            # the first three placements
        released = {"actor-a": asyncio.Event(), "actor-b": asyncio.Event()}

        async def place(s: CreateActor) -> Any:
            placed.append(s)
            if len(placed) <= 3:
                sent[len(placed) - 1].set()
            if len(placed) <= 2:
                await released[s.actor_id].wait()
            for _ in range(3):   # a placement takes a few turns of the loop (the master)
                await asyncio.sleep(0)
            return Failure(FailureKind.PLACEMENT, "PlacementError",
                           f"node affinity: node {DOOMED} is dead")
        scheduler.place = place   # type: ignore[method-assign]
        node.cluster.state = _state(ALIVE=False)
        scheduler.view_changed(node.cluster.state)
        await asyncio.wait_for(sent[1].wait(), 5)
        node.dead.add(DOOMED)
        scheduler.node_dead(DOOMED)
        # One fails and is placed again; the other fails while that runs.
        released["actor-a"].set()
        await asyncio.wait_for(sent[2].wait(), 5)
        released["actor-b"].set()
        await _settled(node)
        return placed

    placed = [s.actor_id for s in asyncio.run(scenario())]
    assert placed.count("actor-a") >= 2 and placed.count("actor-b") >= 2, placed
    assert len(placed) <= 6, placed
