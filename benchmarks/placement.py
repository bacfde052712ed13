"""Placement groups and tasks with a scheduling strategy, on three nodes.

    python -m benchmarks placement

Three node daemons on their own loopback addresses (127.0.0.21-23, static
peers, a fresh PSK; nothing leaves this machine) and a driver in this
process connected to the first. It measures:

1. a remote function's round trip ``get(f.remote(1))`` without a strategy
   (the caller's node's task workers: the path a strategy must not slow
   down), with a node affinity to the caller's node and to another node
   (the task goes to that node's task worker directly), and with SPREAD
   (the three nodes in turn);
2. a STRICT_SPREAD placement group of three ``{"CPU": 1}`` bundles, from
   ``placement_group()`` to ``pg.wait()`` returning True (one plan, three
   reserves in parallel), and ``remove_placement_group`` (three releases);
3. an actor created in a bundle on another node, to its first call.

Medians; ``--quick`` takes fewer samples.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import median, table

HOSTS = ["127.0.0.21", "127.0.0.22", "127.0.0.23"]
PORT = 7310
DEADLINE = 30.0


def _start(home: str, psk: bytes) -> list[tuple[subprocess.Popen[bytes], str, str]]:
    from pmetal.node.daemon import read_ready_line
    procs = []
    for i, host in enumerate(HOSTS):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
        env.update(PMETAL_HOME=os.path.join(home, f"n{i}"), PMETAL_PSK_HEX=psk.hex())
        os.makedirs(env["PMETAL_HOME"], mode=0o700)
        peers = ",".join(f"{h}:{PORT}" for h in HOSTS if h != host)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pmetal.node", "--host", host, "--port", str(PORT),
             "--no-discovery", "--peers", peers, "--num-workers", "2",
             "--num-task-workers", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True))
    out = []
    for proc in procs:
        _head, address, node_id = read_ready_line(proc, DEADLINE).split()[:3]
        out.append((proc, address, node_id))
    return out


def _round_trip(fn: Any, samples: int) -> float:
    import pmetal
    pmetal.get([fn.remote(1) for _ in range(20)], timeout=DEADLINE)   # workers known, warm
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        pmetal.get(fn.remote(1), timeout=DEADLINE)
        times.append(time.perf_counter() - t)
    return median(times) * 1e6


def _measure(nodes: list[tuple[Any, str, str]], psk: bytes, quick: bool) -> list[list[Any]]:
    import pmetal
    from pmetal.util import placement_group, remove_placement_group
    from pmetal.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
    from pmetal.util.scheduling_strategies import PlacementGroupSchedulingStrategy as InGroup

    pmetal.init(address=nodes[0][1], psk=psk)
    try:
        if not pmetal.wait_for_peers(2, timeout=DEADLINE):
            raise TimeoutError("placement benchmark: the three nodes did not meet")

        @pmetal.remote
        def f(x: Any) -> Any:
            return x

        @pmetal.remote
        class Probe:
            def ping(self) -> int:
                return 1

        samples = 200 if quick else 1000
        here, there = nodes[0][2], nodes[1][2]
        rows: list[list[Any]] = [
            ["task round trip, no strategy (us)", _round_trip(f, samples)],
            ["task round trip, affinity to the caller's node (us)",
             _round_trip(f.options(scheduling_strategy=On(here)), samples)],
            ["task round trip, affinity to another node (us)",
             _round_trip(f.options(scheduling_strategy=On(there)), samples)],
            ["task round trip, SPREAD over 3 nodes (us)",
             _round_trip(f.options(scheduling_strategy="SPREAD"), samples)]]
        created, removed, actors = [], [], []
        for _ in range(5 if quick else 20):
            t = time.perf_counter()
            pg = placement_group([{"CPU": 1}] * 3, strategy="STRICT_SPREAD")
            if not pg.wait(DEADLINE):
                raise TimeoutError("placement benchmark: a STRICT_SPREAD group was not created")
            created.append(time.perf_counter() - t)
            index = next(i for i, n in enumerate(pmetal.util.placement_group_table(pg)[
                "bundles_to_node_id"].values()) if n == there)
            t = time.perf_counter()
            probe = Probe.options(num_cpus=1, scheduling_strategy=InGroup(pg, index)).remote()
            pmetal.get(probe.ping.remote(), timeout=DEADLINE)
            actors.append(time.perf_counter() - t)
            t = time.perf_counter()
            remove_placement_group(pg)
            removed.append(time.perf_counter() - t)
        rows += [["STRICT_SPREAD group of 3 bundles: create to ready (ms)", median(created) * 1e3],
                 ["actor in a bundle on another node: create + first call (ms)",
                  median(actors) * 1e3],
                 ["remove_placement_group (ms, its actor ends)", median(removed) * 1e3]]
        return rows
    finally:
        pmetal.shutdown()


def main(quick: bool = False) -> dict[str, float]:
    psk = secrets.token_bytes(32)
    with tempfile.TemporaryDirectory() as home:
        nodes = _start(home, psk)
        try:
            rows = _measure(nodes, psk, quick)
        finally:
            for proc, _, _ in nodes:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc, _, _ in nodes:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
    print(table("Placement groups and placed tasks (3 nodes on loopback)", ["measure", "median"],
                rows))
    return {str(name): float(value) for name, value in rows}
