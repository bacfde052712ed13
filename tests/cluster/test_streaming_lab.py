"""Streaming generators across machines: two hosts of a network-namespace
lab (tests/netlab.py), one node daemon each. A driver on host 1 iterates a
generator method of an actor on host 2 with a small backpressure window,
then the actor's process on host 2 is killed mid-stream and the driver's
next ref fails with ActorDiedError (the connection across the lab's network
drops). Needs root (the lab) and skips otherwise."""

from __future__ import annotations

import os
import signal

import pytest
from netlab import lab_available

from .lab import formed_cluster, read_line

pytestmark = pytest.mark.skipif(lab_available() is not None, reason=lab_available() or "")

HOSTS = [1, 2]

DRIVER = r"""
import json, os, sys
import pmetal

pmetal.init(address=sys.argv[1], psk=bytes.fromhex(sys.argv[2]), namespace="lab")

@pmetal.remote
class Streamer:
    def items(self, n):
        for i in range(n):
            yield i * 2

def emit(**kw):
    print(json.dumps(kw), flush=True)

streamer = Streamer.options(node=sys.argv[3]).remote()
gen = streamer.items.options(_generator_backpressure_num_objects=4).remote(200)
emit(step="stream", items=pmetal.get(list(gen), timeout=60))

endless = streamer.items.options(_generator_backpressure_num_objects=2).remote(10**9)
first = pmetal.get(next(endless), timeout=60)
emit(step="pid", first=first)   # the actor is busy with the stream: the test asks its node
sys.stdin.readline()   # the test kills the actor's process now
try:
    pmetal.get([next(endless) for _ in range(3)], timeout=60)
    error = ""
except Exception as exc:
    error = type(exc).__name__
emit(step="after", error=error)
"""


def test_a_stream_across_machines_and_its_worker_dying(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("lab")
    with formed_cluster(HOSTS, tmp) as c:
        far = c.nodes[2]
        with c.driver(1, DRIVER, [c.nodes[1].address, c.psk.hex(), far.node_id], "driver",
                      stdin=True) as driver:
            assert read_line(driver, 60.0, "stream")["items"] == [2 * i for i in range(200)]
            assert read_line(driver, 60.0, "pid")["first"] == 0
            status = c.status(2)
            hosted = [w for w in status["workers"] if w["actor_id"]]
            assert len(hosted) == 1, hosted
            os.kill(int(hosted[0]["pid"]), signal.SIGKILL)
            assert driver.stdin is not None
            driver.stdin.write(b"go\n")
            driver.stdin.flush()
            assert read_line(driver, 60.0, "after")["error"] == "ActorDiedError"
