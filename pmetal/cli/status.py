"""``pmetal status`` and ``pmetal kill``: commands that talk to the node
recorded in node.json, and the text ``pmetal status`` prints for a person
(:func:`_print_status` and its tables).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from pmetal.actors.client import CoreClient
from pmetal.node.process import node_file
from pmetal.cli.basic import _fail
from pmetal.cli.daemon import _is_node_process, _read_node_file
from pmetal.config import load_config, pmetal_home
from pmetal.errors import PeerError
from pmetal.security import NetworkNamespace

_STATUS_TIMEOUT = 5.0
"""Cap on connect and request deadlines of ``pmetal status``."""


def _status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print the node's full status as JSON")
    parser.add_argument("--probe", action="store_true",
                        help="first measure the bandwidth of the link from this node to "
                             "every member (a few MiB each)")
    parser.add_argument("--measure", action="store_true",
                        help="add each member's capacity as pipeline placement sees it: "
                             "compute rate (measured over a quarter second of every CPU "
                             "the first time, then kept 10 minutes), free memory now, links")


def _run_status(args: argparse.Namespace) -> int:
    client = _client_of_recorded_node()
    try:
        status = client.status(probe=args.probe, measure=args.measure)
    finally:
        client.close()
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        _print_status(status, _read_node_file(pmetal_home()) or {"pid": "?"})
    return 0


def _client_of_recorded_node() -> CoreClient:
    """A client of the node recorded in node.json, with short deadlines."""
    home = pmetal_home()
    path = node_file(home)
    info = _read_node_file(home)
    if info is None:
        raise PeerError(f"no pmetal node is running on this machine (no {path}); "
                        f"start one with 'pmetal start'")
    if not _is_node_process(info["pid"]):
        raise PeerError(f"the node recorded in {path} (pid {info['pid']}) is not running; "
                        f"'pmetal start' starts a new one")
    cfg = load_config()
    security = {"namespace": info.get("namespace") or cfg.security.namespace}
    if info.get("psk_file"):
        security["psk_file"] = info["psk_file"]
    cfg = load_config(security=security, transport={
        "connect_timeout": min(cfg.transport.connect_timeout, _STATUS_TIMEOUT),
        "handshake_timeout": min(cfg.transport.handshake_timeout, _STATUS_TIMEOUT),
        "request_timeout": min(cfg.transport.request_timeout, _STATUS_TIMEOUT)})
    # A recorded PSK file wins over a PMETAL_PSK meant for something else.
    namespace = NetworkNamespace.resolve(cfg.security,
                                         env={} if info.get("psk_file") else None)
    return CoreClient(info["address"], namespace, cfg)


def _kill_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="name of the actor (as given to .options(name=...))")
    parser.add_argument("--restart", action="store_true",
                        help="let it restart if it has restarts left (default: it stays dead)")


def _run_kill(args: argparse.Namespace) -> int:
    client = _client_of_recorded_node()
    try:
        try:
            loc = client.lookup(name=args.name)
        except ValueError as exc:
            return _fail(args, str(exc))
        if loc.state == "dead":
            return _fail(args, f"actor {args.name!r} is already dead: {loc.reason}")
        client.kill(loc.actor_id, not args.restart, loc.node_id)
    finally:
        client.close()
    print(f"killed actor {args.name!r} ({loc.class_name}, {loc.actor_id}) on node "
          f"{loc.node_id[:8]}")
    return 0


def _print_status(s: dict[str, Any], info: dict[str, Any]) -> None:
    stats = s.get("statistics", {})
    print(f"node       {s['node_id']} (pid {s.get('pid', info['pid'])})")
    print(f"address    {s['address']}")
    print(f"namespace  {s.get('namespace', '?')}   members {len(s.get('members', [])) + 1}, "
          f"epoch {s.get('epoch', 0)}")
    print(f"resources  {_resources(s.get('resources', {}), s.get('available'))}")
    print(f"served     {stats.get('requests', 0)} node requests; actors created "
          f"{stats.get('actors_created', 0)}, alive {stats.get('actors_alive', 0)}, "
          f"restarts {stats.get('actor_restarts', 0)}")
    metrics = s.get("metrics") or {}
    if metrics.get("address"):
        print(f"metrics    {metrics['address']}/metrics")
    elif metrics.get("reason"):
        print(f"metrics    off: {metrics['reason']}")
    queue = s.get("queue") or []
    if queue:
        oldest = max(q.get("waited", 0.0) for q in queue)
        print(f"queue      {len(queue)} creation(s) waiting for resources (the oldest for "
              f"{oldest:g} s); see the pending actors below")
    leases = s.get("owner_leases") or []
    if leases:
        print(f"leases     {len(leases)} driver(s) on other machines hold a lease on their "
              f"actors (they end if it lapses)")
    _print_cluster(s)
    actors = s.get("actors", [])
    hosted = {a["actor_id"]: a for a in actors}
    _table("WORKERS", ("WORKER", "PID", "ROLE", "READY", "ACTOR", "CALLS"),
           [(w["worker_id"], w.get("pid", ""), w.get("role", ""),
             "yes" if w.get("ready") else "no", _hosting(w, hosted),
             w.get("calls", "-")) for w in s.get("workers", [])])
    # Live actors first; of the dead (a node remembers 200) only the latest.
    live = [a for a in actors if a.get("state") != "dead"]
    dead = [a for a in actors if a.get("state") == "dead"]
    shown = live + dead[-_DEAD_SHOWN:]
    _table("ACTORS", ("ACTOR ID", "CLASS", "NAME", "OWNER", "NODE", "STATE", "INCARNATION",
                      "RESOURCES", "REASON"),
           [(a["actor_id"], a.get("class_name", ""), a.get("name") or "-",
             "detached" if a.get("lifetime") == "detached" else a.get("owner", "-"),
             str(a.get("node_id", ""))[:8], a.get("state", ""), a.get("incarnation", 0),
             _resources(a.get("resources") or {}) if a.get("resources") else "-",
             a.get("reason") or "") for a in shown],
           total=len(actors))
    if len(shown) < len(actors):
        print(f"  ({len(actors) - len(shown)} older dead actors left out; "
              f"'pmetal status --json' lists them)")
    groups = (s.get("placement_groups") or {}).get("groups") or []
    held = (s.get("placement_groups") or {}).get("held") or []
    if groups or held:   # (a node without any says nothing about them)
        _table("PLACEMENT GROUPS", ("GROUP ID", "NAME", "STRATEGY", "STATE", "BUNDLES", "NODES",
                                    "REASON"),
               [(g["group_id"], g.get("name") or "-", g.get("strategy", ""), g.get("state", ""),
                 len(g.get("bundles") or []),
                 ",".join(sorted({str(n)[:8] for n in g.get("bundle_nodes") or [] if n})) or "-",
                 g.get("reason") or "") for g in groups])
        if held:
            print(f"  this node holds {len(held)} bundle(s) of "
                  f"{len({b['group_id'] for b in held})} group(s)")
    if s.get("refused_peers"):
        _table("REFUSED PEERS", ("ADDRESS", "REASON"),
               [(p["address"], p["reason"]) for p in s["refused_peers"]])


def _print_cluster(s: dict[str, Any]) -> None:
    """The master, its term and every member (this node too) with its health."""
    cluster = s.get("cluster") or {}
    master = cluster.get("master") or ""
    print(f"master     {master or 'none yet (an election is under way, or this node sees no majority)'}"
          f"   term {cluster.get('term', 0)}, epoch {cluster.get('epoch', 0)}, this node is "
          f"{cluster.get('role', '?')}")
    rows = []
    for m in cluster.get("members") or []:
        marks = [w for w, on in (("master", m["node_id"] == master),
                                 ("this node", m["node_id"] == s["node_id"])) if on]
        health = m.get("health", "?")
        if m.get("state") == "dead":
            health = "dead (master)"
        rows.append((m["node_id"], m.get("address", ""), health,
                     f"{m['rtt_ms']:.2f}" if m.get("rtt_ms") is not None else "-",
                     _resources(m.get("resources", {}), m.get("available")),
                     m.get("actors", "-"), ", ".join(marks)))
    _table("NODES", ("NODE ID", "ADDRESS", "HEALTH", "RTT MS", "RESOURCES", "ACTORS", ""),
           rows)
    links = (cluster.get("topology") or {}).get("links") or []
    if links:
        _table("LINKS", ("FROM", "TO", "LATENCY US", "BANDWIDTH MB/S"),
               [(link["a"][:8], link["b"][:8],
                 f"{link['latency'] * 1e6:.0f}" if link.get("latency") else "-",
                 f"{link['bandwidth'] / 1e6:.0f}" if link.get("bandwidth") else
                 "- (pmetal status --probe)") for link in links])
    measured = [m for m in cluster.get("members") or [] if m.get("capacity")]
    if measured:
        _table("CAPACITY", ("NODE ID", "COMPUTE GFLOP/S", "MEMORY FREE", "LINKS MEASURED"),
               [(m["node_id"][:8], f"{m['capacity'].get('compute', 0.0):.1f}",
                 f"{m['capacity'].get('memory_free', 0) / (1 << 30):.1f} GiB",
                 len(m["capacity"].get("links") or {})) for m in measured])
    ignored = cluster.get("ignored") or []
    if ignored:
        _table("IGNORED BY DISCOVERY", ("NODE ID", "ADDRESS", "REASON"),
               [(i.get("node_id", ""), i.get("address", ""), i.get("reason", ""))
                for i in ignored])


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


_DEAD_SHOWN = 10
"""Dead actors ``pmetal status`` prints (the latest); --json has them all."""


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


def _table(title: str, headers: Sequence[str], rows: list[Sequence[Any]],
           total: int | None = None) -> None:
    print(f"\n{title} ({len(rows) if total is None else total})")
    if not rows:
        return
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())

