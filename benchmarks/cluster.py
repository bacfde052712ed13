"""How fast the cluster forms and heals: discovery, election, failure
detection and re-election, with the default settings.

    python -m benchmarks cluster

Each run starts three node daemons at once on their own loopback addresses
(127.0.0.11-13: mDNS on those addresses only, a fresh PSK per run, so
nothing is sent beyond this machine and no other cluster answers), then:

1. *discover*: when each node first heard of each other node, after its own
   start (the slowest pair of the run);
2. *elect*: from the last node's ready line to all three naming one master
   (the bootstrap window, ``election.bootstrap``, is most of it);
3. *re-elect*: ``kill -9`` of the master's process group to both survivors
   naming one new master;
4. *rejoin*: the killed node started again to all three agreeing again;
5. *detect*: ``kill -9`` of a follower to both survivors holding it dead.

Medians of several runs, with the seed crate's defaults for comparison (its
health check declares a peer unhealthy after 3 missed heartbeats 5 s apart;
its election timeout is 3 s).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import median, table

HOSTS = ["127.0.0.11", "127.0.0.12", "127.0.0.13"]
PORT = 7300
DEADLINE = 30.0
SEED_DETECT = 15.0    # s: 3 missed heartbeats 5 s apart
SEED_ELECTION = 3.0   # s: the seed crate's election timeout


class _Node:
    def __init__(self, host: str, psk: bytes, home: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
        env.update(PMETAL_HOME=home, PMETAL_PSK_HEX=psk.hex())
        self.host = host
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pmetal.node", "--host", host, "--port", str(PORT),
             "--discovery", "--interfaces", host, "--num-workers", "1",
             "--num-task-workers", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True)
        self.address = self.node_id = ""
        self.ready = 0.0
        self.client: Any = None

    def wait_ready(self, psk: bytes) -> None:
        from pmetal.actors.client import CoreClient
        from pmetal.node.daemon import read_ready_line
        from pmetal.config import load_config
        from pmetal.security import NetworkNamespace
        _head, self.address, self.node_id = read_ready_line(self.proc, DEADLINE).split()[:3]
        self.ready = time.monotonic()
        self.client = CoreClient(self.address, NetworkNamespace("default", psk), load_config())

    def state(self) -> Any:
        return self.client.watch.state

    def kill(self) -> None:
        self.client.close()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.client.close()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def _until(cond: Callable[[], bool], what: str) -> float:
    """When ``cond()`` first held (time.monotonic), polled every 2 ms."""
    deadline = time.monotonic() + DEADLINE
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"cluster benchmark: {what} not within {DEADLINE:g} s")
        time.sleep(0.002)
    return time.monotonic()


def _agreed(nodes: list[_Node], exclude: str = "") -> bool:
    states = [n.state() for n in nodes]
    if any(s is None or not s.master or s.master == exclude for s in states):
        return False
    return len({(s.master, s.term) for s in states}) == 1 and all(
        len(s.members) == len(nodes) for s in states)


def _run(home: str) -> dict[str, float]:
    psk = secrets.token_bytes(32)
    nodes = [_Node(h, psk, os.path.join(home, f"n{i}")) for i, h in enumerate(HOSTS)]
    try:
        for n in nodes:
            n.wait_ready(psk)
        elected = _until(lambda: _agreed(nodes), "an agreed master")
        out = {"elect": elected - max(n.ready for n in nodes)}
        slowest = 0.0
        for n in nodes:
            found = n.client.status()["cluster"]["found"]
            others = [o.node_id for o in nodes if o is not n]
            slowest = max(slowest, *(found.get(o, DEADLINE) for o in others))
        out["discover"] = slowest
        master = next(n for n in nodes if n.node_id == nodes[0].state().master)
        rest = [n for n in nodes if n is not master]
        master.kill()
        killed = time.monotonic()
        out["reelect"] = _until(lambda: _agreed(rest, exclude=master.node_id)
                                and len({n.state().master for n in rest}) == 1,
                                "a new master") - killed
        # The old master's host comes back (a new process, a new incarnation).
        back = _Node(master.host, psk, os.path.join(home, "back"))
        back.wait_ready(psk)
        nodes = [*rest, back]
        out["rejoin"] = _until(lambda: _agreed(nodes), "the rejoin") - back.ready
        follower = next(n for n in nodes if n.node_id != nodes[0].state().master)
        rest = [n for n in nodes if n is not follower]
        follower.kill()
        killed = time.monotonic()
        out["detect"] = _until(lambda: all(follower.node_id in n.state().dead for n in rest),
                               "the follower dead on every survivor") - killed
        return out
    finally:
        for n in nodes:
            n.stop()


def main(quick: bool = False) -> dict[str, float]:
    runs = 2 if quick else 5
    results: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="pmetal-bench-cluster-") as home:
        for i in range(runs):
            results.append(_run(os.path.join(home, f"run{i}")))
    med = {k: median([r[k] for r in results]) for k in results[0]}
    span = {k: (min(r[k] for r in results), max(r[k] for r in results)) for k in results[0]}
    rows = [
        ["discover every other node, after a node's start", "discover", "-", "< 2"],
        ["elect one master, after the last node's ready line", "elect", "-", "-"],
        ["kill -9 of the master to a new master on both survivors", "reelect",
         f">= {SEED_DETECT + SEED_ELECTION:g} (detect + election timeout)", "< 2"],
        ["a restarted node agreed on again, after its ready line", "rejoin", "-", "-"],
        ["kill -9 of a follower to Dead on both survivors", "detect",
         f"{SEED_DETECT:g} (3 missed 5 s heartbeats)", "< 1"],
    ]
    print(table(f"Cluster formation and failure, 3 nodes on 127.0.0.11-13 with mDNS "
                f"(seconds, median of {runs} runs)",
                ["measure", "pmetal", "min", "max", "seed crate defaults", "target"],
                [[name, med[k], span[k][0], span[k][1], seed, target]
                 for name, k, seed, target in rows]))
    return med


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
