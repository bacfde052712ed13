"""The dashboard's picture of the cluster, as one node sees it: a JSON-ready dict.

:func:`cluster_snapshot` reads what the node already holds, synchronously
and without asking anyone (a snapshot is taken at every change and every
second for each open page, so it must cost microseconds, and never wait on
a peer that may be dead):

* the master's member list and this node's failure detector: every machine
  with its health, round trip, profile (memory, cores, chip), resources;
* the topology's links with their measured latency and bandwidth;
* this node's actors (state, restarts, last error) and workers;
* what other members last said their machines host (``remote``: their
  actors, pipeline stages, memory now, free resources; a
  :class:`~pmetal.wire.Machine` each, asked in the background by the
  dashboard, see :mod:`pmetal.dashboard.server`; :func:`hosted` is the
  answer this node gives);
* the node's telemetry (collectives and pipelines its workers and drivers
  ran), when the node has one (``node.telemetry``; None otherwise);
* the event log (:mod:`pmetal.cluster.eventlog`).

Machines that were members once and no longer are stay on the picture as
``dead`` (the detector or the master's list said so) or ``left``, so a
machine that dies does not just vanish from the page: ``known`` keeps them
(:data:`MAX_GONE` of them at most).

The node is duck-typed (``Any``): this layer is below the node daemon.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import time
from typing import Any

from pmetal.cluster.topology import memory_now

__all__ = ["MAX_GONE", "cluster_snapshot", "hosted", "jsonable"]

MAX_GONE = 32
"""Machines no longer members that the picture keeps (the newest seen)."""

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def jsonable(value: Any) -> Any:
    """Frozen values, enums, tuples and dicts as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        for name in ("seconds_per_step", "count"):   # derived figures worth showing
            if isinstance(getattr(type(value), name, None), property):
                out[name] = jsonable(getattr(value, name))
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and math.isnan(value):   # NaN is not JSON
        return None
    return value


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def hosted(node: Any, telemetry: dict[str, Any] | None = None) -> dict[str, Any]:
    """What this node's machine hosts now, as the fields of a
    :class:`~pmetal.wire.Machine` (the answer to a member's
    ``MachineRequest``); ``telemetry``: the node's, already read."""
    if telemetry is None:
        source = getattr(node, "telemetry", None)
        telemetry = jsonable(source.snapshot()) if source is not None else None
    stages = [{"pipeline": p["name"], **{k: s.get(k) for k in
                                         ("index", "steps", "seconds_per_step", "hop_bytes")}}
              for p in (telemetry or {}).get("pipelines") or () for s in p["stage_rows"]]
    total, free = memory_now()
    return {"actors": _actors(node), "stages": stages, "memory_total": total,
            "memory_free": free, "available": dict(node.actors.available),
            "queued": len(node.actors.queue), "workers": len(node.pool.workers),
            "node_rss": _resident_bytes()}


def _hosting(entry: dict[str, Any], fields: dict[str, Any]) -> None:
    """Fill a machine's entry from what it hosts (:func:`hosted`)."""
    if fields.get("memory_total"):
        entry["profile"] = {**entry["profile"], "memory_total": fields["memory_total"],
                            "memory_free": fields["memory_free"]}
    actors = list(fields.get("actors") or ())
    entry.update(actor_list=actors, actors=sum(a.get("state") == "alive" for a in actors),
                 stages=list(fields.get("stages") or ()), available=fields.get("available"),
                 queued=fields.get("queued"), workers=fields.get("workers"),
                 node_rss=fields.get("node_rss"))


def _machines(node: Any, known: dict[str, dict[str, Any]],
              remote: dict[str, dict[str, Any]],
              telemetry: dict[str, Any] | None) -> list[dict[str, Any]]:
    cluster = node.cluster
    state = cluster.state
    health = {h.node_id: h for h in cluster.health.summary()}
    dead = cluster.dead()
    listed = set()
    for m in state.members:
        node_id = m.get("node_id", "")
        if not node_id:
            continue
        listed.add(node_id)
        h = health.get(node_id)
        if node_id == node.node_id:
            status = "self"
        elif node_id in dead or m.get("state") == "dead":
            status = "dead"
        else:
            status = jsonable(h.status) if h is not None else "unknown"
        entry = {
            "node_id": node_id, "address": m.get("address", ""),
            "health": status, "master": node_id == state.master,
            "self": node_id == node.node_id,
            "rtt_ms": (round(h.rtt * 1000, 3) if h is not None and h.rtt is not None
                       and status != "dead" else None),
            "silent_s": round(h.silent_for, 2) if h is not None else None,
            "profile": dict(m.get("profile", {})), "resources": dict(m.get("resources", {})),
            "incarnation": m.get("incarnation", 0),
        }
        if node_id == node.node_id:
            _hosting(entry, hosted(node, telemetry))
        elif status != "dead" and node_id in remote:
            _hosting(entry, remote[node_id])
        known[node_id] = entry
    gone = [node_id for node_id in known if node_id not in listed]
    for node_id in gone[:-MAX_GONE]:   # the oldest seen first
        del known[node_id]
    for node_id in gone[-MAX_GONE:]:
        known[node_id].update(health="dead" if node_id in dead else "left", master=False,
                              rtt_ms=None)
    for entry in known.values():
        if entry["health"] in ("dead", "left"):   # what it hosted is not known any more
            entry.update(actor_list=None, stages=None, actors=None)
    return sorted(known.values(), key=lambda e: (not e["self"], e["node_id"]))


def _links(node: Any, machines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    topology = node.cluster.topology
    health = {m["node_id"]: m["health"] for m in machines}
    ids = [n for n in topology.nodes() if n in health]
    out = []
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            link = topology.link(a, b)
            if link is None:
                continue
            worst = "dead" if "dead" in (health[a], health[b]) else (
                health[b] if a == node.node_id else health[a] if b == node.node_id else "unknown")
            out.append({"a": a, "b": b, "health": worst,
                        "latency_ms": (round(link.latency * 1000, 3)
                                       if link.latency is not None else None),
                        "bandwidth_bps": link.bandwidth})
    return out


def _actors(node: Any) -> list[dict[str, Any]]:
    by_actor = {w.actor_id: w for w in node.pool.workers.values() if w.actor_id}
    out = []
    for record in node.actors.actors.values():
        spec = record.spec
        worker = by_actor.get(spec.actor_id)
        out.append({"actor_id": spec.actor_id, "name": spec.options.get("name") or "",
                    "class_name": spec.options.get("class_name") or "",
                    "state": jsonable(record.state), "restarts": record.incarnation,
                    "restarts_left": record.restarts_left, "last_error": record.reason,
                    "pid": worker.proc.pid if worker is not None else None})
    return out


def cluster_snapshot(node: Any, known: dict[str, dict[str, Any]],
                     remote: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The dashboard's JSON (see the module docstring); ``known`` is the
    caller's memory of machines seen, updated here."""
    cluster = node.cluster
    state = cluster.state
    telemetry = getattr(node, "telemetry", None)
    tele = jsonable(telemetry.snapshot()) if telemetry is not None else None
    refreshed = getattr(telemetry, "refreshed", None)
    if isinstance(tele, dict) and isinstance(refreshed, float) and refreshed > 0:
        # The workers' counts hold as of the last refresh: rates on the page
        # divide by the time between refreshes, not between snapshots.
        tele["at"] = refreshed
    machines = _machines(node, known, remote, tele)
    return {
        "at": time.time(), "node_id": node.node_id, "namespace": node.namespace.name,
        "master": state.master, "term": state.term, "epoch": state.epoch,
        "role": jsonable(state.role),
        "dead_after_s": node.config.health.dead_after,
        "machines": machines, "links": _links(node, machines), "actors": _actors(node),
        "telemetry": tele,
        "events": [e.to_dict() for e in reversed(cluster.events.events())],
        "metrics": node.metrics.describe(),
    }
