"""ObjectRefs between machines (tests/netlab.py, two hosts, a node daemon on
each, static peers): a driver on host 1 lends refs inside a value to an
actor on host 2, which fetches them from the driver's object server across
the lab's bridge and releases them (the driver's table empties); refs the actor makes come back and are fetched from host
2; once the actor's process is killed, a ref it owned fails with
OwnerDiedError at once. Needs root (the lab); skips otherwise."""

from __future__ import annotations

import os
import signal
import time

import pytest
from netlab import lab_available

from cluster.lab import formed_cluster, read_line

pytestmark = pytest.mark.skipif(lab_available() is not None,
                                reason=lab_available() or "")

HOSTS = [1, 2]

DRIVER = r"""
import json, os, sys, time
import pmetal

@pmetal.remote
class Holder:
    def pid(self):
        return os.getpid()

    def resolve(self, refs):
        return [pmetal.get(r, timeout=20) for r in refs]

    def make(self, text):
        return [pmetal.put(text)]

def emit(**kw):
    print(json.dumps(kw), flush=True)

pmetal.init(address=sys.argv[1], psk=bytes.fromhex(sys.argv[2]), namespace="lab")
far = Holder.options(node=sys.argv[3]).remote()
refs = [pmetal.put(i) for i in range(1000)]
got = pmetal.get(far.resolve.remote(refs), timeout=30)
from pmetal.actors import context
# The actor let go of them when its call ended: its Releases cross the bridge.
released = context.current().objects.owned.wait_empty(20)
[theirs] = pmetal.get(far.make.remote("made on host 2"), timeout=30)
[unseen] = pmetal.get(far.make.remote("never fetched"), timeout=30)
emit(step="ready", ok=got == list(range(1000)), released=released,
     value=pmetal.get(theirs, timeout=30),
     owner=theirs._owner.address, pid=pmetal.get(far.pid.remote(), timeout=30))
sys.stdin.readline()   # the test killed the actor's process
started = time.monotonic()
try:
    pmetal.get(unseen, timeout=30)
    error = ""
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
emit(step="died", error=error, took=time.monotonic() - started,
     kept=pmetal.get(theirs, timeout=5))
"""


def test_refs_lent_and_fetched_across_hosts_and_an_owner_death(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("lab")
    with formed_cluster(HOSTS, tmp) as c, \
            c.driver(1, DRIVER, [c.nodes[1].address, c.psk.hex(), c.nodes[2].node_id],
                     "driver", stdin=True) as driver:
        ready = read_line(driver, 60.0, "ready")
        assert ready["ok"] and ready["value"] == "made on host 2", ready
        assert ready["released"], ready   # the driver's table emptied across machines
        # The actor's object server listens on host 2's lab address.
        host2 = c.nodes[2].address.partition("://")[2].rpartition(":")[0]
        assert ready["owner"].partition("://")[2].rpartition(":")[0] == host2, ready
        os.kill(ready["pid"], signal.SIGKILL)
        killed = time.monotonic()
        assert driver.stdin is not None
        driver.stdin.write(b"go\n")
        driver.stdin.flush()
        died = read_line(driver, 30.0, "died")
        print(f"\n[ownership lab] OwnerDiedError {died['took'] * 1e3:.0f} ms after the get "
              f"({time.monotonic() - killed:.2f} s after the kill)")
    assert died["error"].startswith("OwnerDiedError"), died
    assert "never fetched" not in died["error"] and "died" in died["error"], died
    assert died["kept"] == "made on host 2"   # fetched before the death: kept
