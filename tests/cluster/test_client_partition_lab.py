"""A driver on the minority side of a partition (tests/netlab.py, three
hosts, one node daemon on each, static peers): every call it makes, to an
actor across the cut (restartable, or never called before the cut) or to
one on its own host, succeeds or fails within the documented bound
(``actors.restart_wait`` plus the time to declare a node dead), never in
the 10-30 s a call once took.

The driver runs on host 3 and prints one JSON line per step; the test
answers on its stdin. It needs root (the lab) and skips otherwise; the
figures it prints are the measurement.
"""

from __future__ import annotations

import time

import pytest
from netlab import lab_available

from cluster.lab import formed_cluster, read_line

pytestmark = pytest.mark.skipif(lab_available() is not None,
                                reason=lab_available() or "")

HOSTS = [1, 2, 3]
RESTART_WAIT = 3.0
BOUND = RESTART_WAIT + 3.0   # the wait for a restart, plus declaring a node dead (~1 s)

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
pmetal.get([far.ping.remote(), near.ping.remote()], timeout=20)
emit(step="ready")
sys.stdin.readline()   # the cut is made now
seen = {}   # name -> [calls, slowest s, failures, last error]
end = time.monotonic() + float(sys.argv[6])
while time.monotonic() < end:
    for name, handle in (("far", far), ("near", near), ("unseen", unseen)):
        started = time.monotonic()
        try:
            pmetal.get(handle.ping.remote(), timeout=60)
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
    with formed_cluster(HOSTS, tmp_path_factory.mktemp("lab")) as c:
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
    for name, (made, slowest, failed, error) in calls.items():
        print(f"\n[minority driver] {name}: {made} calls, slowest {slowest:.2f} s, "
              f"{failed} failed ({error})")
    assert took < 60.0
    assert all(slowest < BOUND for _, slowest, _, _ in calls.values()), calls
    # Across the cut: ActorDiedError within the bound, never a timeout.
    assert calls["far"][3].startswith("ActorDiedError"), calls
    assert calls["unseen"][2] == calls["unseen"][0], calls
    assert calls["unseen"][3].startswith("ActorDiedError"), calls
