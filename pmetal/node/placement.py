"""What an actor needs and where it may go: option checks, resource
arithmetic, and the queue of creations waiting for room on this node.

Everything a peer sends is checked here before the node acts on it: a
``CreateActor`` whose ``num_cpus`` is a string or whose resources are
negative is answered with a ``TypeError``/``ValueError`` saying what is wrong
(see :func:`check_options`), never an exception inside the node.

Placement follows Ray: an actor that fits the free resources of this node
starts here; one that fits the free resources of a member goes there; one
that fits no node now but would fit one of them when empty waits, first come
first served, in that node's :class:`PlacementQueue` until actors free
enough or its creation deadline passes; only what no node could ever hold is
a :class:`~pmetal.errors.PlacementError` at once.

Which node with room (:func:`choose`, pure, run by the master) follows
Ray's default hybrid policy: the creator's node while its utilization is
below :data:`LOCAL_THRESHOLD`, else one picked at random among the least
utilized nodes with room (the best :data:`TOP_K_FRACTION` of them, at least
one, ties included). A node's utilization is the largest used share of any
of its resources and of its actor count per CPU: every actor is a process,
so 200 actors of ``num_cpus=0.01`` load a node even though they reserve
only 2 CPUs. Unlike Ray, the creator's node is preferred only while it
also hosts no more actors than any other node with room: on a home
cluster of a few machines the actors are mostly training ranks and model
stages, which belong one per machine before any machine takes a second
(Ray would keep up to half a 16-core machine's worth on the creator's). The master counts the creations it sent to a node and has not
yet heard back about (:class:`NodeLoad` ``actors`` and ``available``), so a
burst of concurrent creations spreads instead of all reading the same
stale view. ``strategy="SPREAD"`` skips the creator's preference and takes
the node with the fewest actors (random among equals): round robin in
effect.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pmetal.errors import PMetalTimeoutError

__all__ = ["LOCAL_THRESHOLD", "STRATEGIES", "TOP_K_FRACTION", "NodeLoad", "PlacementQueue",
           "check_options", "check_resources", "choose", "fits", "needs", "resources_text",
           "utilization"]

LIFETIMES = ("", "non_detached", "detached")
STRATEGIES = ("DEFAULT", "SPREAD")
LOCAL_THRESHOLD = 0.5
"""The creator's node is preferred while its utilization is below this (Ray's
``scheduler_spread_threshold``)."""
TOP_K_FRACTION = 0.2
"""Above the threshold, a node is picked at random among this share of the
least utilized nodes with room (at least one; Ray's ``scheduler_top_k_fraction``)."""


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def check_resources(resources: Any, where: str) -> dict[str, float]:
    """``resources`` as ``{name: float}``; TypeError/ValueError saying what is
    wrong otherwise (a name that is not a string, an amount that is not a
    finite number or is negative)."""
    if not isinstance(resources, dict):
        raise TypeError(f"{where}: resources must be a dict of name to amount, not "
                        f"{type(resources).__name__}")
    out = {}
    for name, amount in resources.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"{where}: resource names must be non-empty strings, not {name!r}")
        if not _is_number(amount):
            raise TypeError(f"{where}: resource {name!r} must be a number, not "
                            f"{type(amount).__name__} {amount!r:.40}")
        if amount < 0:
            raise ValueError(f"{where}: resource {name!r} must not be negative (got {amount})")
        out[name] = float(amount)
    return out


def check_options(options: dict[str, Any]) -> None:
    """Raise TypeError/ValueError when ``options`` of a CreateActor (from
    any peer) are not what the node and the worker expect."""
    where = "CreateActor"
    cpus = options.get("num_cpus")
    if cpus is not None:
        if not _is_number(cpus):
            raise TypeError(f"{where}: num_cpus must be a number, not "
                            f"{type(cpus).__name__} {cpus!r:.40}")
        if cpus < 0:
            raise ValueError(f"{where}: num_cpus must not be negative (got {cpus})")
    check_resources(options.get("resources") or {}, where)
    for key, low in (("max_restarts", -1), ("max_task_retries", -1), ("max_concurrency", 1)):
        value = options.get(key)
        if value is not None and (type(value) is not int or value < low):
            raise ValueError(f"{where}: {key} must be an integer >= {low}, not {value!r:.40}")
    for key in ("name", "node", "class_name", "lifetime", "owner_node", "owner_client"):
        value = options.get(key)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{where}: {key} must be a string, not {type(value).__name__}")
    strategy = options.get("strategy") or "DEFAULT"
    if strategy not in STRATEGIES:
        raise ValueError(f"{where}: strategy must be one of {list(STRATEGIES)}, not "
                         f"{strategy!r:.40}")
    group = options.get("placement_group")
    if group is not None and (not isinstance(group, str) or not group):
        raise TypeError(f"{where}: placement_group must be a group id (a string), not "
                        f"{group!r:.40}")
    index = options.get("bundle_index")
    if index is not None and (type(index) is not int or index < -1):
        raise ValueError(f"{where}: bundle_index must be an integer >= -1, not {index!r:.40}")
    if type(options.get("soft", False)) is not bool:
        raise TypeError(f"{where}: soft must be a bool, not {type(options['soft']).__name__}")
    if (options.get("lifetime") or "") not in LIFETIMES:
        raise ValueError(f"{where}: lifetime must be 'detached' or None, not "
                         f"{options['lifetime']!r:.40}")
    runtime_env = options.get("runtime_env")
    if runtime_env is not None:
        from pmetal.actors.runtime_env import check_runtime_env
        check_runtime_env(runtime_env, where)
    methods = options.get("methods")
    if methods is not None and (not isinstance(methods, (list, tuple))
                                or not all(isinstance(m, str) for m in methods)):
        raise TypeError(f"{where}: methods must be a list of strings")
    for key, low in (("term", 0), ("incarnation", 0), ("restarts_left", -1)):
        # Stamped by the master (term) and by a restart elsewhere (the others).
        value = options.get(key)
        if value is not None and (type(value) is not int or value < low):
            raise ValueError(f"{where}: {key} must be an integer >= {low}, not {value!r:.40}")
    for key in ("owner_pid", "timeout"):
        value = options.get(key)
        if value is not None and (not _is_number(value) or value < 0):
            raise ValueError(f"{where}: {key} must be a non-negative number, not {value!r:.40}")


def needs(options: dict[str, Any]) -> dict[str, float]:
    """The resources an actor with (checked) ``options`` holds while it lives."""
    need = {k: float(v) for k, v in (options.get("resources") or {}).items() if v}
    if options.get("num_cpus"):
        need["CPU"] = float(options["num_cpus"])
    return need


def fits(need: Mapping[str, float], pool: Mapping[str, float]) -> bool:
    return all(pool.get(k, 0.0) >= v for k, v in need.items() if v)


@dataclass(frozen=True)
class NodeLoad:
    """What the master knows of one node when it places: its free and total
    resources, how many creations wait in its queue, and how many actors it
    hosts (with what the master placed there since it last heard)."""
    available: Mapping[str, float]
    total: Mapping[str, float]
    queued: int = 0
    actors: int = 0

    def plus(self, need: Mapping[str, float]) -> NodeLoad:
        """This load once one more actor needing ``need`` is placed here."""
        available = dict(self.available)
        for k, v in need.items():
            available[k] = available.get(k, 0.0) - v
        return replace(self, available=available, actors=self.actors + 1)


def utilization(load: NodeLoad) -> float:
    """The largest used share of the node's resources, counting its actors
    per CPU as one of them (0: idle, 1: full)."""
    shares = [(total - load.available.get(k, 0.0)) / total
              for k, total in load.total.items() if total > 0]
    shares.append(load.actors / max(load.total.get("CPU", 0.0), 1.0))
    return max(shares)


def choose(loads: Mapping[str, NodeLoad], need: Mapping[str, float], origin: str,
           strategy: str = "DEFAULT", rng: random.Random | None = None) -> str:
    """The node for a creation needing ``need`` (see the module doc): ""
    when no node could ever hold it. Without room now anywhere, the node
    that could hold it with the shortest queue, the creator's first (the
    creation waits there)."""
    pick = (rng or random).choice
    room = [n for n, load in loads.items() if not load.queued and fits(need, load.available)]
    if room:
        if strategy == "SPREAD":
            fewest = min(loads[n].actors for n in room)
            return pick(sorted(n for n in room if loads[n].actors == fewest))
        if (origin in room and utilization(loads[origin]) < LOCAL_THRESHOLD
                and loads[origin].actors <= min(loads[n].actors for n in room)):
            return origin
        ranked = sorted(room, key=lambda n: utilization(loads[n]))
        k = min(len(ranked), max(1, math.ceil(TOP_K_FRACTION * len(loads))))
        cut = utilization(loads[ranked[k - 1]])
        return pick([n for n in ranked if utilization(loads[n]) <= cut])
    ever = [n for n, load in loads.items() if fits(need, load.total)]
    return min(ever, key=lambda n: (loads[n].queued, n != origin), default="")


@dataclass
class _Waiter:
    need: dict[str, float]
    what: str
    deadline: float
    since: float = field(default_factory=time.monotonic)
    admitted: asyncio.Event = field(default_factory=asyncio.Event)


class PlacementQueue:
    """Creations waiting for free resources on this node, first come first
    served: when resources free up, the queue is walked in order and every
    waiter that fits now takes its share (a small actor behind a big one
    that still does not fit goes ahead, as in Ray). ``available`` is the
    node's free-resources dict, shared and updated in place."""

    def __init__(self, available: dict[str, float]) -> None:
        self.available = available
        self._waiters: list[_Waiter] = []

    def __len__(self) -> int:
        return len(self._waiters)

    def take(self, need: dict[str, float]) -> None:
        for k, v in need.items():
            self.available[k] = self.available.get(k, 0.0) - v

    def give(self, need: dict[str, float]) -> None:
        for k, v in need.items():
            self.available[k] = self.available.get(k, 0.0) + v
        self.admit()

    def admit(self) -> None:
        for waiter in list(self._waiters):
            if fits(waiter.need, self.available):
                self._waiters.remove(waiter)
                self.take(waiter.need)
                waiter.admitted.set()

    async def reserve(self, need: dict[str, float], deadline: float, what: str,
                      describe: Callable[[], str], cancel: asyncio.Event) -> bool:
        """Take ``need`` from the free resources, waiting in line while they
        are short. False (nothing taken) when ``cancel`` is set first;
        PMetalTimeoutError at ``deadline`` saying what it waited for
        (``describe()``: what holds the resources)."""
        if not self._waiters and fits(need, self.available):
            self.take(need)
            return True
        waiter = _Waiter(need, what, deadline)
        self._waiters.append(waiter)
        self.admit()
        waits = [asyncio.ensure_future(waiter.admitted.wait()),
                 asyncio.ensure_future(cancel.wait())]
        try:
            await asyncio.wait(waits, timeout=max(0.0, deadline - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:   # owned here: never left behind
                w.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)
        if waiter.admitted.is_set():
            if cancel.is_set():
                self.give(need)
                return False
            return True
        if cancel.is_set():
            return False
        raise PMetalTimeoutError(
            f"{what} waited for resources ({resources_text(need)}) until its creation "
            f"deadline, but they did not free up: {describe()}; kill an actor, add a node, "
            f"or raise transport.request_timeout")

    def describe(self) -> list[dict[str, Any]]:
        """The waiting creations in order: what, its needs, how long it has
        waited and how long it may still wait (s)."""
        now = time.monotonic()
        return [{"what": w.what, "needs": w.need, "waited": round(now - w.since, 1),
                 "gives_up_in": round(max(0.0, w.deadline - now), 1)} for w in self._waiters]


def resources_text(resources: dict[str, float]) -> str:
    """``{"CPU": 2.0, "memory": 2**31}`` as a person reads it: "CPU 2, memory 2 GiB"."""
    parts = [f"{name} {value / (1 << 30):.3g} GiB" if name == "memory" else f"{name} {value:g}"
             for name, value in sorted(resources.items())]
    return ", ".join(parts) or "nothing"
