"""``pmetal discover``: the pmetal nodes visible on the network, through mDNS.

It only listens (announcing nothing) for ``--timeout`` seconds on the
interfaces given (``--interfaces``, else ``discovery.interfaces``, else every
IPv4 interface), then lists every node seen with whether this machine's
namespace could join it, and why not. The namespace is the one of the node
running here (node.json), else the configured PSK (``PMETAL_PSK``,
``security.psk_file``, ``$PMETAL_HOME/psk``); without any, nodes are listed
with their tags and no verdict.

Exit status: 0 when some pmetal node was seen, 1 when none was (the hints
printed then say what usually hides nodes), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pmetal.cli.daemon import PSK_FILE, _read_node_file
from pmetal.config import DiscoveryConfig, load_config, pmetal_home
from pmetal.errors import ConfigError
from pmetal.security import NetworkNamespace
from pmetal.wire import PROTOCOL_VERSION

if TYPE_CHECKING:  # zeroconf takes 80 ms to import: only 'pmetal discover' pays it
    from pmetal.cluster.discovery import DiscoveredPeer, IgnoredPeer, Interfaces

HINTS = (
    "is a node running on the other machines ('pmetal start'), without --no-discovery?",
    "macOS: System Settings > Privacy & Security > Local Network must allow your terminal "
    "(and Python); without it multicast is dropped silently",
    "several interfaces, or a VPN (many block the local network): pass --interfaces with "
    "this machine's LAN address, e.g. --interfaces 192.168.1.20",
    "a firewall must let mDNS (UDP port 5353, multicast 224.0.0.251) in and out",
    "Wi-Fi access points with 'client isolation' (guest networks) block it too",
    "static peers always work: pmetal start --peers HOST:PORT (discovery is not needed)",
)


def _discover_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=3.0, metavar="S",
                        help="how long to listen, in seconds (default 3)")
    parser.add_argument("--interfaces", default=None, metavar="A,B",
                        help="IPv4 addresses of the interfaces to listen on (default: "
                             "discovery.interfaces, else every IPv4 interface)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _run_discover(args: argparse.Namespace) -> int:
    from pmetal.cluster.discovery import browse

    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be positive, not {args.timeout}")
    configured = load_config().discovery.interfaces
    if args.interfaces is not None:
        configured = DiscoveryConfig(interfaces=args.interfaces).interfaces  # validates
    chosen = [p.strip() for p in configured.split(",") if p.strip()]
    interfaces: Interfaces = chosen or "all"
    namespace = _namespace()
    peers, ignored = browse(namespace, interfaces, args.timeout)
    report = _report(interfaces, args.timeout, namespace, peers, ignored)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0 if report["nodes"] else 1


def _namespace() -> NetworkNamespace | None:
    """The namespace to judge nodes by, or None when this machine has no PSK."""
    home = pmetal_home()
    cfg = load_config()
    security = cfg.security
    node = _read_node_file(home)
    if node is not None:
        security = replace(security, namespace=node.get("namespace") or security.namespace,
                           psk_file=node.get("psk_file") or security.psk_file)
    elif not security.psk_file and not os.environ.get("PMETAL_PSK") \
            and (home / PSK_FILE).exists():
        security = replace(security, psk_file=str(home / PSK_FILE))
    try:
        return NetworkNamespace.resolve(security)
    except ConfigError:
        return None


def _report(interfaces: Interfaces, timeout: float, namespace: NetworkNamespace | None,
            peers: list[DiscoveredPeer], ignored: list[IgnoredPeer]) -> dict[str, Any]:
    nodes: list[dict[str, Any]] = [
        {"node_id": p.node_id, "address": p.address,
         "namespace_match": None if namespace is None else True, "reason": "",
         "namespace_tag": p.namespace_tag, "version": p.version,
         "incarnation": p.incarnation, "resources": p.resources} for p in peers]
    nodes += [{"node_id": p.node_id, "address": p.address, "namespace_match": False,
               "reason": p.reason} for p in ignored]
    return {"interfaces": interfaces if interfaces == "all" else list(interfaces),
            "timeout": timeout,
            "namespace": None if namespace is None else namespace.name,
            "namespace_tag": None if namespace is None else namespace.tag.hex(),
            "protocol_version": PROTOCOL_VERSION,
            "nodes": sorted(nodes, key=lambda n: n["node_id"]),
            "hints": [] if nodes else list(HINTS)}


def _resources(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v / (1 << 30):.1f} GiB" if k == "memory" else f"{k} {v:g}"
                     for k, v in resources.items())


def _print(report: dict[str, Any]) -> None:
    where = ("every IPv4 interface" if report["interfaces"] == "all"
             else ", ".join(report["interfaces"]))
    if report["namespace"] is None:
        ours = "no PSK here: nodes are listed without a verdict (set PMETAL_PSK or run 'pmetal start')"
    else:
        ours = f"namespace {report['namespace']!r}, tag {report['namespace_tag']}"
    if not report["nodes"]:
        print(f"no pmetal node answered on {where} within {report['timeout']:g} s. Check:")
        for hint in report["hints"]:
            print(f"  - {hint}")
        return
    print(f"pmetal nodes seen on {where} in {report['timeout']:g} s ({ours}):")
    rows = [("NODE", "ADDRESS", "VERSION", "RESOURCES", "JOINABLE")]
    for n in report["nodes"]:
        verdict = {True: "yes", None: "?", False: f"no: {n['reason']}"}[n["namespace_match"]]
        rows.append((n["node_id"], n["address"], str(n.get("version", "-")),
                     _resources(n["resources"]) if "resources" in n else "-", verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4])
