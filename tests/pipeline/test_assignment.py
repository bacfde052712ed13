"""Layer assignment: the proportional split's rounding and fit, and the
bandwidth-aware solver checked against brute force (every chain of nodes,
every cut) on small random clusters with uneven memory, speeds and links,
including clusters the model does not fit."""

from __future__ import annotations

import itertools
import math
import random
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pmetal.errors import PlacementError, PMetalValueError
from pmetal.pipeline.assignment import (
    Assignment,
    Link,
    ModelProfile,
    StageNode,
    assign_layers_bandwidth_aware,
    assign_layers_proportional,
)

MiB = 1 << 20


# ------------------------------------------------------------ the reference

def stage_time(model: ModelProfile, chain: list[StageNode], i: int, start: int, end: int,
               links: dict[tuple[str, str], Link]) -> float:
    """The cost model, written out again: layers (and head, last) over speed,
    plus the activation to the next node or the token back to the first."""
    node, last = chain[i], i == len(chain) - 1
    work = sum(model.cost_per_layer[start:end]) + (model.head_cost if last else 0.0)
    if not last:
        link = links[tuple(sorted((node.node_id, chain[i + 1].node_id)))]  # type: ignore[index]
        send = link.latency + model.activation_bytes / link.bandwidth
    elif len(chain) > 1:
        link = links[tuple(sorted((node.node_id, chain[0].node_id)))]  # type: ignore[index]
        send = link.latency + model.token_bytes / link.bandwidth
    else:
        send = 0.0
    return work / node.speed + send


def stage_memory(model: ModelProfile, n_stages: int, i: int, start: int, end: int) -> int:
    first, last = i == 0, i == n_stages - 1
    fixed = (model.embedding_bytes if first else 0) + (model.head_bytes if last else 0)
    if first and last and model.tied_embeddings:
        fixed = max(model.embedding_bytes, model.head_bytes)
    return sum(model.bytes_per_layer[start:end]) + fixed


def brute_force(model: ModelProfile, nodes: list[StageNode],
                links: dict[tuple[str, str], Link],
                stages: int | None = None) -> tuple[float, list[str] | None]:
    """The least bottleneck over every ordered subset of nodes (of
    ``stages`` nodes when given) and every way to cut the layers into that
    many non-empty ranges, and the chain that reaches it first (fewest
    stages, then node-id order)."""
    best, best_chain = math.inf, None
    ordered = sorted(nodes, key=lambda n: n.node_id)
    for k in range(1, len(nodes) + 1) if stages is None else (stages,):
        for chain in itertools.permutations(ordered, k):
            for inner in itertools.combinations(range(1, model.n_layers), k - 1):
                cuts = [0, *inner, model.n_layers]
                if any(stage_memory(model, k, i, cuts[i], cuts[i + 1]) > node.memory_free
                       for i, node in enumerate(chain)):
                    continue
                value = max(stage_time(model, list(chain), i, cuts[i], cuts[i + 1], links)
                            for i in range(k))
                if value < best * (1 - 1e-9):
                    best, best_chain = value, [n.node_id for n in chain]
    return best, best_chain


def check_valid(model: ModelProfile, nodes: list[StageNode], got: Assignment) -> None:
    """Contiguous ranges covering every layer once, each non-empty and fitting."""
    by_id = {n.node_id: n for n in nodes}
    assert got.ranges[0][0] == 0 and got.ranges[-1][1] == model.n_layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(got.ranges))
    assert all(s.end > s.start for s in got.stages)
    assert len(set(got.node_ids)) == len(got.node_ids)
    for i, s in enumerate(got.stages):
        assert s.memory_bytes == stage_memory(model, len(got.stages), i, s.start, s.end)
        assert s.memory_free == by_id[s.node_id].memory_free
        assert s.memory_bytes <= s.memory_free


# ---------------------------------------------------------- random clusters

@st.composite
def clusters(draw: st.DrawFn) -> tuple[ModelProfile, list[StageNode], dict]:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    n_layers = rng.randint(1, 12)
    uniform = rng.random() < 0.5
    layer_bytes = rng.randint(1, 100) if uniform else [rng.randint(1, 100) for _ in range(n_layers)]
    layer_cost = rng.uniform(1, 10) if uniform else [rng.uniform(0.5, 10) for _ in range(n_layers)]
    embedding = rng.choice([0, rng.randint(1, 200)])
    model = ModelProfile(
        n_layers, layer_bytes, hidden_size=rng.randint(1, 64), embedding_bytes=embedding,
        head_bytes=rng.choice([0, embedding, rng.randint(1, 200)]),
        tied_embeddings=rng.random() < 0.5, layer_cost=layer_cost,
        head_cost=rng.choice([0.0, rng.uniform(0, 20)]), codec_factor=rng.choice([1.0, 0.5, 0.25]))
    count = rng.randint(1, 4)
    # From far too little to several times the model, so some clusters cannot hold it.
    nodes = [StageNode(f"n{i}", int(model.total_bytes * rng.uniform(0.05, 1.3)),
                       rng.uniform(10, 1000)) for i in rng.sample(range(10), count)]
    links = {tuple(sorted((a.node_id, b.node_id))): Link(10 ** rng.uniform(2, 5),
                                                        rng.choice([0.0, rng.uniform(0, 0.05)]))
             for a, b in itertools.combinations(nodes, 2)}
    rng.shuffle(nodes)
    return model, nodes, links


@settings(max_examples=250, deadline=None)
@given(clusters())
def test_the_bandwidth_aware_solver_matches_brute_force(case: tuple) -> None:
    model, nodes, links = case
    best, chain = brute_force(model, nodes, links)
    if chain is None:
        with pytest.raises(PlacementError, match=r"the model needs .*, the cluster has .* free"):
            assign_layers_bandwidth_aware(model, nodes, links)
        # Whatever proportional would give is one of the splits that did not fit.
        with pytest.raises(PlacementError):
            assign_layers_proportional(model, nodes, links)
        return
    got = assign_layers_bandwidth_aware(model, nodes, links)
    check_valid(model, nodes, got)
    assert got.strategy == "bandwidth-aware, exact"
    assert got.time_per_token == pytest.approx(best, rel=1e-9)
    assert got.node_ids == chain
    # The predictions are the reference's cost model, stage by stage.
    for i, s in enumerate(got.stages):
        assert s.time == pytest.approx(
            stage_time(model, [{n.node_id: n for n in nodes}[x] for x in got.node_ids],
                       i, s.start, s.end, links), rel=1e-9)
    assert got.latency_per_token == pytest.approx(sum(s.time for s in got.stages))  # type: ignore[misc]
    # The input order does not matter.
    assert assign_layers_bandwidth_aware(model, nodes[::-1], links) == got


@settings(max_examples=150, deadline=None)
@given(clusters(), st.integers(1, 4))
def test_a_fixed_number_of_stages_matches_brute_force(case: tuple, stages: int) -> None:
    model, nodes, links = case
    if stages > len(nodes):
        with pytest.raises(PMetalValueError, match="stages"):
            assign_layers_bandwidth_aware(model, nodes, links, stages=stages)
        return
    best, chain = brute_force(model, nodes, links, stages)
    if chain is None:
        with pytest.raises(PlacementError):
            assign_layers_bandwidth_aware(model, nodes, links, stages=stages)
        return
    got = assign_layers_bandwidth_aware(model, nodes, links, stages=stages)
    check_valid(model, nodes, got)
    assert len(got.stages) == stages
    assert got.time_per_token == pytest.approx(best, rel=1e-9)
    assert got.node_ids == chain


@settings(max_examples=100, deadline=None)
@given(clusters())
def test_the_heuristic_is_feasible_and_never_beats_the_exact_answer(case: tuple) -> None:
    model, nodes, links = case
    try:
        exact = assign_layers_bandwidth_aware(model, nodes, links)
    except PlacementError:
        return
    try:
        rough = assign_layers_bandwidth_aware(model, nodes, links, exact_limit=0)
    except PlacementError:
        return      # the heuristic tries only some chains, which may all miss
    check_valid(model, nodes, rough)
    assert rough.strategy == "bandwidth-aware, heuristic"
    assert rough.time_per_token >= exact.time_per_token * (1 - 1e-9)  # type: ignore[operator]


# -------------------------------------------------------------- proportional

@settings(max_examples=250, deadline=None)
@given(clusters())
def test_proportional_shares_follow_free_memory_by_largest_remainder(case: tuple) -> None:
    model, nodes, links = case
    n = len(nodes)
    weights = [max(0, node.memory_free - stage_memory(model, n, i, 0, 0))
               for i, node in enumerate(nodes)]
    fits_total = model.total_bytes <= sum(node.memory_free for node in nodes)
    try:
        got = assign_layers_proportional(model, nodes, links)
    except PlacementError as exc:
        assert "the model needs" in str(exc)
        if fits_total and sum(weights):
            assert "would hold layers" in str(exc)
        return
    assert fits_total
    check_valid(model, nodes, got)
    # The order is kept; nodes with no layers are left out.
    assert got.node_ids == [x.node_id for x in nodes if x.node_id in got.node_ids]
    shares = {s.node_id: s.end - s.start for s in got.stages}
    share = [shares.get(node.node_id, 0) for node in nodes]
    assert sum(share) == model.n_layers
    quotas = [Fraction(model.n_layers * w, sum(weights)) for w in weights]
    assert all(math.floor(q) <= s <= math.floor(q) + 1 for q, s in zip(quotas, share))
    rounded_up = [i for i in range(n) if share[i] > math.floor(quotas[i])]
    rounded_down = [i for i in range(n) if share[i] == math.floor(quotas[i])]
    for up, down in itertools.product(rounded_up, rounded_down):
        assert (quotas[up] % 1, -up) > (quotas[down] % 1, -down)
    assert all(s.time is not None for s in got.stages)


def test_proportional_splits_by_memory_with_an_exact_tie_to_the_earlier_node() -> None:
    model = ModelProfile(5, 10, hidden_size=8)
    got = assign_layers_proportional(model, [StageNode("b", 100), StageNode("a", 100)])
    assert got.ranges == [(0, 3), (3, 5)] and got.node_ids == ["b", "a"]
    assert got.time_per_token is None and got.stages[0].time is None
    assert got.memory == {"b": 30, "a": 20}
    got = assign_layers_proportional(model, [StageNode("a", 300), StageNode("b", 100),
                                             StageNode("c", 5)])
    assert got.ranges == [(0, 4), (4, 5)] and got.node_ids == ["a", "b"]


def test_proportional_leaves_room_for_the_embedding_and_head() -> None:
    # 8 layers of 10 bytes, embedding 40 on the first node, head 40 on the last.
    model = ModelProfile(8, 10, hidden_size=8, embedding_bytes=40, head_bytes=40)
    got = assign_layers_proportional(model, [StageNode("a", 80), StageNode("b", 80)])
    assert got.ranges == [(0, 4), (4, 8)]
    assert got.memory == {"a": 80, "b": 80}
    with pytest.raises(PlacementError, match="needs 160 B, the cluster has 159 B free"):
        assign_layers_proportional(model, [StageNode("a", 80), StageNode("b", 79)])


def test_uneven_layers_can_defeat_proportional_but_not_the_solver() -> None:
    model = ModelProfile(4, [50, 1, 1, 1], hidden_size=1)
    nodes = [StageNode("a", 10, 1.0), StageNode("b", 50, 1.0)]
    links = {("a", "b"): Link(1e6)}
    with pytest.raises(PlacementError, match="node 'a' would hold layers 0-0"):
        assign_layers_proportional(model, nodes, links)
    got = assign_layers_bandwidth_aware(model, nodes, links)
    assert got.node_ids == ["b", "a"] and got.ranges == [(0, 1), (1, 4)]


# ----------------------------------------------------------- chosen examples

def test_a_slow_link_is_avoided_when_memory_allows() -> None:
    model = ModelProfile(12, 10, hidden_size=256, layer_cost=1.0)
    nodes = [StageNode(x, 80, 100.0) for x in "abc"]
    fast, slow = Link(1e9, 1e-4), Link(1e5, 1e-3)
    links = {("a", "b"): slow, ("a", "c"): fast, ("b", "c"): fast}
    got = assign_layers_bandwidth_aware(model, nodes, links)
    # a and b must not be next to each other in the chain (the token return is tiny).
    assert got.node_ids in (["a", "c", "b"], ["b", "c", "a"])
    assert got.node_ids == ["a", "c", "b"]       # ties go to id order
    assert got.ranges == [(0, 4), (4, 8), (8, 12)]


def test_one_node_that_holds_everything_and_is_fastest_runs_alone() -> None:
    model = ModelProfile(6, 10, hidden_size=1024, layer_cost=1.0)
    nodes = [StageNode("big", 1000, 1000.0), StageNode("small", 1000, 1.0)]
    got = assign_layers_bandwidth_aware(model, nodes, {("big", "small"): Link(1e6, 0.01)})
    assert got.node_ids == ["big"] and got.ranges == [(0, 6)]
    assert got.stages[0].transfer == 0.0
    assert got.time_per_token == pytest.approx(6 / 1000)


def test_a_model_that_does_not_fit_says_by_how_much() -> None:
    model = ModelProfile(30, 18 * MiB, hidden_size=576, embedding_bytes=108 * MiB,
                         head_bytes=108 * MiB, tied_embeddings=True)
    nodes = [StageNode("a", 200 * MiB, 1.0), StageNode("b", 200 * MiB, 1.0)]
    links = {("a", "b"): Link(1e8)}
    message = r"the model needs 648\.00 MiB, the cluster has 400\.00 MiB free on 2 nodes"
    with pytest.raises(PlacementError, match=message):
        assign_layers_proportional(model, nodes, links)
    with pytest.raises(PlacementError, match=message + r" \(a 200\.00 MiB, b 200\.00 MiB; "
                                             r"248\.00 MiB short\): add nodes"):
        assign_layers_bandwidth_aware(model, nodes, links)
    with pytest.raises(PlacementError, match="one layer takes 1.00 KiB, more than the 1000 B"):
        assign_layers_bandwidth_aware(ModelProfile(2, 1024, hidden_size=1),
                                      [StageNode(x, 1000, 1.0) for x in "abc"],
                                      lambda a, b: Link(1.0))
    with pytest.raises(PlacementError, match="no nodes"):
        assign_layers_proportional(model, [])


def test_bad_inputs_are_refused_clearly() -> None:
    with pytest.raises(PMetalValueError, match="layer_bytes has 2 entries for 3 layers"):
        ModelProfile(3, [1, 2], hidden_size=1)
    with pytest.raises(PMetalValueError, match="at least one layer"):
        ModelProfile(0, 1, hidden_size=1)
    with pytest.raises(PMetalValueError, match="bandwidth > 0"):
        Link(0.0)
    model = ModelProfile(2, 1, hidden_size=1)
    with pytest.raises(PMetalValueError, match=r"nodes \['b'\] have no measured speed"):
        assign_layers_bandwidth_aware(model, [StageNode("a", 9, 1.0), StageNode("b", 9)], {})
    with pytest.raises(PMetalValueError, match="no link between 'a' and 'b'"):
        assign_layers_bandwidth_aware(model, [StageNode("a", 9, 1.0), StageNode("b", 9, 1.0)],
                                      {})
    with pytest.raises(PMetalValueError, match="node ids repeat"):
        assign_layers_proportional(model, [StageNode("a", 9), StageNode("a", 9)])


def test_describe_prints_a_line_per_stage_and_the_bottleneck() -> None:
    model = ModelProfile(4, 1 << 20, hidden_size=1000, layer_cost=1.0, head_cost=1.0,
                         token_bytes=0)
    nodes = [StageNode("a", 3 << 20, 1000.0), StageNode("b", 3 << 20, 1000.0)]
    got = assign_layers_bandwidth_aware(model, nodes, {("a", "b"): Link(4e6, 0.001)})
    assert got.describe() == (
        "2 stages (bandwidth-aware, exact):\n"
        "  stage 1  a  layers 0-1 (2)  2.00 MiB of 3.00 MiB free"
        "  compute 2.000 ms + send 2.000 ms = 4.000 ms/token\n"
        "  stage 2  b  layers 2-3 (2)  2.00 MiB of 3.00 MiB free"
        "  compute 3.000 ms + send 1.000 ms = 4.000 ms/token\n"
        "  bottleneck: stage 1 (a), 4.000 ms/token, at most 250.0 tokens/s with the pipeline"
        " full; one sequence alone 8.000 ms/token")
    untimed = assign_layers_proportional(model, nodes)
    assert untimed.describe().splitlines()[1] == (
        "  stage 1  a  layers 0-1 (2)  2.00 MiB of 3.00 MiB free")


def test_links_may_be_a_function() -> None:
    model = ModelProfile(4, 1, hidden_size=100, layer_cost=1.0)
    nodes = [StageNode("a", 3, 1.0), StageNode("b", 3, 1.0)]
    got = assign_layers_bandwidth_aware(model, nodes, lambda a, b: Link(400.0, 0.5))
    assert got.ranges == [(0, 2), (2, 4)]
    assert [s.transfer for s in got.stages] == [pytest.approx(1.5), pytest.approx(0.52)]


# ---------------------------------------------------- the default model's size

def smollm2(codec_factor: float = 1.0) -> ModelProfile:
    """SmolLM2-135M in float32 (its config.json), FLOPs per token as the cost."""
    return ModelProfile.llama(n_layers=30, hidden_size=576, intermediate_size=1536, n_heads=9,
                              n_kv_heads=3, vocab_size=49_152, tied_embeddings=True,
                              codec_factor=codec_factor)


def test_the_llama_profile_counts_the_default_models_parameters() -> None:
    model = smollm2()
    # 134,515,008 parameters: 30 layers of 3,540,096, the tied embedding and the final norm.
    assert model.bytes_per_layer == (3_540_096 * 4,) * 30
    assert model.total_bytes == 134_515_008 * 4
    assert model.cost_per_layer[0] == 2 * 3_540_096
    assert model.head_cost == 2 * 49_152 * 576
    assert model.activation_bytes == 576 * 4
    assert smollm2(0.5).activation_bytes == 576 * 2


def test_the_default_model_on_two_to_four_machines() -> None:
    model = smollm2()
    assert 530e6 < model.total_bytes < 545e6
    gflops = 20e9
    lan = Link(110e6, 0.3e-3)        # gigabit Ethernet
    wifi = Link(30e6, 3e-3)
    # Two machines with 400 MB free each: neither holds it alone.
    two = [StageNode("mac-a", 400_000_000, gflops), StageNode("mac-b", 400_000_000, gflops)]
    got = assign_layers_bandwidth_aware(model, two, {("mac-a", "mac-b"): lan})
    best, chain = brute_force(model, two, {("mac-a", "mac-b"): lan})
    assert got.time_per_token == pytest.approx(best) and got.node_ids == chain
    # The last stage also runs the head (as heavy as 8 layers), so it gets fewer layers.
    assert got.stages[0].end - got.stages[0].start > got.stages[1].end - got.stages[1].start
    assert "bottleneck: stage" in got.describe() and "mac-a" in got.describe()
    proportional = assign_layers_proportional(model, two, {("mac-a", "mac-b"): lan})
    assert proportional.ranges == [(0, 15), (15, 30)]
    assert got.time_per_token < proportional.time_per_token  # type: ignore[operator]

    # Three machines, one on Wi-Fi and twice as fast: brute force agrees.
    three = [*two, StageNode("laptop", 300_000_000, 2 * gflops)]
    links3 = {("mac-a", "mac-b"): lan, ("laptop", "mac-a"): wifi, ("laptop", "mac-b"): wifi}
    got = assign_layers_bandwidth_aware(model, three, links3)
    best, chain = brute_force(model, three, links3)
    assert got.time_per_token == pytest.approx(best) and got.node_ids == chain

    # Four machines, 200 MB each: all four are needed and each stage fits.
    four = [StageNode(f"m{i}", 200_000_000, gflops * (1 + i / 4)) for i in range(4)]
    links4 = {(a.node_id, b.node_id): lan for a, b in itertools.combinations(four, 2)}
    got = assign_layers_bandwidth_aware(model, four, links4)
    check_valid(model, four, got)
    assert len(got.stages) == 4
    assert assign_layers_bandwidth_aware(smollm2(0.25), four, links4).time_per_token \
        <= got.time_per_token          # int8 activations move a quarter of the bytes


def test_six_nodes_are_solved_exactly_and_quickly() -> None:
    model = smollm2()
    rng = random.Random(7)
    nodes = [StageNode(f"n{i}", rng.randint(100, 600) * 1_000_000, rng.uniform(5e9, 50e9))
             for i in range(6)]
    links = {(a.node_id, b.node_id): Link(10 ** rng.uniform(7, 9), rng.uniform(1e-4, 5e-3))
             for a, b in itertools.combinations(nodes, 2)}
    began = time.monotonic()
    got = assign_layers_bandwidth_aware(model, nodes, links)
    assert time.monotonic() - began < 20      # 1,956 chains; well under a second when idle
    assert got.strategy == "bandwidth-aware, exact"
    check_valid(model, nodes, got)
    many = [StageNode(f"n{i}", 100_000_000, 10e9) for i in range(12)]
    with pytest.raises(PlacementError, match=r"the stage with the embedding \(108\.00 MiB\) "
                       r"and a layer needs 121\.50 MiB, more than the 95\.37 MiB"):
        assign_layers_bandwidth_aware(model, many, lambda a, b: Link(1e8, 1e-3))
    many = [StageNode(f"n{i}", 150_000_000, 10e9) for i in range(12)]
    rough = assign_layers_bandwidth_aware(model, many, lambda a, b: Link(1e8, 1e-3))
    assert rough.strategy == "bandwidth-aware, heuristic"
    check_valid(model, many, rough)
