"""The master schedules: placements stamped with its term, stale terms
refused, and a master lost in the middle of a decision costing neither the
creation nor a second copy of the actor.

Three node daemons on loopback (static peers, no discovery), a driver in
this process connected to one of them.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pmetal
from pmetal.actors.client import CoreClient
from pmetal.node.daemon import read_ready_line
from pmetal.config import load_config
from pmetal.security import NetworkNamespace
from pmetal.wire import CreateActor, Failure

ROOT = Path(__file__).resolve().parents[2]
WAIT = 20.0


@pytest.fixture
def three(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[dict[str, Any]]]:
    """Three node daemons on loopback, static peers of each other; a test
    module's ``NODE_ENV`` (if any) is added to their environment."""
    psk = secrets.token_bytes(32)
    import socket
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    nodes = []
    try:
        for i, port in enumerate(ports):
            home = tmp_path / f"n{i}"
            home.mkdir(mode=0o700)
            env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
            # A short bootstrap (default 2 s): the three start together and
            # know each other as static peers, so they hear from each other
            # at once (as in test_placement_throttled); nothing here
            # restarts a node or merges two clusters.
            env.update(PMETAL_HOME=str(home), PMETAL_PSK_HEX=psk.hex(),
                       PYTHONPATH=os.pathsep.join((str(ROOT), str(ROOT / "tests"))),
                       PMETAL_LOG_LEVEL="INFO", PMETAL_ELECTION_BOOTSTRAP="0.5",
                       **getattr(request.module, "NODE_ENV", {}))
            peers = ",".join(f"127.0.0.1:{p}" for p in ports if p != port)
            proc = subprocess.Popen(
                [sys.executable, "-m", "pmetal.node", "--host", "127.0.0.1", "--port",
                 str(port), "--peers", peers, "--num-workers", "2", "--num-task-workers", "1"],
                stdout=subprocess.PIPE, stderr=(tmp_path / f"n{i}.log").open("wb"),
                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            nodes.append({"proc": proc, "port": port, "psk": psk})
        for node in nodes:
            _head, node["address"], node["node_id"] = read_ready_line(node["proc"], 30).split()[:3]
        yield nodes
    finally:
        if pmetal.is_initialized():
            pmetal.shutdown(timeout=3.0)
        for node in nodes:
            if node["proc"].poll() is None:
                os.killpg(node["proc"].pid, signal.SIGKILL)
            node["proc"].wait(timeout=10)


def client_of(node: dict[str, Any]) -> CoreClient:
    return CoreClient(node["address"], NetworkNamespace("default", node["psk"]), load_config())


def agreed_master(nodes: list[dict[str, Any]]) -> str:
    """The master every node names, once they agree (each node's cluster
    watch is woken by every change; one deadline for all)."""
    clients = [client_of(n) for n in nodes]
    try:
        def agreed(_: Any) -> bool:
            states = [c.watch.state for c in clients]
            return all(st is not None and st.master for st in states) and len(
                {(st.master, st.term) for st in states}) == 1  # type: ignore[union-attr]
        assert clients[0].watch.wait(agreed, time.monotonic() + WAIT), \
            f"no agreed master: {[c.watch.state for c in clients]}"
        return clients[0].watch.state.master  # type: ignore[union-attr]
    finally:
        for c in clients:
            c.close()


@pmetal.remote
class SlowStart:
    """Appends a line to ``path`` when its constructor starts, then takes a while."""

    def __init__(self, path: str, seconds: float) -> None:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(seconds)

    def ping(self) -> int:
        return os.getpid()


def test_a_stale_term_is_refused(three: list[dict[str, Any]]) -> None:
    agreed_master(three)
    client = client_of(three[0])
    try:
        term = client.status()["cluster"]["term"]
        spec = CreateActor("stale-1", "cls", "builtins:dict", [], {}, {
            "term": term - 1, "node": three[0]["node_id"], "owner_node": three[1]["node_id"],
            "class_name": "dict"})
        reply = client.request_node(spec, timeout=WAIT)
        assert isinstance(reply, Failure) and reply.error_type == "StaleTermError", reply
        assert f"current term is {term}" in reply.message
    finally:
        client.close()


def test_a_master_lost_mid_decision_creates_the_actor_once(three: list[dict[str, Any]],
                                                           tmp_path: Path) -> None:
    master_id = agreed_master(three)
    master = next(n for n in three if n["node_id"] == master_id)
    origin, target = [n for n in three if n is not master]
    pmetal.init(address=origin["address"], psk=origin["psk"],
                config=load_config(transport={"request_timeout": WAIT}))
    marks = tmp_path / "constructed"
    result: dict[str, Any] = {}

    def create() -> None:
        try:
            actor = SlowStart.options(node=target["node_id"]).remote(str(marks), 2.0)
            result["pid"] = pmetal.get(actor.ping.remote(), timeout=WAIT)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            result["error"] = exc

    creator = threading.Thread(target=create)
    creator.start()
    # The master's decision reached the target: its constructor runs. Now
    # the master dies, before it can answer the creator's node.
    deadline = time.monotonic() + WAIT
    while not (marks.exists() and marks.read_text()):
        assert time.monotonic() < deadline and "error" not in result, result
        time.sleep(0.01)
    os.killpg(master["proc"].pid, signal.SIGKILL)
    killed = time.monotonic()
    creator.join(WAIT + 5)
    assert not creator.is_alive(), "the creation hangs after the master died"
    assert "error" not in result, result
    print(f"\n[scheduler] creation answered {time.monotonic() - killed:.2f} s after the "
          f"master's death")
    # Constructed once, on the target, and that copy answers.
    assert marks.read_text().split() == [str(result["pid"])]
    client = client_of(target)
    try:
        copies = [a for a in client.status()["actors"] if a["class_name"] == "SlowStart"]
    finally:
        client.close()
    assert [a["state"] for a in copies] == ["alive"], copies
    new_master = agreed_master([origin, target])
    assert new_master != master_id


def test_an_embedded_node_joins_static_peers(three: list[dict[str, Any]]) -> None:
    pmetal.init(peers=[three[0]["address"]], psk=three[0]["psk"])
    peers = pmetal.wait_for_peers(3, timeout=WAIT)
    assert {n["node_id"] for n in three} <= set(peers)
    here = pmetal.api.client().node_id
    listed = pmetal.nodes()
    assert listed[0]["NodeID"] == here and len(listed) == 4
    assert sum(n["IsMaster"] for n in listed) == 1
    # Actors go where the master puts them, also from an embedded node.
    actor = SlowStart.options(node=three[1]["node_id"]).remote(os.devnull, 0.0)
    assert pmetal.get(actor.ping.remote(), timeout=WAIT) > 0
