"""What measuring a node's capacity for pipeline placement costs.

    python -m benchmarks capacity

Each run starts one node daemon on 127.0.0.1 (its own home, a fresh PSK)
and times (1) its ready line after the spawn: the compute meter does no
work at start, so this is a node's start as before; (2) a client's first
``status(measure=True)``, which measures the compute rate (0.25 s on every
CPU) and reads the free memory; (3) a second one, answered from the meter's
cache (the status round trip). Medians of several runs; the runs are
sequential, so nothing else of pmetal competes with the measurement.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks.common import median, table

DEADLINE = 30.0


def _run(home: str) -> dict[str, float]:
    from pmetal.actors.client import CoreClient
    from pmetal.config import load_config
    from pmetal.node.process import read_ready_line
    from pmetal.security import NetworkNamespace

    os.makedirs(home)
    psk = secrets.token_hex(24)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    env.update(PMETAL_PSK=psk, PMETAL_HOME=home)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pmetal.node", "--host", "127.0.0.1",
                             "--port", "0", "--num-workers", "1", "--num-task-workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, env=env)
    try:
        line = read_ready_line(proc, DEADLINE)
        ready = time.perf_counter() - start
        config = load_config()
        client = CoreClient(line.split()[1], NetworkNamespace.resolve(config.security, psk),
                            config)
        try:
            t = time.perf_counter()
            client.status(measure=True)
            first = time.perf_counter() - t
            t = time.perf_counter()
            client.status(measure=True)
            cached = time.perf_counter() - t
        finally:
            client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"ready": ready, "first": first, "cached": cached}


def main(quick: bool = False) -> dict[str, float]:
    runs = 2 if quick else 5
    with tempfile.TemporaryDirectory(prefix="pmetal-bench-capacity-") as home:
        results = [_run(os.path.join(home, f"run{i}")) for i in range(runs)]
    med = {k: median([r[k] for r in results]) for k in results[0]}
    rows = [["spawn to the node's ready line", "ready"],
            ["first status(measure=True): the compute rate measured", "first"],
            ["next status(measure=True): from the meter's cache", "cached"]]
    print(table(f"Measuring a node's capacity (seconds, median of {runs} runs)",
                ["measure", "median", "min", "max"],
                [[name, med[k], min(r[k] for r in results), max(r[k] for r in results)]
                 for name, k in rows]))
    return med


if __name__ == "__main__":
    main()
