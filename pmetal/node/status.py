"""What a node says about itself and its machine.

The node daemon (:mod:`pmetal.node.daemon`) answers three kinds of question
with what this module gathers, and nothing here changes the node:

* ``StatusRequest`` (``pmetal status``, the dashboard): :func:`describe`,
  the node's own view, plus, from :func:`status_with_calls`, each worker's
  calls served and each live member's free resources and actors, asked of
  them with a short deadline; a member that does not answer in time is
  listed with the reason (``unanswered``), never waited for;
* ``ResourcesRequest`` (a member's ``pmetal status``, the master's
  placement): :func:`resources`, and with ``measure`` the node's compute
  capacity (:func:`resources_measured`);
* and at start-up, what this machine has: :func:`default_resources` (CPUs,
  GPUs, memory) and :func:`machine_profile` (the topology's profile).

The functions take the daemon itself and read its components; they live
apart from the daemon's shell so that its dispatch stays readable.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from pmetal.cluster.capacity import Capacity, current_capacity
from pmetal.hardware import gpu_count
from pmetal.wire import Failure, Message, Resources, ResourcesRequest, Status

if TYPE_CHECKING:
    from pmetal.node.daemon import NodeDaemon

__all__ = ["default_resources", "describe", "machine_profile", "node_capacity", "resources",
           "resources_measured", "status_with_calls"]

log = logging.getLogger(__name__)

_STATUS_ASK = 1.0   # s a member may take to say what it has free, for status
_MEASURE_ASK = 3.0   # s a member may take to measure its capacity (about 0.3 s; a silent
                    # one is placed on defaults, well within the client's request deadline)


def machine_profile(node_id: str, measure: bool) -> dict[str, Any]:
    """This machine's profile; ``measure``: with its GFLOP/s (numpy, tens of
    ms: a node alone, an embedded one in a script, skips it)."""
    try:
        from pmetal.cluster.topology import NodeProfile
        return NodeProfile.local(node_id, measure=measure).to_dict()
    except Exception as exc:  # noqa: BLE001 - a profile is informative, never fatal
        log.warning("could not measure this node's profile: %s", exc)
        return {"node_id": node_id}


def _unanswered(answer: Any, wait: float, entry: dict[str, Any]) -> str:
    """Why a member gave ``pmetal status`` no Resources answer."""
    if answer is None:
        if entry.get("state") == "dead" or entry.get("health") == "dead":
            return "dead, not asked"
        return "not in this node's member list yet"
    if isinstance(answer, TimeoutError):
        return f"no answer within {wait:g} s"
    if isinstance(answer, Failure):
        return answer.message
    if isinstance(answer, BaseException):
        return f"{type(answer).__name__}: {answer}"
    return f"answered with a {type(answer).__name__}"


def default_resources(num_cpus: float | None = None, memory: int = 0) -> dict[str, float]:
    """This machine's CPUs, GPUs and memory; ``memory`` (bytes) replaces the
    physical memory when set (``actors.memory``: a budget)."""
    cpus = float(num_cpus if num_cpus is not None else (os.cpu_count() or 1))
    try:
        physical = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        physical = 0.0
    memory = float(memory) if memory else physical
    gpus = gpu_count()   # listed only when there are some, as in Ray
    return {"CPU": cpus, **({"GPU": float(gpus)} if gpus else {}), "memory": memory}


async def status_with_calls(node: NodeDaemon, probe: bool = False,
                            measure: bool = False) -> Message:
    """describe() plus each worker's calls served (asked of the workers)
    and each live member's free resources and actors (asked of them:
    ``cluster_actors`` lists the actors of every member that answered,
    and a member's entry says ``unanswered`` why one did not); with
    ``probe``, after measuring the bandwidth of every link from here;
    with ``measure``, each member's ``capacity`` (pipeline placement)."""
    if probe:
        await node.cluster.probe_links()
    info = describe(node)
    members = list(node.membership.members.values())
    ask = ResourcesRequest(measure=measure, actors=True)
    wait = _MEASURE_ASK if measure else _STATUS_ASK
    answers = await asyncio.gather(
        node.pool.add_calls(info["workers"]), node_capacity(node, measure),
        *(asyncio.wait_for(node.membership.ask(m, ask), wait) for m in members),
        return_exceptions=True)
    by_node = dict(zip((m.node_id for m in members), answers[2:]))
    hosted = list(info["actors"])
    for entry in info["cluster"]["members"]:
        node_id = entry["node_id"]
        answer = by_node.get(node_id)
        if node_id == node.node_id:
            entry.update(available=node.actors.available, actors=node.actors.alive(),
                         queued=len(node.actors.queue))
            if measure and isinstance(answers[1], Capacity):
                entry["capacity"] = answers[1].to_dict()
        elif isinstance(answer, Resources):
            entry.update(available=answer.available, actors=answer.actors,
                         queued=answer.queued)
            if measure and answer.capacity is not None:
                entry["capacity"] = answer.capacity
            hosted.extend(answer.hosted or ())
        else:
            entry["unanswered"] = _unanswered(answer, wait, entry)
    info["cluster_actors"] = hosted
    return Status(info)


async def node_capacity(node: NodeDaemon, measure: bool = True) -> Capacity | None:
    """This node's compute capacity (placement), or None without ``measure``."""
    if not measure:
        return None
    return await current_capacity(node.compute, node.cluster.topology, node.node_id)


def resources(node: NodeDaemon, actors: bool, capacity: Capacity | None = None) -> Resources:
    """The Resources answer; with ``actors``, the actors hosted here."""
    return Resources(node.resources, node.actors.available, len(node.actors.queue),
                     node.actors.alive(), capacity.to_dict() if capacity else None,
                     node.actors.table.describe(node.node_id) if actors else None)


async def resources_measured(node: NodeDaemon, actors: bool = False) -> Message:
    """The Resources answer with this node's capacity (placement)."""
    capacity = await node_capacity(node)
    assert capacity is not None
    return resources(node, actors, capacity)


def describe(node: NodeDaemon) -> dict[str, Any]:
    """The node's own view: members, workers, actors, leases, statistics."""
    return {
        "node_id": node.node_id,
        "address": node.address,
        "namespace": node.namespace.name,
        "pid": os.getpid(),
        "epoch": node.membership.epoch,
        "resources": node.resources,
        "available": node.actors.available,
        "members": node.membership.describe(),
        "cluster": node.cluster.describe(),
        "refused_peers": node.membership.describe_refused(),
        "workers": node.pool.describe(),
        "actors": node.actors.table.describe(node.node_id),
        "queue": node.actors.queue.describe(),
        "owner_leases": node.owners.leases.describe(time.monotonic()),
        "statistics": asdict(node.statistics()),
        "scheduler": asdict(node.scheduler.statistics()),
        "placement_groups": node.groups.describe(),
        "leases": asdict(node.owners.leases.statistics()),
        "pool": asdict(node.pool.statistics()),
        "membership": asdict(node.membership.statistics()),
        "compute": asdict(node.compute.statistics()),
        "store": asdict(node.store.statistics()),
        "metrics": node.metrics.describe(),
    }
