"""A pipeline across the hosts of a network-namespace lab (tests/netlab.py,
one node daemon per host, static peers): one stage per host, placed with
``placement=``, activations crossing the lab's bridge between the hosts'
own addresses. Greedy output must equal the same model generated in one
process, with 3 stages on 3 hosts and 4 stages (two on one host); then a
host's node is killed and the driver fails fast, naming the stage.

The driver runs on host 1 and prints one JSON line with what it saw. It
needs root (the lab) and skips otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from cluster.lab import ROOT, LabCluster
from collectives.test_actor_groups_lab import _line as read_line
from netlab import NetLab, lab_available

pytestmark = pytest.mark.skipif(lab_available() is not None,
                                reason=lab_available() or "")

HOSTS = [1, 2, 3]

DRIVER = r"""
import json, sys, time
import pmetal
from pmetal.config import load_config
from pmetal.pipeline.generation import generate_single_process
from pmetal.pipeline.llama import LlamaConfig, LlamaStage, LlamaWeights
from pmetal.pipeline.pipeline import Pipeline
from pmetal.pipeline.sampling import SamplingConfig

address, psk, ids = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3].split(",")
pmetal.init(address=address, psk=psk, namespace="lab",
            config=load_config(transport={"request_timeout": 10.0}))
tiny = LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
prompts = [[1, 2, 3, 4], [5, 6, 7], [9] * 12, [42, 43]]
expected = [r.tokens for r in generate_single_process(
    LlamaStage(LlamaWeights.random(tiny, seed=5)), prompts, SamplingConfig(max_tokens=20),
    max_len=64)]
out = {}
for name, placement in (("three", ids), ("four", [ids[0], ids[1], ids[2], ids[1]])):
    with Pipeline.from_pretrained(random_model=tiny, seed=5, stages=len(placement),
                                  placement=placement, max_len=64, threads=1) as pipe:
        got = pipe.generate(prompts, max_tokens=20)
        stats = pipe.statistics()
        out[name] = {"equal": [r.tokens for r in got] == expected,
                     "nodes": [s["node"] for s in stats["stages"]],
                     "bytes": [s["bytes_out"] for s in stats["stages"]]}
pipe = Pipeline.from_pretrained(random_model=tiny, seed=5, stages=3, placement=ids,
                                max_len=64, threads=1, step_timeout=20.0)
print(json.dumps({"step": "ready", **out}), flush=True)
sys.stdin.readline()           # the test kills host 3's node
started = time.monotonic()
try:
    pipe.generate(prompts, max_tokens=40)
    error = "no error"
except pmetal.PipelineError as exc:
    error = str(exc)
print(json.dumps({"step": "failed", "error": error, "seconds": time.monotonic() - started}),
      flush=True)
pipe.close()
pmetal.shutdown()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabCluster]:
    with NetLab(len(HOSTS)) as lab:
        c = LabCluster(lab, tmp_path_factory.mktemp("lab"), discovery=False)
        try:
            c.start_many(HOSTS)
            c.wait(lambda: c.agreed(HOSTS, members=HOSTS), 30.0, "three members agreed")
            yield c
        finally:
            c.close()


def test_pipeline_across_lab_hosts(cluster: LabCluster) -> None:
    c = cluster
    ids = [c.nodes[i].node_id for i in HOSTS]
    log = (c.tmp / "pipeline-driver.log").open("wb")
    driver = c.lab.run(c.lab.host(1), [sys.executable, "-c", DRIVER, c.nodes[1].address,
                                       c.psk.hex(), ",".join(ids)],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                       env=c._env(1, c.psk), cwd=ROOT)
    assert driver.stdin is not None
    try:
        ready = read_line(driver, 120.0, "ready")
        print(f"\n[lab] pipeline over hosts: {json.dumps(ready)}", flush=True)
        assert ready["three"]["equal"] and ready["four"]["equal"], ready
        assert ready["three"]["nodes"] == ids
        assert all(b > 0 for b in ready["three"]["bytes"])

        c.kill(3)
        killed = time.monotonic()
        driver.stdin.write(b"go\n")
        driver.stdin.flush()
        failed = read_line(driver, 60.0, "failed")
        print(f"[lab] host 3 killed: the driver failed after {failed['seconds']:.3f} s: "
              f"{failed['error'][:200]}", flush=True)
        assert "stage 2" in failed["error"], failed
        assert time.monotonic() - killed < 30.0
        assert driver.wait(timeout=30.0) == 0
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=10.0)
        log.close()
        print((c.tmp / "pipeline-driver.log").read_text(errors="replace")[-3000:])
