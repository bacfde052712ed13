"""Placement from measured figures (pmetal.pipeline.placement), and the
node's side of measuring them (pmetal.cluster.capacity).

The solver tests give plan_stages node lists as the driver's node reports
them (``client.status(measure=True)`` through ``cluster_nodes``), with and
without each figure; tests/pipeline/test_placement_throttled.py measures a
node that is really slower.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pmetal.cluster.capacity import (
    Capacity,
    ComputeMeter,
    LinkFigures,
    measure_compute_rate,
    usable_cpus,
)
from pmetal.errors import PlacementError, PMetalValueError, ProtocolError
from pmetal.pipeline.llama import SMOLLM2_135M
from pmetal.pipeline.placement import cluster_nodes, place_stages, plan_stages

GIB = 1 << 30
A, B, C = "a" * 32, "b" * 32, "c" * 32


def node(node_id: str, *, memory: float = 8 * GIB, cpus: float = 2,
         capacity: Capacity | dict[str, Any] | None = None) -> dict[str, Any]:
    return {"NodeID": node_id, "Alive": True, "Resources": {"memory": memory, "CPU": cpus},
            "Capacity": capacity.to_dict() if isinstance(capacity, Capacity) else capacity}


def measured(gflops: float, free: int = 8 * GIB, **links: LinkFigures) -> Capacity:
    return Capacity(memory_free=free, compute=gflops, compute_age=1.0, links=links)


def layers(plan: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in plan.placements:
        out[p.node_id] = out.get(p.node_id, 0) + p.end - p.start
    return out


# -------------------------------------------------------------- compute

def test_a_node_with_half_the_compute_rate_gets_fewer_layers() -> None:
    even = layers(plan_stages(SMOLLM2_135M, 2, [node(A, capacity=measured(40.0)),
                                                node(B, capacity=measured(40.0))]))
    plan = plan_stages(SMOLLM2_135M, 2, [node(A, capacity=measured(40.0)),
                                         node(B, capacity=measured(20.0))])
    got = layers(plan)
    assert sum(got.values()) == 30
    assert got[B] < got[A]
    # Not only the LM head's share: B gets fewer than either node of an even pair.
    assert got[B] < min(even.values()), (got, even)
    # The slowest stage is as fast as any cut makes it: B's stage time near A's.
    times = {p.node_id: s.time for p, s in zip(plan.placements, plan.assignment.stages)}
    assert max(times.values()) < 1.3 * min(times.values()), times
    text = plan.describe()
    assert "compute 40.0 GFLOP/s, measured" in text and "compute 20.0 GFLOP/s, measured" in text
    assert "free now, measured" in text


def test_the_faster_node_wins_whichever_the_order_given() -> None:
    for order in ([A, B], [B, A]):
        rates = {A: 10.0, B: 30.0}
        got = layers(plan_stages(SMOLLM2_135M, 2,
                                 [node(n, capacity=measured(rates[n])) for n in order]))
        assert got[B] > got[A], got


# --------------------------------------------------------------- memory

def test_a_node_with_too_little_free_memory_gets_no_stage_or_a_clear_error() -> None:
    # B advertises 8 GiB of memory but the OS has 64 MiB free on it now.
    nodes = [node(A, capacity=measured(20.0)),
             node(B, capacity=measured(80.0, free=64 << 20))]
    plan = plan_stages(SMOLLM2_135M, 1, nodes)
    assert [p.node_id for p in plan.placements] == [A]     # one stage: the roomy node
    with pytest.raises(PlacementError) as raised:
        plan_stages(SMOLLM2_135M, 2, nodes)
    message = str(raised.value)
    assert f"{A} 8.00 GiB (measured), {B} 64.00 MiB (measured)" in message
    assert "add nodes or free memory on them" in message
    assert "freeing memory on a node gives it more" in message


def test_free_memory_caps_what_a_stage_may_fill_and_a_budget_below_it_wins() -> None:
    layer = 4 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576)
    embedding = 4 * 49152 * 576
    # B has room (at 80%) for the head and two layers: it gets at most two.
    free = int((embedding + 576 * 4 + 2.5 * layer) / 0.8)
    plan = plan_stages(SMOLLM2_135M, 2, [node(A, capacity=measured(1.0)),
                                         node(B, capacity=measured(100.0, free=free))])
    assert 1 <= layers(plan)[B] <= 2
    assert "free now, measured" in plan.describe()
    # An advertised budget below the free memory is what a node offers.
    plan = plan_stages(SMOLLM2_135M, 2, [node(A, memory=1 * GIB, capacity=measured(10.0)),
                                         node(B, capacity=measured(10.0))])
    figures = {f.node_id: f for f in plan.nodes}
    assert (figures[A].memory, figures[A].memory_source) == (1 * GIB, "budget")
    assert (figures[B].memory, figures[B].memory_source) == (8 * GIB, "measured")


# ------------------------------------------------------------- defaults

def test_missing_figures_fall_back_to_the_constants_and_say_so() -> None:
    # No capacity at all: the advertised memory and the CPU count, as before.
    plan = plan_stages(SMOLLM2_135M, 2, [node(A, cpus=4), node(B, cpus=1)])
    assert layers(plan)[A] > layers(plan)[B]
    text = plan.describe()
    assert "compute default (4 CPUs, no rate measured)" in text
    assert "advertised, default (free memory not measured)" in text
    assert "latency default 0 (not measured)" in text
    assert "bandwidth default (not probed: pmetal status --probe)" in text
    assert not plan.timed
    # One node measured: the other computes at its CPUs times the measured rate per CPU.
    plan = plan_stages(SMOLLM2_135M, 2, [node(A, cpus=2, capacity=measured(30.0)),
                                         node(B, cpus=4)])
    figures = {f.node_id: f for f in plan.nodes}
    assert figures[A].compute_measured and not figures[B].compute_measured
    assert figures[B].compute == pytest.approx(60e9)
    assert "60.0 GFLOP/s, default (4 CPUs at the measured nodes' 15.0 GFLOP/s per CPU)" \
        in plan.describe()
    assert plan.timed


def test_measured_links_are_used_and_described() -> None:
    slow = LinkFigures(latency=0.004, bandwidth=1e6)
    plan = plan_stages(SMOLLM2_135M, 2, [node(A, capacity=measured(40.0, **{B: slow})),
                                         node(B, capacity=measured(40.0))])
    (link,) = plan.links
    assert (link.latency, link.bandwidth) == (0.004, 1e6)
    sends = [s.transfer for s in plan.assignment.stages]
    # The first stage sends a 576-float activation over it, the last a token back.
    assert sends[0] == pytest.approx(0.004 + 576 * 4 / 1e6)
    assert sends[1] == pytest.approx(0.004 + 8 / 1e6)
    assert "latency 4.000 ms measured, bandwidth 1.0 MB/s measured" in plan.describe()
    # Where both ends measured, the mean.
    plan = plan_stages(SMOLLM2_135M, 2, [
        node(A, capacity=measured(40.0, **{B: LinkFigures(0.001)})),
        node(B, capacity=measured(40.0, **{A: LinkFigures(0.003, 2e6)}))])
    assert (plan.links[0].latency, plan.links[0].bandwidth) == (pytest.approx(0.002), 2e6)


def test_stages_of_one_node_share_its_rate_and_memory() -> None:
    plan = plan_stages(SMOLLM2_135M, 3, [node(A, capacity=measured(30.0)),
                                         node(B, memory=4 * GIB, capacity=measured(30.0,
                                                                                  4 * GIB))])
    assert [f.stages for f in plan.nodes] == [2, 1]
    assert place_stages(SMOLLM2_135M, 3, [node(A), node(B)]) \
        == list(plan_stages(SMOLLM2_135M, 3, [node(A), node(B)]).placements)


def test_a_malformed_capacity_is_refused_with_the_node_named() -> None:
    with pytest.raises(PMetalValueError, match="node bbbbbbbb sent an unreadable capacity"):
        plan_stages(SMOLLM2_135M, 2, [node(A), node(B, capacity={"compute": -1})])
    for bad in ({"memory_free": "lots"}, {"compute": True}, {"links": [1]},
                {"links": {"x": {"latency": "slow"}}}, [], {"compute_age": float("nan")}):
        with pytest.raises(ProtocolError):
            Capacity.from_dict(bad)
    # Unknown keys are a newer peer's: ignored.
    assert Capacity.from_dict({"compute": 3, "future": 1}).compute == 3.0


def test_cluster_nodes_reads_a_status() -> None:
    cap = measured(12.0).to_dict()
    info = {"node_id": A, "resources": {"CPU": 2.0}, "cluster": {"members": [
        {"node_id": A, "resources": {"CPU": 2.0}, "health": "self", "capacity": cap},
        {"node_id": B, "resources": {}, "state": "dead"}]}}
    nodes = cluster_nodes(info)
    assert [(n["NodeID"], n["Alive"], n["Capacity"]) for n in nodes] \
        == [(A, True, cap), (B, False, None)]
    alone = cluster_nodes({"node_id": C, "resources": {"CPU": 1.0}})
    assert alone == [{"NodeID": C, "Resources": {"CPU": 1.0}, "Alive": True}]


# ---------------------------------------------------------- the measure

def test_the_compute_rate_is_measured_over_the_window_on_every_usable_cpu() -> None:
    assert measure_compute_rate(0.02, threads=1) > 0
    assert measure_compute_rate(0.02) > 0
    assert usable_cpus() >= 1
    with pytest.raises(PMetalValueError, match="window"):
        measure_compute_rate(0)
    with pytest.raises(PMetalValueError, match="threads"):
        measure_compute_rate(0.01, threads=0)


def test_the_meter_measures_on_first_need_once_and_again_when_stale() -> None:
    now = [100.0]
    calls: list[float] = []

    def measure(window: float) -> float:
        calls.append(window)
        return 10.0 * len(calls)

    meter = ComputeMeter(window=0.01, refresh=60.0, clock=lambda: now[0], measure=measure)
    assert meter.cached() == (0.0, None)         # nothing measured at creation

    async def steps() -> None:
        got = await asyncio.gather(*(meter.rate() for _ in range(3)))
        assert got == [(10.0, 0.0)] * 3            # callers at once share one measurement
        now[0] += 30.0
        assert await meter.rate() == (10.0, 30.0)
        now[0] += 31.0
        assert await meter.rate() == (20.0, 0.0)

    asyncio.run(steps())
    assert calls == [0.01, 0.01] and meter.measurements == 2

    def broken(window: float) -> float:
        raise OSError("no numpy today")

    failing = ComputeMeter(measure=broken)
    assert asyncio.run(failing.rate()) == (0.0, None)
    assert (failing.statistics().failures, failing.statistics().measurements) == (1, 0)
    stats = meter.statistics()
    assert (stats.measurements, stats.failures, stats.rate, stats.age) == (2, 0, 20.0, 0.0)


# ------------------------------------------------------- from_pretrained

def test_a_pipeline_is_placed_by_its_nodes_measured_figures(cluster: Any) -> None:
    from pmetal.pipeline.llama import LlamaConfig
    from pmetal.pipeline.pipeline import Pipeline

    tiny = LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64)
    with Pipeline.from_pretrained(random_model=tiny, stages=2, max_len=32, threads=1) as pipe:
        plan = pipe.plan
        assert plan is not None
        assert list(plan.placements) == pipe.placements
        (figures,) = plan.nodes              # the embedded node, holding both stages
        assert figures.compute_measured and figures.compute > 0
        assert figures.memory_source == "measured" and figures.stages == 2
        assert "GFLOP/s, measured" in plan.describe()
