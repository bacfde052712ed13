"""The group's node against three hosts in one event loop (in-memory
requests between real PlacementGroupService objects): an attempt that one
host refuses is rolled back on every host, the group waits and is created
once that host has room again, and a group removed while it is being
placed leaves nothing held."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from pmetal.node.groups import PlacementGroupService
from pmetal.node.placement import PlacementQueue
from pmetal.wire import (CreatePlacementGroup, Failure, Message, PlacementGroupQuery,
                         ReserveBundles, Resources, ResourcesRequest)

IDS = ["a" * 32, "b" * 32, "c" * 32]
OWNER = {"owner_node": IDS[0], "owner_pid": 0, "owner_client": "driver"}


class Net:
    """Three nodes; ``ask`` runs the request on the target's service.
    ``before_reserve(node)`` runs just before a host takes a reserve (to
    take its resources away in between, as a concurrent creation would)."""

    def __init__(self, cpus: float = 2.0) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.before_reserve: Callable[[str], None] = lambda node: None
        self.nodes: dict[str, PlacementGroupService] = {}
        for node_id in IDS:
            available = {"CPU": cpus}
            actors = SimpleNamespace(available=available, resources={"CPU": cpus},
                                     queue=PlacementQueue(available), actors={},
                                     kill_record=lambda *a: None)
            members = SimpleNamespace(members={}, ask=self.ask, find=self.find)
            self.nodes[node_id] = PlacementGroupService(node_id, actors, members, self.spawn)
        for node_id, service in self.nodes.items():
            service.membership.members.update(
                {n: SimpleNamespace(node_id=n) for n in IDS if n != node_id})

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def find(self, prefix: str) -> Any:
        return next((SimpleNamespace(node_id=n) for n in IDS if n.startswith(prefix)), None)

    async def ask(self, member: Any, body: Message) -> Message:
        await asyncio.sleep(0)   # a message takes a turn of the loop
        target = self.nodes[member.node_id]
        if isinstance(body, ResourcesRequest):
            return Resources(target.actors.resources, dict(target.actors.available))
        if isinstance(body, ReserveBundles):
            if not body.release:
                self.before_reserve(member.node_id)
            return target.reserve(body)
        assert isinstance(body, PlacementGroupQuery)
        return await target.query(body)

    def free(self) -> list[float]:
        return [s.actors.available["CPU"] for s in self.nodes.values()]

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def create(net: Net, strategy: str, count: int, group: str = "1") -> Any:
    owner = net.nodes[IDS[0]]
    return owner.create(CreatePlacementGroup(IDS[0][:16] + group * 20, "", [{"CPU": 1.0}] * count,
                                             strategy, {}), OWNER)


async def until(cond: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(5):   # the retry loop runs every 50 ms to 1 s
        while not cond():
            await asyncio.sleep(0.01)


def test_a_refused_share_rolls_the_attempt_back_everywhere() -> None:
    async def run() -> None:
        net = Net()
        busy = {"on": True}

        def take_b(node: str) -> None:   # b's CPUs go between the plan and the reserve
            if node == IDS[1] and busy["on"]:
                net.nodes[IDS[1]].actors.queue.take({"CPU": 2.0})
                busy["on"] = False
        net.before_reserve = take_b
        try:
            reply = await create(net, "STRICT_SPREAD", 3)
            entry = reply.groups[0]
            assert entry["state"] == "PENDING" and "refused" in entry["reason"], entry
            assert net.free() == [2.0, 0.0, 2.0]   # a and c gave their bundles back
            owner = net.nodes[IDS[0]]
            assert owner.statistics().rolled_back == 1
            net.nodes[IDS[1]].actors.queue.give({"CPU": 2.0})
            record = owner.groups[entry["group_id"]]
            await until(lambda: record.state == "CREATED", "created once b has room")
            assert sorted(record.bundle_nodes) == IDS and net.free() == [1.0, 1.0, 1.0]
        finally:
            await net.close()
    asyncio.run(run())


def test_a_group_removed_while_it_is_placed_holds_nothing() -> None:
    async def run() -> None:
        net = Net()
        owner = net.nodes[IDS[0]]
        removed: list[Any] = []

        def remove_now(node: str) -> None:   # removed while the reserves are on their way
            if not removed:
                removed.append(net.spawn(owner.query(PlacementGroupQuery(
                    IDS[0][:16] + "2" * 20, remove=True))))
        net.before_reserve = remove_now
        try:
            reply = await create(net, "SPREAD", 3, group="2")
            assert reply.groups[0]["state"] == "REMOVED", reply
            await until(lambda: not net.tasks, "the removal done")
            assert net.free() == [2.0, 2.0, 2.0], net.free()
            late = net.nodes[IDS[1]].reserve(ReserveBundles(IDS[0][:16] + "2" * 20, 1,
                                                            [[0, {"CPU": 1.0}]]))
            assert isinstance(late, Failure) and "released already" in late.message
        finally:
            await net.close()
    asyncio.run(run())


def test_a_dead_host_s_bundles_go_elsewhere_and_strict_spread_waits() -> None:
    async def run() -> None:
        net = Net(cpus=3.0)
        owner = net.nodes[IDS[0]]
        try:
            spread = (await create(net, "SPREAD", 3, group="3")).groups[0]["group_id"]
            strict = (await create(net, "STRICT_SPREAD", 3, group="4")).groups[0]["group_id"]
            del owner.membership.members[IDS[2]]   # c dies
            owner.node_dead(IDS[2])
            moved, stuck = owner.groups[spread], owner.groups[strict]
            await until(lambda: moved.state == "CREATED", "the SPREAD group placed again")
            assert IDS[2] not in moved.bundle_nodes and moved.bundle_nodes[:2] == IDS[:2]
            assert stuck.state == "RESCHEDULING" and stuck.bundle_nodes[2] == ""
            assert "STRICT_SPREAD needs 3 nodes" in stuck.reason, stuck.reason
        finally:
            await net.close()
    asyncio.run(run())


def test_any_node_answers_about_a_group_and_removes_it_through_its_node() -> None:
    async def run() -> None:
        net = Net()
        other = net.nodes[IDS[1]]
        try:
            group_id = (await create(net, "PACK", 2, group="5")).groups[0]["group_id"]
            table = await other.query(PlacementGroupQuery())
            entry = next(e for e in table.groups if e["group_id"] == group_id)
            assert entry["state"] == "CREATED" and entry["bundle_nodes"] == [IDS[0]] * 2
            assert entry["available"] == {"0": {"CPU": 1.0}, "1": {"CPU": 1.0}}
            ready = await other.query(PlacementGroupQuery(group_id, wait=True))
            assert type(ready).__name__ == "Result"
            removed = await other.query(PlacementGroupQuery(group_id, remove=True))
            assert removed.groups[0]["state"] == "REMOVED" and net.free() == [2.0, 2.0, 2.0]
            gone = await other.query(PlacementGroupQuery("f" * 36, remove=True))
            assert isinstance(gone, Failure) and "no placement group" in gone.message
        finally:
            await net.close()
    asyncio.run(run())
