"""A driver on the minority side of a partition (tests/netlab.py, three
hosts, one node daemon on each, static peers): every call it makes, to an
actor across the cut (restartable, or never called before the cut) or to
one on its own host, succeeds or fails within the documented bound
(``actors.restart_wait`` plus the time to declare a node dead), never in
the 10-30 s a call once took.

The driver runs on host 3 and prints one JSON line per step; the test
answers on its stdin. It needs root (the lab) and skips otherwise; the
figures it prints are the measurement.

A restartable actor on the driver's host, owned by a driver on the
majority side, shows the lease (pmetal.cluster.lease): its copy on the
cut-off host runs nothing once no quorum answers that host, before the
majority restarts it, so two copies never run at once.
"""

from __future__ import annotations

import json
import time

import pytest
from netlab import lab_available

from cluster.lab import formed_cluster, read_line

pytestmark = pytest.mark.skipif(lab_available() is not None,
                                reason=lab_available() or "")

HOSTS = [1, 2, 3]
RESTART_WAIT = 3.0
BOUND = RESTART_WAIT + 3.0   # the wait for a restart, plus declaring a node dead (~1 s)

# On the majority side: creates a restartable actor on the minority host,
# owned here, so that this side restarts it once it holds that host dead.
# Every construction and every call the actor runs is a line of its log:
# [pid, CLOCK_BOOTTIME (one kernel for every lab host), what].
OWNER = r"""
import json, os, sys, time
import pmetal

@pmetal.remote
class Keeper:
    def __init__(self, log):
        self.log = log
        self.note("init")

    def note(self, what):
        with open(self.log, "a") as f:
            f.write(json.dumps([os.getpid(), time.clock_gettime(time.CLOCK_BOOTTIME), what]) + "\n")

    def touch(self):
        self.note("call")
        return os.getpid()

pmetal.init(address=sys.argv[1], psk=bytes.fromhex(sys.argv[2]), namespace="lab")
keeper = Keeper.options(name="keeper", node=sys.argv[3], max_restarts=1).remote(sys.argv[4])
print(json.dumps({"step": "ready", "pid": pmetal.get(keeper.touch.remote(), timeout=30)}),
      flush=True)
sys.stdin.readline()
"""

DRIVER = r"""
import json, os, sys, time
import pmetal
from pmetal.config import load_config

@pmetal.remote
class Echo:
    def ping(self):
        return os.getpid()

def emit(**kw):
    print(json.dumps(kw), flush=True)

address, psk, far_node, near_node = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3], sys.argv[4]
pmetal.init(address=address, psk=psk, namespace="lab",
            config=load_config(actors={"restart_wait": float(sys.argv[5])}))
# Across the cut to come, and restartable: a call waits for a restart that
# the minority side cannot see (the majority's master does it, if any).
far = Echo.options(node=far_node, max_restarts=2).remote()
near = Echo.options(node=near_node).remote()    # on the driver's own host
unseen = Echo.options(node=far_node).remote()   # never called before the cut
# On this host, restartable, owned by the other side (OWNER): the lease.
keeper = pmetal.get_actor("keeper")
pmetal.get([far.ping.remote(), near.ping.remote(), keeper.touch.remote()], timeout=20)
emit(step="ready")
sys.stdin.readline()   # the cut is made now
seen = {}   # name -> [calls, slowest s, failures, last error]
end = time.monotonic() + float(sys.argv[6])
while time.monotonic() < end:
    for name, handle in (("far", far), ("near", near), ("unseen", unseen), ("keeper", keeper)):
        started = time.monotonic()
        try:
            pmetal.get((handle.touch if name == "keeper" else handle.ping).remote(), timeout=60)
            error = ""
        except Exception as exc:
            error = f"{type(exc).__name__}: {str(exc)[:160]}"
        took = time.monotonic() - started
        entry = seen.setdefault(name, [0, 0.0, 0, ""])
        entry[0] += 1
        entry[1] = max(entry[1], took)
        if error:
            entry[2] += 1
            entry[3] = error
emit(step="calls", calls=seen)
"""


def test_every_call_of_a_minority_side_driver_ends_within_the_bound(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("lab")
    log = tmp / "keeper.jsonl"
    with formed_cluster(HOSTS, tmp) as c, \
            c.driver(1, OWNER, [c.nodes[1].address, c.psk.hex(), c.nodes[3].node_id, str(log)],
                     "owner", stdin=True) as owner:
        first = read_line(owner, 60.0, "ready")["pid"]
        near = c.nodes[3]
        with c.driver(3, DRIVER, [near.address, c.psk.hex(), c.nodes[1].node_id,
                                  near.node_id, str(RESTART_WAIT), "6"], "minority",
                      stdin=True) as driver:
            read_line(driver, 60.0, "ready")
            c.lab.partition([1, 2], [3])
            cut = time.monotonic()
            assert driver.stdin is not None
            driver.stdin.write(b"go\n")
            driver.stdin.flush()
            calls = read_line(driver, 120.0, "calls")["calls"]
            took = time.monotonic() - cut
            c.lab.heal()
            runs = [json.loads(line) for line in log.read_text().splitlines()]
    for name, (made, slowest, failed, error) in calls.items():
        print(f"\n[minority driver] {name}: {made} calls, slowest {slowest:.2f} s, "
              f"{failed} failed ({error})")
    assert took < 60.0
    assert all(slowest < BOUND for _, slowest, _, _ in calls.values()), calls
    # Across the cut: ActorDiedError within the bound, never a timeout.
    assert calls["far"][3].startswith("ActorDiedError"), calls
    assert calls["unseen"][2] == calls["unseen"][0], calls
    assert calls["unseen"][3].startswith("ActorDiedError"), calls
    # The keeper's copy on the cut-off host ran its last call before its
    # restart on the majority side began: never two copies at once.
    old = [t for pid, t, what in runs if pid == first and what == "call"]
    new = [t for pid, t, what in runs if pid != first and what == "init"]
    assert len(new) == 1, runs   # the majority restarted it, once
    print(f"\n[lease] the cut-off copy ran its last call {new[0] - max(old):.2f} s before "
          f"the restart on the majority side constructed the next ({len(old)} calls)")
    assert max(old) < new[0], runs
    assert calls["keeper"][2] > 0 and "quorum" in calls["keeper"][3], calls
