"""The text ``pmetal status`` prints for a person: the cluster on one screen.

:func:`picture` turns a node's status (the ``Status`` answer, as ``pmetal
status --json`` prints it) into lines no wider than a terminal (80 columns
by default): this node, the master and its term, every member with its
health and round-trip time, the links with their measured latency and
bandwidth, the workers of this node, and the actors of every member that
answered (where each runs, its state and restarts). Long texts (reasons,
errors) go on a line of their own under the row they explain, wrapped;
a table still too wide shortens its widest cells, but never those of its
first column (the id or name of what each row shows) nor below 10
characters (node ids, 8 in tables, and states are never cut).

:class:`Memory` is what ``pmetal status --watch`` carries from one frame
to the next: the members seen before, so that one that leaves the member
list is said ("gone since ...") rather than silently dropped.

Pure functions of their input: no I/O, so tests render a status as it is.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WIDTH", "Memory", "picture"]

WIDTH = 80
"""Columns of the picture unless the terminal says otherwise."""

_ID = 8
"""Characters of a node id in tables (the full ids are in --json)."""
_DEAD_SHOWN = 10
"""Dead actors the picture lists (the latest); --json has them all."""
_LABEL = 11
"""Width of the label column of the header lines ("namespace  ")."""
_CUT = ".."
_FLOOR = 10
"""Characters a table's cell keeps when it must be shortened (node ids,
states and such short values are never cut)."""


@dataclass
class Memory:
    """What one ``--watch`` frame leaves to the next."""

    members: dict[str, str] = field(default_factory=dict)
    """node id -> address of every member seen so far."""
    gone: dict[str, float] = field(default_factory=dict)
    """node id -> wall-clock time its leaving was first seen."""

    def update(self, members: Sequence[dict[str, Any]], now: float) -> None:
        present = {m["node_id"] for m in members}
        for m in members:
            self.members[m["node_id"]] = m.get("address", "")
            self.gone.pop(m["node_id"], None)
        for node_id in self.members:
            if node_id not in present:
                self.gone.setdefault(node_id, now)


def picture(s: dict[str, Any], pid: Any = "?", *, width: int = WIDTH,
            memory: Memory | None = None, now: float | None = None) -> list[str]:
    """The lines of the picture of status ``s`` (``pid``: the node's, as
    recorded in node.json, for an old node whose status lacks it)."""
    out: list[str] = []
    stats = s.get("statistics", {})
    cluster = s.get("cluster") or {}
    members = cluster.get("members") or []
    if memory is not None:
        memory.update(members, time.time() if now is None else now)
    field_ = _Fields(out, width)
    field_("node", f"{s['node_id']} (pid {s.get('pid', pid)})")
    field_("address", s["address"])
    field_("namespace", f"{s.get('namespace', '?')}   members {len(s.get('members', [])) + 1}, "
                        f"epoch {s.get('epoch', 0)}")
    field_("resources", _resources(s.get("resources", {}), s.get("available")))
    field_("served", f"{stats.get('requests', 0)} node requests; actors created "
                     f"{stats.get('actors_created', 0)}, alive {stats.get('actors_alive', 0)}, "
                     f"restarts {stats.get('actor_restarts', 0)}")
    metrics = s.get("metrics") or {}
    if metrics.get("address"):
        field_("metrics", f"{metrics['address']}/metrics")
    elif metrics.get("reason"):
        field_("metrics", f"off: {metrics['reason']}")
    master = cluster.get("master") or ""
    if master:
        whose = " (this node)" if master == s["node_id"] else ""
        field_("master", f"{master}{whose}")
    else:
        field_("master", "none yet: an election is under way, or this node sees no majority")
    field_("term", f"{cluster.get('term', 0)}, epoch {cluster.get('epoch', 0)}; this node is "
                   f"{cluster.get('role', '?')}")
    queue = s.get("queue") or []
    if queue:
        oldest = max(q.get("waited", 0.0) for q in queue)
        field_("queue", f"{len(queue)} creation(s) waiting for resources (the oldest for "
                        f"{oldest:g} s); see the pending actors below")
    leases = s.get("owner_leases") or []
    if leases:
        field_("leases", f"{len(leases)} driver(s) on other machines hold a lease on their "
                         f"actors (they end if it lapses)")
    _nodes(out, s, members, master, width)
    if memory is not None and memory.gone:
        out += _table("GONE", ("NODE", "ADDRESS", "LEFT THE MEMBER LIST"),
                      [(node_id[:_ID], memory.members.get(node_id, "").removeprefix("tcp://"),
                        time.strftime("%H:%M:%S", time.localtime(t)))
                       for node_id, t in sorted(memory.gone.items(), key=lambda i: i[1])],
                      width=width)
    _links(out, cluster, width)
    _workers(out, s, width)
    _actors(out, s, members, width)
    _groups(out, s, width)
    _capacity(out, members, width)
    ignored = cluster.get("ignored") or []
    if ignored:
        out += _table("IGNORED BY DISCOVERY", ("NODE", "ADDRESS"),
                      [(str(i.get("node_id", ""))[:_ID], i.get("address", "")) for i in ignored],
                      notes=[i.get("reason", "") for i in ignored], width=width)
    refused = s.get("refused_peers") or []
    if refused:
        out += _table("REFUSED PEERS", ("ADDRESS",), [(p["address"],) for p in refused],
                      notes=[p.get("reason", "") for p in refused], width=width)
    return out


class _Fields:
    """Header lines: a label, then the text wrapped under itself."""

    def __init__(self, out: list[str], width: int) -> None:
        self.out, self.width = out, width

    def __call__(self, label: str, text: str) -> None:
        lines = textwrap.wrap(text, max(20, self.width - _LABEL), break_on_hyphens=False) or [""]
        self.out.append(f"{label:<{_LABEL - 1}} {lines[0]}".rstrip())
        self.out.extend(" " * _LABEL + line for line in lines[1:])


# ----------------------------------------------------------------- sections

def _nodes(out: list[str], s: dict[str, Any], members: list[dict[str, Any]], master: str,
           width: int) -> None:
    gpus = any((m.get("resources") or {}).get("GPU") for m in members)
    rows, notes = [], []
    for m in members:
        total, free = m.get("resources") or {}, m.get("available")
        health = m.get("health", "?")
        if m.get("state") == "dead":
            health = "dead"   # the master holds it dead
        row = [m["node_id"][:_ID] + ("*" if m["node_id"] == master else ""),
               str(m.get("address", "")).removeprefix("tcp://"), health,
               f"{m['rtt_ms']:.2f}" if m.get("rtt_ms") is not None else "-",
               _amount(total, free, "CPU")]
        if gpus:
            row.append(_amount(total, free, "GPU"))
        row += [_amount(total, free, "memory"), m.get("actors", "-")]
        rows.append(row)
        notes.append(f"did not answer: {m['unanswered']}" if m.get("unanswered") else "")
    headers = ["NODE", "ADDRESS", "HEALTH", "RTT MS", "CPU"] + (["GPU"] if gpus else []) + \
        ["MEMORY", "ACTORS"]
    out += _table("NODES", headers, rows, notes=notes, width=width,
                  legend="* master; CPU and MEMORY: free/total")


def _links(out: list[str], cluster: dict[str, Any], width: int) -> None:
    links = (cluster.get("topology") or {}).get("links") or []
    if not links:
        return
    out += _table("LINKS", ("FROM", "TO", "LATENCY US", "BANDWIDTH MB/S"),
                  [(link["a"][:_ID], link["b"][:_ID],
                    f"{link['latency'] * 1e6:.0f}" if link.get("latency") else "-",
                    f"{link['bandwidth'] / 1e6:.0f}" if link.get("bandwidth") else
                    "- (pmetal status --probe)") for link in links], width=width)


def _workers(out: list[str], s: dict[str, Any], width: int) -> None:
    hosted = {a["actor_id"]: a for a in s.get("actors", [])}
    out += _table("WORKERS", ("WORKER", "PID", "ROLE", "READY", "ACTOR", "CALLS"),
                  [(w["worker_id"], w.get("pid", ""), w.get("role", ""),
                    "yes" if w.get("ready") else "no", _hosting(w, hosted),
                    w.get("calls", "-")) for w in s.get("workers", [])], width=width)


def _actors(out: list[str], s: dict[str, Any], members: list[dict[str, Any]],
            width: int) -> None:
    # Every member's actors when the node asked them (cluster_actors), else
    # (an older node) its own. Live ones first; of the dead, the latest.
    actors = s.get("cluster_actors")
    actors = s.get("actors", []) if actors is None else actors
    live = [a for a in actors if a.get("state") != "dead"]
    dead = [a for a in actors if a.get("state") == "dead"]
    shown = live + dead[-_DEAD_SHOWN:]
    out += _table("ACTORS", ("ACTOR", "CLASS", "NODE", "STATE", "RESTARTS", "OWNER"),
                  [(a.get("name") or a["actor_id"], a.get("class_name", ""),
                    str(a.get("node_id", ""))[:_ID], a.get("state", ""),
                    a.get("incarnation", 0),
                    "detached" if a.get("lifetime") == "detached" else a.get("owner", "-"))
                   for a in shown],
                  notes=[a.get("reason") or "" for a in shown], total=len(actors), width=width)
    if len(shown) < len(actors):
        out.append(f"  ({len(actors) - len(shown)} older dead actors left out; "
                   f"'pmetal status --json' lists them)")
    unknown = [m["node_id"][:_ID] + (" (dead)" if m.get("state") == "dead" or
                                     m.get("health") == "dead" else " (no answer)")
               for m in members if m.get("unanswered")]
    if unknown and s.get("cluster_actors") is not None:
        out += textwrap.wrap(f"(not listed: the actors of {', '.join(unknown)})", width,
                             initial_indent="  ", subsequent_indent="  ")


def _groups(out: list[str], s: dict[str, Any], width: int) -> None:
    groups = (s.get("placement_groups") or {}).get("groups") or []
    held = (s.get("placement_groups") or {}).get("held") or []
    if not (groups or held):   # (a node without any says nothing about them)
        return
    def note(g: dict[str, Any]) -> str:
        nodes = sorted({str(n)[:_ID] for n in g.get("bundle_nodes") or [] if n})
        where = f"bundles on {', '.join(nodes)}" if nodes else ""
        return "; ".join(t for t in (where, g.get("reason") or "") if t)
    out += _table("PLACEMENT GROUPS", ("GROUP ID", "NAME", "STRATEGY", "STATE", "BUNDLES"),
                  [(g["group_id"], g.get("name") or "-", g.get("strategy", ""),
                    g.get("state", ""), len(g.get("bundles") or [])) for g in groups],
                  notes=[note(g) for g in groups], width=width)
    if held:
        out.append(f"  this node holds {len(held)} bundle(s) of "
                   f"{len({b['group_id'] for b in held})} group(s)")


def _capacity(out: list[str], members: list[dict[str, Any]], width: int) -> None:
    measured = [m for m in members if m.get("capacity")]
    if measured:
        out += _table("CAPACITY", ("NODE", "COMPUTE GFLOP/S", "MEMORY FREE", "LINKS MEASURED"),
                      [(m["node_id"][:_ID], f"{m['capacity'].get('compute', 0.0):.1f}",
                        f"{m['capacity'].get('memory_free', 0) / (1 << 30):.1f} GiB",
                        len(m["capacity"].get("links") or {})) for m in measured], width=width)


# -------------------------------------------------------------------- cells

def _amount(total: dict[str, float], free: dict[str, float] | None, name: str) -> str:
    """``free/total`` of one resource (memory in GiB), ``total`` alone when
    the member did not say what it has free, "-" when it has none."""
    if name not in total:
        return "-"
    def text(value: float) -> str:
        return f"{value / (1 << 30):.1f}" if name == "memory" else f"{value:g}"
    unit = "G" if name == "memory" else ""
    if free is None or name not in free:
        return f"{text(total[name])}{unit}"
    return f"{text(free[name])}/{text(total[name])}{unit}"


def _resources(total: dict[str, float], free: dict[str, float] | None = None) -> str:
    def amount(name: str, value: float) -> str:
        return f"{value / (1 << 30):.1f} GiB" if name == "memory" else f"{value:g}"
    parts = []
    for name, value in sorted(total.items()):
        text = f"{name} {amount(name, value)}"
        if free is not None and name in free:
            text += f" ({amount(name, free[name])} free)"
        parts.append(text)
    return ", ".join(parts) or "none"


def _hosting(worker: dict[str, Any], actors: dict[str, dict[str, Any]]) -> str:
    """What a worker runs, for a human: the actor's name and class, "idle"."""
    actor_id = worker.get("actor_id") or ""
    if not actor_id:
        return "idle" if worker.get("role") == "actor" else "-"
    actor = actors.get(actor_id)
    if actor is None:
        return actor_id
    name, cls = actor.get("name") or "", actor.get("class_name") or "?"
    return f"{name} ({cls})" if name else f"{cls} {actor_id}"


def _table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
           notes: Sequence[str] | None = None, total: int | None = None,
           width: int = WIDTH, legend: str = "") -> list[str]:
    """A titled table no wider than ``width``: the widest column gives up
    characters (its cells end in "..") until the rows fit; ``notes[i]``, when
    not empty, is wrapped under row ``i``."""
    head = f"{title} ({len(rows) if total is None else total})"
    lines = ["", f"{head}   {legend}" if legend and len(head) + 3 + len(legend) <= width
             else head]
    if not rows:
        return lines
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    # The first column (the id or name of what the row shows) is never cut;
    # no other goes below 10 characters (node ids, 8 in tables; states).
    floor = [widths[0]] + [max(len(h), min(w, _FLOOR)) for h, w in zip(headers[1:], widths[1:])]
    while 2 + sum(widths) + 2 * (len(widths) - 1) > width:
        i = max(range(len(widths)), key=lambda k: widths[k] - floor[k])
        if widths[i] <= floor[i]:
            break   # as narrow as a table gets: wider than the terminal, not illegible
        widths[i] -= 1
    for number, row in enumerate(cells):
        text = "  ".join(_cut(c, w).ljust(w) for c, w in zip(row, widths))
        lines.append(("  " + text).rstrip())
        note = notes[number - 1] if notes and number else ""
        if note:
            lines += textwrap.wrap(note, width, initial_indent="      ",
                                   subsequent_indent="      ", break_on_hyphens=False)
    return lines


def _cut(cell: str, width: int) -> str:
    return cell if len(cell) <= width else cell[:max(0, width - len(_CUT))] + _CUT
