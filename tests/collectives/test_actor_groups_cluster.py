"""A collective group whose actors live on two node daemons of one cluster
(both on 127.0.0.1, each with its own identity): the rendezvous actor is
found by name from the other node, the members connect across nodes, and a
member killed on one node fails the survivors on both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import pmetal
from pmetal import CollectiveError, collective
from pmetal.config import CollectiveConfig, load_config

from .group_actors import Member
from .test_actor_groups import _pid_gone

SECRET = "collective-groups-test-psk-0123456789-abcdef"
START_WAIT = 30.0
WAIT = 20.0
DEATH_WAIT = 10.0
CONFIG = CollectiveConfig(timeout=3 * DEATH_WAIT, connect_timeout=WAIT)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_node(home: Path, port: int, peer: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PMETAL_") or k == "PMETAL_LOG_LEVEL"}
    tests_root = str(Path(__file__).resolve().parents[1])
    env.update(PMETAL_PSK=SECRET, PMETAL_HOME=str(home),
               PMETAL_TRANSPORT_REQUEST_TIMEOUT="8",
               PYTHONPATH=os.pathsep.join(p for p in (tests_root, env.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "pmetal.node", "--host", "127.0.0.1", "--port",
           str(port), "--peers", f"127.0.0.1:{peer}", "--num-workers", "2",
           "--num-task-workers", "1"]
    with open(home / "node.log", "ab") as log:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=log, env=env)


def _ready_line(proc: subprocess.Popen[bytes]) -> list[str]:
    import selectors
    assert proc.stdout is not None
    deadline = time.monotonic() + START_WAIT
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ)
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            assert left > 0 and sel.select(left), f"no ready line within {START_WAIT} s"
            chunk = os.read(proc.stdout.fileno(), 1)
            assert chunk, f"the node exited with {proc.poll()} before its ready line"
            data += chunk
    words = data.decode().split()
    assert words[0] == "PMETAL_NODE_READY", words
    return words


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two node daemons peered with each other; the driver joins the first.
    Yields their node ids."""
    if pmetal.is_initialized():
        pmetal.shutdown(timeout=3.0)
    ports = [_free_port(), _free_port()]
    procs = [_start_node(tmp_path_factory.mktemp(f"node{i}"), ports[i], ports[1 - i])
             for i in range(2)]
    try:
        ids = [_ready_line(p)[2] for p in procs]
        pmetal.init(address=f"127.0.0.1:{ports[0]}", psk=SECRET,
                    config=load_config(transport={"request_timeout": 8.0}))
        pmetal.wait_for_peers(1, timeout=START_WAIT)
        yield ids
    finally:
        pmetal.shutdown(timeout=3.0)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)


def test_a_group_across_two_nodes_works_and_survives_a_kill(two_nodes: list[str]) -> None:
    first, second = two_nodes
    actors = [Member.options(node=node).remote() for node in (first, second, first, second)]
    name = "across"
    try:
        handle = collective.create_group(actors, name=name, config=CONFIG)
        # The master's node holds the rendezvous actor and stamped its term.
        master = [n for n in pmetal.nodes() if n["IsMaster"]]
        assert len(master) == 1
        rendezvous = pmetal.get_actor(f"pmetal-collective:{name}")
        assert rendezvous._node_id == master[0]["NodeID"]
        assert handle.term == pmetal.api.client().status()["cluster"]["term"] > 0
        # The ring crosses between the nodes twice, not four times: each
        # node's members side by side.
        order = handle.schedule.order
        assert {frozenset(order[:2]), frozenset(order[2:])} == {frozenset({0, 2}),
                                                                frozenset({1, 3})}, order
        assert pmetal.get([a.join.remote(name) for a in actors],
                          timeout=WAIT) == [(r, 4, 1) for r in range(4)]
        value = np.arange(100_000, dtype=np.float32)   # the ring (over 64 KiB)
        for result in pmetal.get([a.all_reduce.remote(name, value) for a in actors],
                                 timeout=WAIT):
            np.testing.assert_array_equal(result, value * 10)

        victim = actors[3]
        victim_pid = pmetal.get(victim.pid.remote(), timeout=WAIT)
        spins = [a.spin.remote(name, 1 << 18, 10**9) for a in actors]
        assert pmetal.get(victim.started.remote(), timeout=WAIT)
        os.kill(victim_pid, signal.SIGKILL)
        killed = time.monotonic()
        for ref in spins[:3]:
            with pytest.raises(CollectiveError):
                pmetal.get(ref, timeout=DEATH_WAIT)
        assert time.monotonic() - killed < DEATH_WAIT
        _pid_gone(victim_pid, WAIT)

        survivors = actors[:3]
        assert collective.create_group(survivors, name=name, config=CONFIG).epoch == 2
        assert pmetal.get([a.join.remote(name) for a in survivors],
                          timeout=WAIT) == [(0, 3, 2), (1, 3, 2), (2, 3, 2)]
        for result in pmetal.get([a.all_reduce.remote(name, value) for a in survivors],
                                 timeout=WAIT):
            np.testing.assert_array_equal(result, value * 6)
    finally:
        collective.destroy_group(name)
        for actor in actors:
            try:
                pmetal.kill(actor)
            except pmetal.PMetalError:
                pass  # the killed one
