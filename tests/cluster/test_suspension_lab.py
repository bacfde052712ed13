"""A host that stops (SIGSTOP of every process on it: a laptop's sleep as
the others see it) for longer than ``health.dead_after`` and then continues:
its actor is restarted elsewhere, and the old copy executes no further call
and delivers no result; and nodes starved of CPU (load 12 on two cores)
do not fence themselves (docs/cluster.md, "Pauses").

Three hosts of a network-namespace lab (tests/netlab.py), one node daemon
each (static peers). Each call of the actor appends a line
``<tag> <start|end> <pid>`` to a file: the executions of every copy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netlab import lab_available

from .lab import LabCluster, formed_cluster, read_line

pytestmark = pytest.mark.skipif(lab_available() is not None, reason=lab_available() or "")

HOSTS = [1, 2, 3]
STEP = 20.0       # s a step may take before the test calls it a hang
STOPPED = 3.0     # s the actor's host stays stopped (dead_after is 0.8 s)

DRIVER = r"""
import json, os, sys, time
import pmetal
from pmetal.config import load_config

MARKS = sys.argv[5]

@pmetal.remote(max_restarts=2, max_task_retries=1)
class Recorder:
    def pid(self):
        return os.getpid()
    def work(self, tag, seconds):
        with open(MARKS, "a") as f:
            f.write(f"{tag} start {os.getpid()}\n")
        time.sleep(seconds)
        with open(MARKS, "a") as f:
            f.write(f"{tag} end {os.getpid()}\n")
        return os.getpid()

def emit(**kw):
    print(json.dumps({"t": time.time(), **kw}), flush=True)

def started(tag, deadline):
    while time.monotonic() < deadline:
        if os.path.exists(MARKS) and f"{tag} start" in open(MARKS).read():
            return True
        time.sleep(0.01)
    return False

def outcome(ref):
    try:
        return {"pid": pmetal.get(ref, timeout=30)}
    except Exception as exc:
        return {"error": type(exc).__name__, "why": str(exc)}

pmetal.init(address=sys.argv[1], psk=bytes.fromhex(sys.argv[2]), namespace=sys.argv[3],
            config=load_config(transport={"request_timeout": 20.0, "connect_timeout": 10.0}))
r = Recorder.options(node=sys.argv[4], name=sys.argv[6]).remote()
pid0 = pmetal.get(r.pid.remote(), timeout=20)
a = r.work.remote("a", 1.5)          # in flight when the host stops
assert started("a", time.monotonic() + 20), "call a never started"
emit(step="started", pid=pid0)
sys.stdin.readline()                 # the host is stopped now
b = r.work.remote("b", 0.0)          # sent to the stopped copy
emit(step="results", a=outcome(a), b=outcome(b))
sys.stdin.readline()                 # the host was continued, its old copy gone
emit(step="after", c=outcome(r.work.remote("c", 0.0)))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabCluster]:
    with formed_cluster(HOSTS, tmp_path_factory.mktemp("lab")) as c:
        yield c


def _marks(path: Path) -> list[tuple[str, str, int]]:
    if not path.exists():
        return []
    return [(t, what, int(pid)) for t, what, pid in
            (line.split() for line in path.read_text().splitlines() if line.strip())]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:   # a zombie (its node has not reaped it yet) runs nothing either
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait(cond, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.parametrize("victim", ["follower", "master"])
def test_a_stopped_host_woken_runs_no_call_and_delivers_no_result(
        cluster: LabCluster, tmp_path: Path, victim: str) -> None:
    """The actor's host is a follower, or the master (then the others elect
    another, and the old master, woken, finds itself deposed)."""
    cluster.wait(lambda: cluster.agreed(HOSTS, members=HOSTS), STEP, "agreement")
    master = cluster.nodes[HOSTS[0]].state["master"]
    master_host = next(i for i in HOSTS if cluster.nodes[i].node_id == master)
    host = master_host if victim == "master" else next(i for i in HOSTS if i != master_host)
    at = next(i for i in HOSTS if i != host)    # the driver's host
    marks = tmp_path / "marks"
    node = cluster.nodes[host]
    with cluster.driver(at, DRIVER, [cluster.nodes[at].address, cluster.psk.hex(),
                                     cluster.namespace, node.node_id, str(marks),
                                     # Its own name: the other run's actor may still be
                                     # ending (its owner's exit is told to the nodes).
                                     f"recorder-{victim}"],
                        f"suspension-driver-{victim}", stdin=True) as driver:
        assert driver.stdin is not None
        pid0 = read_line(driver, STEP, "started")["pid"]
        cluster.signal(host, signal.SIGSTOP)     # every process of the host
        stopped = time.monotonic()
        try:
            driver.stdin.write(b"go\n")
            driver.stdin.flush()
            results = read_line(driver, STEP, "results")
            # Both calls were retried on the copy restarted elsewhere.
            for tag in ("a", "b"):
                assert results[tag].get("pid") not in (None, pid0), results
            pid1 = results["a"]["pid"]
            _wait(lambda: time.monotonic() - stopped >= STOPPED, STEP, "the stop")
            before = _marks(marks)
        finally:
            cluster.signal(host, signal.SIGCONT)
        resumed = time.monotonic()
        # The node asks the cluster, is told it was declared dead, and
        # fences: the old copy's worker ends.
        took = _wait(lambda: _gone(pid0), STEP, f"the old copy (pid {pid0}) ending")
        print(f"\n[lab] {victim}: SIGCONT to the old copy's end: {took:.3f} s", flush=True)
        driver.stdin.write(b"go\n")
        driver.stdin.flush()
        after = read_line(driver, STEP, "after")
        assert after["c"].get("pid") == pid1, after
    runs = _marks(marks)
    print("[lab] executions:", runs)
    # While stopped the old copy could not run; once continued it may
    # finish the call it was in (user code is not interrupted), but it
    # starts nothing: call b ran once, on the new copy, and so did c.
    old = [(t, what) for t, what, pid in runs if pid == pid0]
    assert set(old) <= {("a", "start"), ("a", "end")}, runs
    for tag in ("b", "c"):
        starts = [pid for t, what, pid in runs if t == tag and what == "start"]
        assert starts == [pid1], (tag, runs)
    assert [pid for t, what, pid in runs if t == "a" and what == "start"] == [pid0, pid1], runs
    assert [m for m in before if m[2] == pid0] == [("a", "start", pid0)], before
    log = node.log.read_text(errors="replace")
    assert "the machine did not sleep" in log, log[-3000:]
    assert "fencing this node" in log, log[-3000:]
    # The cluster agrees again, the woken node among the members.
    cluster.wait(lambda: cluster.agreed(HOSTS, members=HOSTS), STEP,
                 "the woken node rejoined")
    assert time.monotonic() - resumed < 2 * STEP


HOG = "import time, sys\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"

STARVED = r"""
import json, os, sys, time
import pmetal
from pmetal.config import load_config

@pmetal.remote
class Counter:
    def __init__(self):
        self.n = 0
    def incr(self):
        self.n += 1
        return os.getpid(), self.n

def emit(**kw):
    print(json.dumps({"t": time.time(), **kw}), flush=True)

pmetal.init(address=sys.argv[1], psk=bytes.fromhex(sys.argv[2]), namespace=sys.argv[3],
            config=load_config(transport={"request_timeout": 30.0, "connect_timeout": 20.0}))
counters = [Counter.options(node=n).remote() for n in sys.argv[4].split(",")]
pids = [pmetal.get(c.incr.remote(), timeout=30)[0] for c in counters]
emit(step="created", pids=pids)
sys.stdin.readline()   # the hogs run now
end = time.monotonic() + float(sys.argv[5])
calls = 0
while time.monotonic() < end:
    for c, pid in zip(counters, pids):
        got, n = pmetal.get(c.incr.remote(), timeout=30)
        assert got == pid, (got, pid)
        calls += 1
emit(step="done", calls=calls)
"""


def test_nodes_starved_of_cpu_do_not_fence_themselves(cluster: LabCluster) -> None:
    """Twelve busy loops beside the three nodes (load 12 on two cores) for
    5 s (six times dead_after): no node fences itself or is declared dead,
    and every actor lives on, answering from the process it started in."""
    cluster.wait(lambda: cluster.agreed(HOSTS, members=HOSTS), STEP, "agreement")
    logs = {i: len(cluster.nodes[i].log.read_bytes()) for i in HOSTS}
    seconds = 5.0
    ids = ",".join(cluster.nodes[i].node_id for i in HOSTS)
    with cluster.driver(1, STARVED, [cluster.nodes[1].address, cluster.psk.hex(),
                                     cluster.namespace, ids, str(seconds)],
                        "starved-driver", stdin=True) as driver:
        assert driver.stdin is not None
        read_line(driver, STEP, "created")
        hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(seconds + 1.0)])
                for _ in range(12)]
        try:
            driver.stdin.write(b"go\n")
            driver.stdin.flush()
            done = read_line(driver, seconds + STEP, "done")
        finally:
            for hog in hogs:
                hog.kill()
            for hog in hogs:
                hog.wait(timeout=10)
    assert done["calls"] > 0
    pauses = 0
    for i in HOSTS:
        text = cluster.nodes[i].log.read_bytes()[logs[i]:].decode(errors="replace")
        assert "fencing this node" not in text, text[-3000:]
        assert " is dead" not in text, text[-3000:]
        pauses += text.count("did not run for")
    print(f"\n[lab] load 12: {done['calls']} calls, {pauses} pauses found and confirmed",
          flush=True)
    cluster.wait(lambda: cluster.agreed(HOSTS, members=HOSTS), STEP, "agreement after")


def test_every_host_paused_at_once_fences_none(cluster: LabCluster) -> None:
    """Every process of every host stopped for twice ``dead_after``, then
    continued: each node finds a gap longer than ``dead_after`` between its
    ticks, as a machine starved of CPU does, but nobody declared anybody
    dead meanwhile. Each asks, is confirmed and carries on: no fence, and
    every actor answers from the process it started in."""
    cluster.wait(lambda: cluster.agreed(HOSTS, members=HOSTS), STEP, "agreement")
    reign = (cluster.nodes[1].state["master"], cluster.nodes[1].state["term"])
    logs = {i: len(cluster.nodes[i].log.read_bytes()) for i in HOSTS}
    ids = ",".join(cluster.nodes[i].node_id for i in HOSTS)
    with cluster.driver(1, STARVED, [cluster.nodes[1].address, cluster.psk.hex(),
                                     cluster.namespace, ids, "1.0"],
                        "paused-driver", stdin=True) as driver:
        assert driver.stdin is not None
        read_line(driver, STEP, "created")
        for i in HOSTS:
            cluster.signal(i, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            _wait(lambda: time.monotonic() - stopped >= 1.6, STEP, "the stop")
        finally:
            for i in HOSTS:
                cluster.signal(i, signal.SIGCONT)
        driver.stdin.write(b"go\n")
        driver.stdin.flush()
        done = read_line(driver, STEP, "done")
    assert done["calls"] > 0
    for i in HOSTS:
        text = cluster.nodes[i].log.read_bytes()[logs[i]:].decode(errors="replace")
        assert "did not run for" in text, text[-3000:]
        assert "membership confirmed" in text, text[-3000:]
        assert "fencing this node" not in text, text[-3000:]
        assert " is dead" not in text, text[-3000:]
        assert "no master" not in text, text[-3000:]
    cluster.wait(lambda: cluster.agreed(HOSTS, members=HOSTS), STEP, "agreement after")
    # Nobody held the others' silence against them: the master reigns on.
    assert (cluster.nodes[1].state["master"], cluster.nodes[1].state["term"]) == reign
