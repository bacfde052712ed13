"""Every node serves /metrics (pmetal.node.metrics, docs/observability.md).

Real nodes on loopback with ``metrics.port`` 0: an embedded node that the
tests load with actors, calls and a stranger, and two node daemons that
form a cluster. Each scrape is an HTTP GET with urllib, parsed with
prometheus_client's own parser; the values are checked against what the
test did.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import pmetal
from pmetal import HandshakeError, NetworkNamespace, api
from pmetal.actors.client import CoreClient
from pmetal.config import load_config
from pmetal.endpoint import Channel
from pmetal.errors import ConfigError
from pmetal.identity import NodeIdentity
from pmetal.transport import ZmqTransport

from .actor_classes import Counter, fail
from .conftest import (
    WAIT,
    await_restart,
    free_port,
    read_line,
    shutdown_quietly,
    stop_process,
    wait_until,
    worker_of,
)

START_WAIT = 30.0
"""Deadline for a node daemon to print its ready line (a loaded 2-core box)."""

SECRET = "metrics-test-psk-0123456789-abcdefghijklmnop"


def scrape(address: str) -> dict[str, list[Any]]:
    """Every sample of ``address``/metrics by sample name."""
    with urllib.request.urlopen(f"{address}/metrics", timeout=WAIT) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    found = [s.value for s in samples.get(name, ()) if all(s.labels.get(k) == v
                                                            for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {found} in {sorted(samples)}"
    return float(found[0])





@pytest.fixture(scope="module")
def node() -> Iterator[dict[str, Any]]:
    """An embedded node with metrics on a free port; its status."""
    if pmetal.is_initialized():
        shutdown_quietly()
    pmetal.init(num_workers=2, psk=SECRET, config=load_config(env={}, metrics={"port": 0}))
    try:
        client = api.client()
        status = wait_status(client.status, lambda st: st["metrics"]["state"] != "starting"
                             and st["cluster"]["master"])
        yield status
    finally:
        shutdown_quietly()


def test_status_reports_the_bound_address(node: dict[str, Any],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    m = node["metrics"]
    assert m["enabled"] and m["state"] == "on", m
    host, port = m["address"].removeprefix("http://").rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    from pmetal.cli.status import _print_status
    _print_status(node, {"pid": node["pid"]})
    assert f"metrics    {m['address']}/metrics" in capsys.readouterr().out.splitlines()


def test_a_lone_node_is_its_own_master(node: dict[str, Any]) -> None:
    s = scrape(node["metrics"]["address"])
    assert value(s, "pmetal_cluster_members") == 1
    assert value(s, "pmetal_cluster_is_master") == 1
    assert value(s, "pmetal_cluster_master", master=node["node_id"][:16]) == 1
    assert value(s, "pmetal_cluster_term") >= 1
    assert value(s, "pmetal_elections_won_total") == 1
    assert value(s, "pmetal_peer_deaths_total") == 0
    if sys.platform == "linux":   # prometheus_client's ProcessCollector reads /proc
        assert value(s, "process_resident_memory_bytes") > 0
        assert "process_cpu_seconds_total" in s


def test_actors_by_state_and_calls_counted(node: dict[str, Any]) -> None:
    address = node["metrics"]["address"]
    before = scrape(address)
    created = value(before, "pmetal_actors_created_total")
    alive = value(before, "pmetal_actors", state="alive")
    dead = value(before, "pmetal_actors", state="dead")
    calls = value(before, "pmetal_actor_calls_total")
    failed = value(before, "pmetal_actor_calls_failed_total")
    actors = [Counter.remote() for _ in range(3)]
    assert pmetal.get([a.inc.remote() for a in actors], timeout=WAIT) == [1, 1, 1]
    assert pmetal.get([actors[0].inc.remote() for _ in range(197)], timeout=WAIT)[-1] == 198
    # Counted before a worker goes: the calls a worker served after the
    # last scrape that saw it are lost with it (docs/observability.md).
    assert value(scrape(address), "pmetal_actor_calls_total") == calls + 200
    for ref in (actors[1].boom.remote("boom"), actors[1].boom.remote("boom"),
                fail.remote("boom")):   # two methods and a remote function raise
        with pytest.raises(ValueError, match="boom"):
            pmetal.get(ref, timeout=WAIT)
    now = scrape(address)
    assert value(now, "pmetal_actor_calls_total") == calls + 203
    assert value(now, "pmetal_actor_calls_failed_total") == failed + 3
    pmetal.kill(actors[2])
    wait_until(lambda: value(scrape(address), "pmetal_actors", state="dead") == dead + 1,
               WAIT, what="the killed actor counted dead")
    after = scrape(address)
    assert value(after, "pmetal_actors_created_total") == created + 3
    assert value(after, "pmetal_actors", state="alive") == alive + 2
    assert value(after, "pmetal_actor_calls_total") == calls + 203   # kept once gone
    for a in actors[:2]:
        pmetal.kill(a)


def test_a_restart_is_counted(node: dict[str, Any]) -> None:
    address = node["metrics"]["address"]
    before = scrape(address)
    actor = Counter.options(max_restarts=1).remote()
    assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 1
    os.kill(worker_of(actor)["pid"], signal.SIGKILL)
    await_restart(actor, 1, WAIT)
    after = scrape(address)
    assert value(after, "pmetal_actor_restarts_total") == \
        value(before, "pmetal_actor_restarts_total") + 1
    assert value(after, "pmetal_actors_created_total") == \
        value(before, "pmetal_actors_created_total") + 1
    assert value(after, "pmetal_fenced_total") == 0
    pmetal.kill(actor)


def test_a_peer_without_the_psk_is_counted_refused(node: dict[str, Any],
                                                  zmq_context: Any) -> None:
    """A peer through the transport's CURVE layer (it holds the namespace's
    transport keys) that cannot prove the PSK: pmetal's handshake refuses
    it, and the node counts it. (A stranger without those keys is stopped
    inside ZeroMQ, where the node does not count it yet.)"""
    address = node["metrics"]["address"]
    refused = value(scrape(address), "pmetal_handshakes_refused_total")
    config = load_config(env={}, transport={"handshake_timeout": 2.0,
                                            "connect_timeout": 2.0})
    insider = NetworkNamespace(node["namespace"], SECRET.encode())
    transport = ZmqTransport(config.transport, zmq_context, curve=insider.curve_keys())
    intruder = Channel(transport.dial(node["address"]), NodeIdentity.generate(),
                       NetworkNamespace(node["namespace"], b"not the cluster's psk"), config)
    try:
        with pytest.raises(HandshakeError):
            intruder.open()
    finally:
        intruder.close()
    assert value(scrape(address), "pmetal_handshakes_refused_total") == refused + 1


def test_a_taken_port_leaves_the_node_up_without_metrics(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with started(tmp_path, {"PMETAL_METRICS_PORT": str(port)}) as (_, status):
            m = wait_status(status, lambda s: s["metrics"]["state"] != "starting")
            assert m["metrics"]["state"] == "off" and not m["metrics"]["enabled"]
            assert str(port) in m["metrics"]["reason"]
    log = (tmp_path / "node.log").read_text()
    warnings = [line for line in log.splitlines() if "metrics are off" in line]
    assert len(warnings) == 1 and f":{port}" in warnings[0] and "metrics.port" in warnings[0], log


def test_disabled_serves_nothing(tmp_path: Path) -> None:
    with started(tmp_path, {"PMETAL_METRICS_ENABLED": "false"}) as (_, status):
        m = status()["metrics"]
        assert m == {"enabled": False, "state": "disabled", "address": "",
                     "reason": "metrics.enabled is false", "scrapes": 0}


def test_two_nodes_agree_on_members_and_master(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    homes = [tmp_path / "a", tmp_path / "b"]
    env = {"PMETAL_METRICS_PORT": "0", "PMETAL_ELECTION_BOOTSTRAP": "0.3"}
    a, b = started(homes[0], env, ports[0], ports[1]), started(homes[1], env, ports[1], ports[0])
    try:
        with a as (_, sa), b as (_, sb):
            both = [wait_status(s, lambda x: len(x["cluster"]["members"]) == 2 and
                                x["cluster"]["master"] and x["metrics"]["state"] == "on")
                    for s in (sa, sb)]
            master = both[0]["cluster"]["master"]

            def agreed() -> bool:
                scrapes = [scrape(s["metrics"]["address"]) for s in both]
                return all(value(x, "pmetal_cluster_members") == 2 and
                           value(x, "pmetal_cluster_master", master=master[:16]) == 1
                           for x in scrapes)
            wait_until(agreed, WAIT, what="both nodes scrape 2 members and one master")
            scrapes = [scrape(s["metrics"]["address"]) for s in both]
            assert sum(value(x, "pmetal_cluster_is_master") for x in scrapes) == 1
            for x, other in zip(scrapes, reversed(both)):
                peer = other["node_id"][:16]
                assert sum(value(x, "pmetal_peer_health", peer=peer, state=st)
                           for st in ("healthy", "degraded", "suspect", "dead")) == 1
            wait_until(lambda: all(
                value(scrape(s["metrics"]["address"]), "pmetal_peer_rtt_seconds",
                      peer=o["node_id"][:16]) > 0 for s, o in zip(both, reversed(both))),
                WAIT, what="a round trip measured to each peer")
            assert "pmetal_link_bandwidth_bytes_per_second" not in scrapes[0]
            a.client.status(probe=True)   # measures the links from a
            probed = scrape(both[0]["metrics"]["address"])
            assert value(probed, "pmetal_link_bandwidth_bytes_per_second",
                         peer=both[1]["node_id"][:16]) > 0
            winner = next(x for x in scrapes if value(x, "pmetal_cluster_is_master") == 1)
            assert value(winner, "pmetal_elections_won_total") >= 1

            # b dies: a's detector declares it dead, once.
            b_id = both[1]["node_id"][:16]
            b.proc.kill()

            def declared_dead() -> bool:
                x = scrape(both[0]["metrics"]["address"])
                return value(x, "pmetal_peer_deaths_total") == 1 and all(
                    h.value == (h.labels["state"] == "dead")   # while a still watches b
                    for h in x.get("pmetal_peer_health", ()) if h.labels["peer"] == b_id)
            wait_until(declared_dead, WAIT, what="a scrape of a counting b's death")
    finally:   # b, when a never became ready
        for n in (a, b):
            stop_process(n.proc)


def test_a_config_typo_is_the_config_error() -> None:
    with pytest.raises(ConfigError, match="PMETAL_METRICS_PROT"):
        load_config(env={"PMETAL_METRICS_PROT": "0"})
    with pytest.raises(ConfigError, match="unknown setting metrics.prot"):
        load_config(env={}, metrics={"prot": 0})
    with pytest.raises(ConfigError, match="metrics.port"):
        load_config(env={}, metrics={"port": 70000})


def test_any_host_loads_and_an_empty_one_is_the_config_error() -> None:
    # Beyond loopback the listener asks for the namespace's token
    # (tests/dashboard/test_auth_lab.py); an empty host is a mistake.
    assert load_config(env={}, metrics={"host": "10.1.2.3"}).metrics.host == "10.1.2.3"
    assert load_config(env={}, metrics={"host": "127.0.0.2"}).metrics.host == "127.0.0.2"
    with pytest.raises(ConfigError, match="metrics.host"):
        load_config(env={}, metrics={"host": " "})


# ------------------------------------------------------------ node daemons

class started:
    """``python -m pmetal.node`` on loopback with ``env`` (and a static
    peer), stopped on exit; yields (process, a function returning its
    status)."""

    def __init__(self, home: Path, env: dict[str, str], port: int = 0, peer: int = 0) -> None:
        """Starts the process (``__enter__`` waits for its ready line, so
        several start side by side)."""
        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        env = {**{k: v for k, v in os.environ.items()
                  if not k.startswith("PMETAL_") or k == "PMETAL_LOG_LEVEL"},
               "PMETAL_PSK": SECRET, "PMETAL_HOME": str(home), **env}
        cmd = [sys.executable, "-m", "pmetal.node", "--host", "127.0.0.1",
               "--port", str(port), "--num-workers", "1", "--num-task-workers", "1"]
        if peer:
            cmd += ["--peers", f"127.0.0.1:{peer}"]
        with open(home / "node.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=log, env=env)

    def __enter__(self) -> tuple[subprocess.Popen[bytes], Any]:
        line = read_line(self.proc, START_WAIT, "node")
        address = line.split()[1]
        config = load_config(env={})
        self.client = CoreClient(address, NetworkNamespace.resolve(config.security, SECRET),
                                 config)
        return self.proc, self.client.status

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        stop_process(self.proc)


def wait_status(status: Any, done: Any) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def check() -> bool:
        found[:] = [status()]
        return bool(done(found[0]))
    wait_until(check, WAIT, what="the node's status")
    return found[0]
