"""A model too big for any one node ([7/11] item 7), on network-namespace hosts.

Each of three lab hosts advertises a memory budget (``actors.memory``, set
through ``PMETAL_ACTORS_MEMORY``) that holds about 60% of the model as the
quantized engine keeps it. One stage is refused before anything loads, with
an error naming what the model needs and what each node has; three stages
spread over the three hosts and answer exactly as one unbudgeted quantized
stage in the driver's own process does. The driver runs on host 1 and
prints one JSON line. Needs root (the lab); skipped otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster.lab import LabCluster, read_line
from netlab import NetLab, lab_available

from pmetal.pipeline.loader import quantized_profile
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

pytestmark = pytest.mark.skipif(lab_available() is not None, reason=lab_available() or "")

HOSTS = [1, 2, 3]
MAX_LEN = 64
FRACTION = 0.8   # place_stages' memory_fraction

DRIVER = r"""
import json, sys
import pmetal
from pmetal.config import load_config
from pmetal.errors import PlacementError
from pmetal.model.quantized import QuantizedStage
from pmetal.pipeline.generation import generate_single_process
from pmetal.pipeline.loader import load_quantized
from pmetal.pipeline.pipeline import Pipeline
from pmetal.pipeline.sampling import SamplingConfig

address, psk, model, max_len = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3], int(sys.argv[4])
prompts = [[5, 17, 42, 9], [100, 3], [9] * 10]
expected = [r.tokens for r in generate_single_process(
    QuantizedStage(load_quantized(model)), prompts, SamplingConfig(max_tokens=12),
    max_len=max_len)]
pmetal.init(address=address, psk=psk, namespace="lab",
            config=load_config(transport={"request_timeout": 10.0}))
out = {"step": "done"}
try:
    Pipeline.from_pretrained(model, stages=1, max_len=max_len, threads=1).close()
    out["one"] = "no error"
except PlacementError as exc:
    out["one"] = str(exc)
with Pipeline.from_pretrained(model, stages=3, max_len=max_len, threads=1) as pipe:
    got = pipe.generate(prompts, max_tokens=12)
    out["equal"] = [r.tokens for r in got] == expected
    out["nodes"] = [s["node"] for s in pipe.statistics()["stages"]]
print(json.dumps(out), flush=True)
pmetal.shutdown()
"""


def test_a_model_bigger_than_each_node_runs_across_them(tmp_path: Path) -> None:
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, tiny_config(layers=6), seed=11, quantize=True)
    needs = quantized_profile(model, max_len=MAX_LEN).total_bytes
    budget = int(needs * 0.6 / FRACTION)   # each node holds 60% of the model
    with NetLab(len(HOSTS)) as lab:
        c = LabCluster(lab, tmp_path, discovery=False,
                       env={"PMETAL_ACTORS_MEMORY": str(budget)})
        try:
            c.start_many(HOSTS)
            c.wait(lambda: c.agreed(HOSTS, members=HOSTS), 30.0, "3 members agreed")
            with c.driver(1, DRIVER, [c.nodes[1].address, c.psk.hex(), str(model),
                                      str(MAX_LEN)], "budget-driver") as driver:
                done = read_line(driver, 120.0, "done")
                assert driver.wait(timeout=30.0) == 0
        finally:
            c.close()
    print(f"\n[lab] budget {budget} B per node for a model of {needs} B: {done}", flush=True)
    assert "the model needs" in done["one"], done
    for node in c.nodes.values():   # every node named, with what it has
        assert node.node_id in done["one"], done
    assert done["equal"], done
    assert sorted(done["nodes"]) == sorted(n.node_id for n in c.nodes.values())
