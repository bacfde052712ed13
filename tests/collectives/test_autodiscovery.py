"""AutoDiscoveryBackend: processes that know no node list find each
other through the cluster (real mDNS on distinct 127.0.0.N addresses,
explicit interfaces), take ranks from the master's member list and
all_reduce; a process killed mid all_reduce fails the others, and a new
formation over the survivors works."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

WAIT = 90.0  # bound on any one step: forming a cluster takes about 2 s

SCRIPT = textwrap.dedent('''
    import json, sys
    import numpy as np
    import pmetal

    def say(**kw):
        print(json.dumps(kw), flush=True)

    peers = int(sys.argv[1])
    config = pmetal.CollectiveConfig(timeout=5.0, connect_timeout=30.0, shared_memory=False)
    backend = pmetal.AutoDiscoveryBackend.new_blocking(config, name="auto-test")
    backend.wait_for_peers_blocking(peers, timeout=60.0)
    ctx = pmetal.DistributedContext(backend)
    x = np.full(1000, ctx.rank + 1, np.int64)
    ctx.all_reduce_blocking(x)
    say(rank=ctx.rank, world=ctx.world_size, sum=int(x[0]),
        formation=ctx.group.formation.formation_id)
    big = np.ones(4 << 20, np.float32)
    try:
        for op in range(1, 10_000):
            ctx.all_reduce_blocking(big)
            if op == 2:
                say(op=op)
    except pmetal.CollectiveError as exc:
        say(error=str(exc))
    line = sys.stdin.readline()      # the test says when the survivors re-form
    if line:
        ctx.close()
        again = pmetal.AutoDiscoveryBackend.new_blocking(config, name="auto-test")
        again.world_size = int(line)
        ctx = pmetal.DistributedContext(again)
        y = np.full(8, ctx.rank + 1, np.int64)
        ctx.all_reduce_blocking(y)
        say(reformed=True, rank=ctx.rank, world=ctx.world_size, sum=int(y[0]),
            formation=ctx.group.formation.formation_id)
''')


class Proc:
    def __init__(self, script: Path, host: str, peers: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(peers)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**env, "PMETAL_TRANSPORT_HOST": host, "PMETAL_DISCOVERY_INTERFACES": host})

    def line(self, want: str) -> dict[str, Any]:
        """The next line holding key ``want`` (bounded by WAIT)."""
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            text = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not text:
                raise AssertionError(f"the process exited ({self.proc.poll()}) waiting for "
                                     f"{want!r}: {self.proc.stderr.read()[-3000:]}")  # type: ignore[union-attr]
            try:
                got = json.loads(text)
            except ValueError:
                continue  # the embedded node's own output
            if want in got:
                return got
        raise AssertionError(f"no {want!r} line within {WAIT} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def processes(tmp_path: Path):
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


def test_processes_find_each_other_and_survive_a_kill(tmp_path: Path,
                                                      processes: list[Proc]) -> None:
    script = tmp_path / "auto_rank.py"
    script.write_text(SCRIPT)
    base = 100 + (os.getpid() % 100)
    hosts = [f"127.0.{base}.{i}" for i in (11, 12, 13)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    env.update(PMETAL_PSK=secrets.token_hex(16), PMETAL_HOME=str(tmp_path / "home"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    started = time.monotonic()
    processes.extend(Proc(script, h, 2, env) for h in hosts)
    first = [p.line("sum") for p in processes]
    print(f"3 processes found each other, formed and all_reduced in "
          f"{time.monotonic() - started:.1f} s: {first}")
    assert sorted(r["rank"] for r in first) == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 6 for r in first), first
    for p in processes:
        p.line("op")
    victim = next(p for p, r in zip(processes, first) if r["rank"] == 1)
    killed = time.monotonic()
    victim.proc.send_signal(signal.SIGKILL)
    survivors = [p for p in processes if p is not victim]
    for p in survivors:
        error = p.line("error")["error"]
        assert "all_reduce" in error, error
    print(f"  kill -9 of rank 1: both survivors raised within "
          f"{time.monotonic() - killed:.2f} s")
    assert time.monotonic() - killed < 5.0 + 3.0  # the operation's timeout, and slack
    for p in survivors:
        p.proc.stdin.write("2\n")  # type: ignore[union-attr]
        p.proc.stdin.flush()  # type: ignore[union-attr]
    try:
        again = [p.line("reformed") for p in survivors]
    except AssertionError as exc:
        # Say what every survivor saw: a re-formation fails for both or
        # neither, and one side's error rarely tells the story.
        told = []
        for p in survivors:
            p.stop()
            told.append(p.proc.stderr.read()[-2000:])  # type: ignore[union-attr]
        raise AssertionError(f"{exc}\n--- survivors' stderr ---\n" + "\n---\n".join(told)) \
            from exc
    assert sorted(r["rank"] for r in again) == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3 for r in again), again
    # A new formation (its id is part of every connection's tag, so the old
    # one's connections are refused); one formation for both survivors.
    assert again[0]["formation"] == again[1]["formation"] != first[0]["formation"], again
