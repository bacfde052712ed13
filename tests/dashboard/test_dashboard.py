"""A node's dashboard on loopback, with actors, in headless Chromium.

A node daemon on 127.0.0.1 (no root needed) serves its dashboard on a free
port; a driver creates three actors: one alive, one restarted after its
process died, one whose constructor raised. The page's actor table shows
each one's state, restarts and last error. The JSON APIs and the loopback
rules are checked with plain HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster.lab import ROOT, read_line

from dashboard.browser import screenshot, text, wait_for
from pmetal.actors.client import CoreClient
from pmetal.config import load_config
from pmetal.endpoint import Channel
from pmetal.errors import HandshakeError, PMetalError
from pmetal.identity import NodeIdentity
from pmetal.node.daemon import read_ready_line
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport

SECRET = "dashboard-test-psk-0123456789abcdef"
WAIT = 15.0

DRIVER = r"""
import json, os, sys, time
import pmetal

pmetal.init(address=sys.argv[1], psk=sys.argv[2])

@pmetal.remote
class Counter:
    def __init__(self):
        self.n = 0
    def incr(self):
        self.n += 1
        return self.n

@pmetal.remote(max_restarts=1)
class Phoenix:
    def pid(self):
        return os.getpid()
    def crash(self):
        os._exit(1)

@pmetal.remote
class Loader:
    def __init__(self):
        raise FileNotFoundError("no model file at /models/missing.gguf")
    def ping(self):
        return 1

counter = Counter.options(name="counter").remote()
assert pmetal.get(counter.incr.remote(), timeout=20) == 1
phoenix = Phoenix.options(name="phoenix").remote()
first = pmetal.get(phoenix.pid.remote(), timeout=20)
phoenix.crash.remote()
deadline = time.monotonic() + 20
while True:   # the restarted actor answers from a new process
    try:
        if pmetal.get(phoenix.pid.remote(), timeout=5) != first:
            break
    except pmetal.exceptions.PMetalError:
        pass
    assert time.monotonic() < deadline, "the actor did not restart"
try:   # the constructor's exception comes back to the creator
    Loader.options(name="loader").remote()
except Exception as exc:
    print(json.dumps({"step": "actors", "loader": type(exc).__name__}), flush=True)
sys.stdin.read()   # the actors live as long as their owner
"""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(node address, dashboard URL) of a node daemon on loopback, shared by
    the module's tests."""
    tmp_path = tmp_path_factory.mktemp("node")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    env.update(PMETAL_HOME=str(tmp_path), PMETAL_PSK=SECRET, PMETAL_METRICS_PORT="0",
               PYTHONPATH=str(ROOT))
    with (tmp_path / "node.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pmetal.node", "--host", "127.0.0.1",
                                 "--port", "0", "--num-workers", "2",
                                 "--num-task-workers", "1"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                env=env, cwd=ROOT)
    try:
        address = read_ready_line(proc, WAIT).split()[1]
        config = load_config(env={})
        client = CoreClient(address, NetworkNamespace.resolve(config.security, SECRET), config)
        try:
            # Until its listener is open and it elected itself (a moment after
            # the ready line, longer on a loaded machine).
            deadline = time.monotonic() + WAIT
            while (metrics := (status := client.status())["metrics"])["state"] != "on" \
                    or not status["cluster"]["master"]:
                assert metrics["state"] in ("starting", "on"), metrics
                assert time.monotonic() < deadline, f"not ready: {metrics}, {status['cluster']}"
                time.sleep(0.05)
        finally:
            client.close()
        yield address, metrics["address"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        print((tmp_path / "node.log").read_text(errors="replace")[-2000:])


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_apis_and_the_loopback_rules(node: tuple[str, str]) -> None:
    address, url = node
    status, body = get(url + "/api/cluster")
    assert status == 200
    snap = json.loads(body)
    assert snap["node_id"] == snap["master"] and snap["role"] == "master"
    assert [m["health"] for m in snap["machines"]] == ["self"]
    assert snap["machines"][0]["address"] == address
    assert [e["kind"] for e in snap["events"]] == ["join", "election"]   # newest first
    assert snap["telemetry"] is None or "pipelines" in snap["telemetry"]
    # A page of another site cannot reach it by naming 127.0.0.1 with its own host name.
    port = url.rpartition(":")[2]
    assert get(url + "/api/cluster", {"Host": f"rebind.example:{port}"})[0] == 403
    assert get(url + "/api/cluster", {"Host": f"localhost:{port}"})[0] == 200
    # The event stream: a snapshot at once.
    with urllib.request.urlopen(url + "/api/events", timeout=5) as stream:
        assert stream.headers["Content-Type"] == "text/event-stream"
        lines = [stream.readline() for _ in range(4)]
    assert lines[:3] == [b"retry: 1000\n", b"\n", b"event: snapshot\n"]
    assert json.loads(lines[3].removeprefix(b"data: "))["node_id"] == snap["node_id"]
    status, page = get(url + "/")
    assert status == 200 and b'<svg id="topology"' in page and b'href="/chat"' in page


def test_a_refused_handshake_is_in_the_event_log(node: tuple[str, str]) -> None:
    """A peer that gets through CURVE (the namespace's transport keys) but
    cannot prove the PSK in pmetal's handshake."""
    address, url = node
    config = load_config(env={}, transport={"handshake_timeout": 2.0,
                                            "connect_timeout": 2.0})
    real = NetworkNamespace.resolve(config.security, SECRET)
    transport = ZmqTransport(config.transport, curve=real.curve_keys())
    intruder = Channel(transport.dial(address), NodeIdentity.generate(),
                       NetworkNamespace(real.name, b"not the cluster's psk at all"), config)
    try:
        with pytest.raises(HandshakeError):
            intruder.open()
    finally:
        intruder.close()
    events = json.loads(get(url + "/api/cluster")[1])["events"]
    refusals = [e for e in events if e["kind"] == "refusal"
                and e["detail"].startswith("handshake refused: ")]
    assert len(refusals) == 1 and refusals[0]["count"] == 1


def test_a_stranger_without_the_namespace_keys_is_in_the_event_log(
        node: tuple[str, str]) -> None:
    """A peer with other CURVE keys is refused inside ZeroMQ, before
    pmetal's handshake; the node's monitor of its socket records it."""
    address, url = node
    config = load_config(env={}, transport={"connect_timeout": 2.0})
    other = NetworkNamespace("default", b"another namespace's psk, 32+ bytes")
    stranger = Channel(ZmqTransport(config.transport, curve=other.curve_keys()).dial(address),
                       NodeIdentity.generate(), other, load_config(
                           env={}, transport={"handshake_timeout": 1.0}))
    try:
        with pytest.raises(PMetalError):
            stranger.open()
    finally:
        stranger.close()

    def refused() -> list[dict[str, Any]]:
        events = json.loads(get(url + "/api/cluster")[1])["events"]
        return [e for e in events if e["kind"] == "refusal" and "CURVE" in e["detail"]]
    deadline = time.monotonic() + WAIT   # the monitor's event comes on its own
    while not (found := refused()):
        assert time.monotonic() < deadline, "no CURVE refusal in the event log"
        time.sleep(0.05)
    assert found[0]["detail"].startswith("a stranger refused by ZeroMQ's CURVE handshake")


def test_actors_their_restarts_and_last_error_on_the_page(
        node: tuple[str, str], browser: Callable[..., Any], tmp_path: Path) -> None:
    address, url = node
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    env.update(PMETAL_HOME=str(tmp_path), PYTHONPATH=str(ROOT))
    with (tmp_path / "driver.log").open("wb") as log:
        driver_proc = subprocess.Popen([sys.executable, "-c", DRIVER, address, SECRET],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=log, env=env, cwd=ROOT)
    try:
        assert read_line(driver_proc, 60, "actors")["loader"] == "RemoteError(FileNotFoundError)"
        page = browser()
        page.get(url + "/")

        def rows(d: Any) -> dict[str, dict[str, str]]:
            return {r["name"]: r for r in d.execute_script(
                "return [...document.querySelectorAll('#actor-table tbody tr')].map(tr => ({"
                "name: tr.cells[0].textContent, state: tr.dataset.state,"
                "restarts: tr.cells[4].textContent, error: tr.cells[7].textContent}))")}
        table = wait_for(page, lambda d: len(r := rows(d)) == 3 and r, WAIT, "three actors")
        assert table["counter"]["state"] == "alive" and table["counter"]["restarts"] == "0"
        assert table["phoenix"]["state"] == "alive" and table["phoenix"]["restarts"] == "1"
        assert table["loader"]["state"] == "dead"
        assert "no model file at /models/missing.gguf" in table["loader"]["error"]
        card = text(page, "#machine-cards .card.self")
        assert "counter" in card and "phoenix" in card and "2 alive" in card
        empty = text(page, "#pipeline-list")
        assert empty.startswith("no pipeline has run on this node")
        screenshot(page, "dashboard-actors", full_page=True)
    finally:
        driver_proc.kill()
        driver_proc.wait(timeout=10)
        print((tmp_path / "driver.log").read_text(errors="replace")[-3000:])
