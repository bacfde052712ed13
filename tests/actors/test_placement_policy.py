"""The master's choice of node (pmetal.node.placement.choose), as a table:
Ray's hybrid policy, SPREAD, and the creations sent but not yet reported;
a pipeline's stages one per machine; the placement options as Ray's, and
their misuse. (The same on three real nodes: tests/cluster/test_scheduler_spread.py.)"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

import pmetal
from pmetal import NodeAffinitySchedulingStrategy
from pmetal.node.placement import NodeLoad, choose, utilization
from pmetal.errors import PlacementError, PMetalTypeError, PMetalValueError
from pmetal.util.scheduling_strategies import NodeAffinitySchedulingStrategy as RayPath

CPU2 = {"CPU": 2.0}


def idle(cpus: float = 2.0) -> NodeLoad:
    return NodeLoad({"CPU": cpus}, {"CPU": cpus})


@pytest.mark.parametrize(("loads", "need", "strategy", "allowed"), [
    # The creator's node, while below half used.
    ({"a": idle(), "b": idle(), "c": idle()}, {}, "DEFAULT", {"a"}),
    # Half used (one actor per two CPUs counts as half): the least utilized.
    ({"a": NodeLoad(CPU2, CPU2, actors=1), "b": NodeLoad(CPU2, CPU2, actors=1), "c": idle()},
     {}, "DEFAULT", {"c"}),
    # Below the threshold, but hosting more actors than another node: that node.
    ({"a": NodeLoad({"CPU": 16.0}, {"CPU": 16.0}, actors=1), "b": idle(16), "c": idle(16)},
     {}, "DEFAULT", {"b", "c"}),
    ({"a": NodeLoad({"CPU": 16.0}, {"CPU": 16.0}, actors=1),
      "b": NodeLoad({"CPU": 16.0}, {"CPU": 16.0}, actors=1)}, {}, "DEFAULT", {"a"}),
    # Reserved CPUs count as much as actors.
    ({"a": NodeLoad({"CPU": 0.5}, CPU2, actors=1), "b": NodeLoad({"CPU": 1.0}, CPU2, actors=1),
      "c": NodeLoad({"CPU": 1.5}, CPU2, actors=1)}, {"CPU": 0.5}, "DEFAULT", {"c", "b"}),
    # No room on the creator's node now: elsewhere, though it is below the threshold.
    ({"a": NodeLoad({"CPU": 0.0}, {"CPU": 8.0}), "b": idle()}, {"CPU": 1.0}, "DEFAULT", {"b"}),
    # SPREAD ignores the creator's preference: the fewest actors.
    ({"a": NodeLoad(CPU2, CPU2, actors=1), "b": NodeLoad(CPU2, CPU2, actors=2), "c": idle()},
     {}, "SPREAD", {"c"}),
    # Room nowhere now: the node that could ever hold it, shortest queue first.
    ({"a": NodeLoad({"CPU": 0.0}, CPU2, queued=2), "b": NodeLoad({"CPU": 0.0}, CPU2, queued=1)},
     {"CPU": 1.0}, "DEFAULT", {"b"}),
    # Nothing could ever hold it.
    ({"a": idle(), "b": idle()}, {"CPU": 4.0}, "DEFAULT", {""}),
])
def test_the_choice(loads: dict[str, NodeLoad], need: dict[str, float], strategy: str,
                    allowed: set[str]) -> None:
    for seed in range(20):
        assert choose(loads, need, "a", strategy, random.Random(seed)) in allowed


def test_the_local_threshold_is_below_half() -> None:
    assert utilization(NodeLoad(CPU2, CPU2, actors=0)) == 0.0
    assert utilization(NodeLoad(CPU2, CPU2, actors=1)) == 0.5
    assert utilization(NodeLoad({"CPU": 0.0, "memory": 10.0}, {"CPU": 2.0, "memory": 10.0})) \
        == 1.0


@pytest.mark.parametrize("strategy", ["DEFAULT", "SPREAD"])
def test_a_burst_spreads_when_the_sent_creations_count(strategy: str) -> None:
    """200 tiny actors placed before any node reports them: each choice
    sees the ones before it (NodeLoad.plus, as the master's view does), so
    they spread evenly; without that, all 200 would go to the creator."""
    rng = random.Random(7)
    loads = {n: NodeLoad({"CPU": 8.0}, {"CPU": 8.0}) for n in "abc"}
    need = {"CPU": 0.01}
    placed = Counter()
    for _ in range(200):
        target = choose(loads, need, "a", strategy, rng)
        placed[target] += 1
        loads[target] = loads[target].plus(need)
    assert sorted(placed) == ["a", "b", "c"]
    assert max(placed.values()) - min(placed.values()) <= 1, placed
    stale = Counter(choose({n: NodeLoad({"CPU": 8.0}, {"CPU": 8.0}) for n in "abc"}, need, "a",
                           strategy, rng) for _ in range(200))
    assert strategy == "SPREAD" or stale == {"a": 200}


@pytest.mark.parametrize(("stages", "per_node"), [(3, [1, 1, 1]), (5, [1, 2, 2]), (2, [1, 1])])
def test_a_pipeline_puts_one_stage_per_machine_first(stages: int, per_node: list[int]) -> None:
    from pmetal.pipeline.llama import LlamaConfig
    from pmetal.pipeline.pipeline import place_stages
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    nodes = [{"NodeID": c * 32, "Alive": True, "Resources": {"memory": 8e9, "CPU": 2}}
             for c in "abc"]
    placed = Counter(p.node_id for p in place_stages(config, stages, nodes))
    assert sorted(placed.values()) == per_node


# ------------------------------------------------ the options, as Ray's


@pmetal.remote
class Plain:
    def node(self) -> str:
        return "here"


def test_a_misspelt_or_mistyped_strategy_is_refused_when_given() -> None:
    with pytest.raises(PMetalValueError, match="did you mean 'SPREAD'"):
        Plain.options(scheduling_strategy="SPRAED")
    with pytest.raises(PMetalValueError, match="did you mean 'SPREAD'"):
        Plain.options(scheduling_strategy="spread")
    with pytest.raises(PMetalTypeError, match="PlacementGroupSchedulingStrategy, not dict"):
        Plain.options(scheduling_strategy={"node_id": "x"})
    with pytest.raises(PMetalValueError, match="both choose the node"):
        Plain.options(node="abc", scheduling_strategy="SPREAD")
    with pytest.raises(PMetalTypeError, match="only for actors"):
        pmetal.remote(max_restarts=1, scheduling_strategy="SPREAD")(lambda: 1)
    with pytest.raises(PMetalTypeError, match="node_id must be a non-empty str"):
        NodeAffinitySchedulingStrategy("")
    with pytest.raises(PMetalTypeError, match="soft must be True or False"):
        NodeAffinitySchedulingStrategy("abc", soft="yes")  # type: ignore[arg-type]
    assert RayPath is NodeAffinitySchedulingStrategy is pmetal.NodeAffinitySchedulingStrategy


def test_affinity_on_a_node_alone(cluster: dict[str, Any]) -> None:
    """A node alone decides for itself: hard affinity to another node is
    a PlacementError naming it; soft falls back to this node."""
    me = cluster["node_id"]
    here = Plain.options(scheduling_strategy=NodeAffinitySchedulingStrategy(me[:8])).remote()
    assert here._node_id == me
    with pytest.raises(PlacementError, match="no node 0123456789abcdef"):
        Plain.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            "0123456789abcdef")).remote()
    soft = Plain.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        "0123456789abcdef", soft=True)).remote()
    assert soft._node_id == me and pmetal.get(soft.node.remote(), timeout=20.0) == "here"
    for a in (here, soft):
        pmetal.kill(a)
