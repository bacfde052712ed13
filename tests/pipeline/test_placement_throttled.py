"""A node that is really slower measures slower and gets fewer layers.

Two node daemons on loopback (``python -m pmetal.node``, each with its own
home); once both are up, the second is held to a twentieth of one CPU: a
cgroup CPU quota on its process (cgroup v2 ``cpu.max`` or v1
``cpu.cfs_quota_us``, with a 20 ms period so that the 0.25 s measurement
spans many periods), or, where no cgroup can be made (not root), stopped
with SIGSTOP for 29 ms of every 30 ms by a thread of the test (what a quota
does, in user space; unlike pinning it beside CPU hogs, it holds on a
2-core machine that other work keeps busy). A driver connected to the first
asks for every member's capacity, as ``Pipeline.from_pretrained`` does,
and places SmolLM2-135M's 30 layers on two stages.

The only comparison of timings is the one the test sets up to differ
widely: the throttled node's measured rate against the free one's. So
that the free one is really faster on a 2-core machine that other work
keeps busy (a load of 9 left it a fifth of a CPU), it runs at nice -10
where the test may raise its priority (root).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pmetal.pipeline.llama import SMOLLM2_135M
from pmetal.pipeline.placement import cluster_nodes, plan_stages
from tests.actors.conftest import free_port
from tests.actors.test_cluster import (
    REQUEST_TIMEOUT,
    SECRET,
    NodeProc,
    await_ready,
    other_client,
    stop_node,
)

pytestmark = pytest.mark.skipif(sys.platform == "win32",
                                reason="throttling a node needs cgroups or SIGSTOP")

PERIOD_US = 20_000      # a short quota period: the 0.25 s measurement spans 12 of them
QUOTA_US = 1_000        # a twentieth of one CPU
STOPPED, RUNNING = 0.029, 0.001   # s of each duty cycle, when no cgroup can be made
CGROUP = Path("/sys/fs/cgroup")


def _cgroup_v2() -> Path | None:
    controllers = CGROUP / "cgroup.controllers"
    if os.geteuid() != 0 or not controllers.exists() \
            or "cpu" not in controllers.read_text().split():
        return None
    with contextlib.suppress(OSError):
        (CGROUP / "cgroup.subtree_control").write_text("+cpu")
    return CGROUP


def _cgroup_v1() -> Path | None:
    root = CGROUP / "cpu"
    if os.geteuid() != 0 or not (root / "cpu.cfs_quota_us").exists():
        return None
    return root


def _quota(pid: int) -> tuple[Path, Path, str]:
    """``pid`` (all its threads) moved into a new cgroup with a twentieth of
    one CPU: (the group, its root, how). Raises OSError when no cgroup can be
    made here."""
    v2, v1 = _cgroup_v2(), _cgroup_v1()
    root = v2 or v1
    if root is None:
        raise OSError("no writable cgroup cpu controller (not root, or none mounted)")
    group = root / f"pmetal-test-{os.getpid()}-{pid}"
    group.mkdir()
    try:
        if v2 is not None:
            (group / "cpu.max").write_text(f"{QUOTA_US} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
        (group / "cgroup.procs").write_text(str(pid))
    except OSError:
        _release(group, root)
        raise
    return group, root, (f"cgroup {'v2 cpu.max' if v2 is not None else 'v1 cfs quota'} "
                         f"{QUOTA_US} us per {PERIOD_US} us")


def _release(group: Path, root: Path) -> None:
    """Whatever is left in ``group`` (the node's processes) goes back to
    ``root``, then the group goes."""
    with contextlib.suppress(OSError):
        for left in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(left)
    with contextlib.suppress(OSError):
        group.rmdir()


@contextlib.contextmanager
def _duty_cycled(pid: int) -> Iterator[str]:
    """``pid`` stopped (SIGSTOP) for :data:`STOPPED` s out of every
    :data:`STOPPED` + :data:`RUNNING`, as a quota throttles it, by a thread
    of this process; continued at the end."""
    done = threading.Event()

    def cycle() -> None:
        try:
            while not done.is_set():
                os.kill(pid, signal.SIGSTOP)
                done.wait(STOPPED)
                os.kill(pid, signal.SIGCONT)
                done.wait(RUNNING)
        except ProcessLookupError:
            return
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    cycler = threading.Thread(target=cycle, name="duty-cycle", daemon=True)
    cycler.start()
    try:
        yield f"stopped {STOPPED * 1e3:g} ms of every {(STOPPED + RUNNING) * 1e3:g} ms"
    finally:
        done.set()
        cycler.join(5.0)


@contextlib.contextmanager
def throttled(pid: int) -> Iterator[str]:
    """``pid`` held to a small share of one CPU; yields how."""
    try:
        group, root, how = _quota(pid)
    except OSError as exc:
        print(f"\n[throttled] no cgroup ({exc}): the node is duty-cycled instead",
              flush=True)
        with _duty_cycled(pid) as how:
            yield how
        return
    try:
        yield how
    finally:
        _release(group, root)


def favoured(pid: int) -> str:
    """Every thread of ``pid`` at nice -10 (the threads it starts later
    inherit it); "" when this process may not."""
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(task), -10)
    except (OSError, AttributeError):
        return ""
    return ", the free node at nice -10"


def start_node(home: Path, port: int, peer: int) -> NodeProc:
    """A node daemon on loopback with ``peer`` as its static peer, which
    elects a master soon (a short bootstrap: the two know each other)."""
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PMETAL_") or k == "PMETAL_LOG_LEVEL"}
    env.update(PMETAL_PSK=SECRET, PMETAL_HOME=str(home), PMETAL_ELECTION_BOOTSTRAP="0.3",
               PMETAL_TRANSPORT_REQUEST_TIMEOUT=str(REQUEST_TIMEOUT))
    with open(home / "node.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pmetal.node", "--host", "127.0.0.1", "--port", str(port),
             "--peers", f"127.0.0.1:{peer}", "--num-workers", "1", "--num-task-workers", "1"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env)
    return NodeProc(proc, port, home)


def test_a_throttled_node_measures_slower_and_gets_fewer_layers(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    free = start_node(tmp_path / "free", ports[0], ports[1])
    slow = start_node(tmp_path / "slow", ports[1], ports[0])
    try:
        await_ready(free)
        await_ready(slow)
        priority = favoured(free.proc.pid)
        with throttled(slow.proc.pid) as how:
            client = other_client(free)
            try:
                client.wait_for_peers(1, 30.0)
                deadline = time.monotonic() + 30.0
                while True:   # until the free node's members answer with their capacity
                    nodes = cluster_nodes(client.status(measure=True))
                    measured = {n["NodeID"]: n.get("Capacity") for n in nodes if n["Alive"]}
                    if len(measured) == 2 and all(measured.values()) \
                            or time.monotonic() > deadline:
                        break
            finally:
                client.close()
        assert set(measured) == {free.node_id, slow.node_id}, nodes
        rates = {node_id: cap["compute"] for node_id, cap in measured.items()}
        print(f"\n[throttled: {how}{priority}] measured GFLOP/s: free {rates[free.node_id]:.1f}, "
              f"slow {rates[slow.node_id]:.1f}", flush=True)
        assert 0 < rates[slow.node_id] < 0.5 * rates[free.node_id], rates
        plan = plan_stages(SMOLLM2_135M, 2, nodes)
        print(plan.describe(), flush=True)
        got = {p.node_id: p.end - p.start for p in plan.placements}
        assert got[slow.node_id] < got[free.node_id], plan.describe()
        assert all(f.compute_measured and f.memory_source == "measured" for f in plan.nodes)
        # Their link's latency comes from the heartbeats between them.
        assert plan.links[0].latency is not None, plan.describe()
    finally:
        for node in (free, slow):
            stop_node(node)
