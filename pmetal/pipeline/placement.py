"""Where a pipeline's stages run: the cluster's measured figures, fed to the layer solver.

The driver asks its node for every member's capacity
(``client.status(measure=True)``, read by :func:`cluster_nodes`): each
node's compute rate and free memory measured now, and the links it measured
(latency from heartbeats, bandwidth from probes); see
:mod:`pmetal.cluster.capacity`. :func:`plan_stages` turns them into the
solver's inputs (:mod:`pmetal.pipeline.assignment`): one slot per stage,
the stages going round the nodes with the most usable memory first, and
cuts the layers so that the slowest stage is as fast as it can be.

A figure that was not measured falls back to what placement used before
it measured anything: a node's advertised ``memory`` resource, its ``CPU``
count (at the measured nodes' rate per CPU when some were measured, so the
units agree), a link that costs nothing. :meth:`StagePlan.describe` says
which figures were measured and which were defaults.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pmetal.cluster.capacity import Capacity
from pmetal.errors import PlacementError, PMetalValueError, ProtocolError
from pmetal.pipeline.assignment import (
    Assignment,
    Link,
    ModelProfile,
    StageNode,
    _ms,
    _size,
    assign_layers_bandwidth_aware,
    assign_layers_proportional,
)
from pmetal.pipeline.llama import LlamaConfig

__all__ = ["LinkFigure", "NodeFigures", "StagePlacement", "StagePlan", "cluster_nodes",
           "place_stages", "plan_stages"]

DEFAULT_BANDWIDTH = 1e12   # B/s of a link not probed, and between stages of one node
UNBOUNDED = 2 ** 62        # bytes of a node that neither advertises nor measured memory


@dataclass(frozen=True)
class StagePlacement:
    """Where one stage runs and which layers it holds."""

    index: int
    node_id: str
    start: int
    end: int


@dataclass(frozen=True)
class NodeFigures:
    """What placement used of one node. ``memory``: bytes it may fill (its
    stages share ``memory_fraction`` of it); ``compute``: FLOP/s when
    ``compute_measured`` or some other node's rate was (then this one is
    its CPUs at their rate per CPU), else its CPU count."""

    node_id: str
    memory: int
    memory_source: str       # "measured", "budget" (advertised, below free), "advertised", "none"
    compute: float
    compute_measured: bool
    compute_age: float | None
    cpus: float
    stages: int


@dataclass(frozen=True)
class LinkFigure:
    """What placement used of the link between two nodes; None where not
    measured (then no latency, and :data:`DEFAULT_BANDWIDTH`)."""

    a: str
    b: str
    latency: float | None
    bandwidth: float | None

    @property
    def link(self) -> Link:
        return Link(self.bandwidth or DEFAULT_BANDWIDTH, self.latency or 0.0)


@dataclass(frozen=True)
class StagePlan:
    """The placements, the solver's answer (over stage slots named
    ``"index:node id"``) and the figures it was given."""

    placements: tuple[StagePlacement, ...]
    assignment: Assignment
    nodes: tuple[NodeFigures, ...]
    links: tuple[LinkFigure, ...]
    memory_fraction: float
    per_cpu: float = 0.0     # FLOP/s per CPU of the measured nodes (unmeasured ones' default)

    @property
    def timed(self) -> bool:
        """Whether the stage times are seconds (some compute was measured)."""
        return any(n.compute_measured for n in self.nodes)

    def describe(self) -> str:
        """Lines for the log and ``pmetal generate``: each stage, then each
        figure used and whether it was measured or a default."""
        a = self.assignment
        n = len(self.placements)
        lines = [f"{n} stage{'s' if n != 1 else ''} ({a.strategy}):"]
        for p, s in zip(self.placements, a.stages, strict=True):
            line = f"  stage {p.index}  node {p.node_id[:8]}  layers {p.start}-{p.end - 1} " \
                   f"({p.end - p.start})"
            if self.timed and s.time is not None:
                line += (f"  compute {_ms(s.compute)} + send {_ms(s.transfer)} per token")
            lines.append(line)
        per_cpu = self.per_cpu
        for f in self.nodes:
            if f.compute_measured:
                compute = (f"compute {f.compute / 1e9:.1f} GFLOP/s, measured"
                           + (f" {f.compute_age:.0f} s ago" if f.compute_age else ""))
            elif per_cpu:
                compute = (f"compute {f.compute / 1e9:.1f} GFLOP/s, default ({f.cpus:g} CPUs at "
                           f"the measured nodes' {per_cpu / 1e9:.1f} GFLOP/s per CPU)")
            else:
                compute = f"compute default ({f.cpus:g} CPUs, no rate measured)"
            memory = {"measured": "free now, measured",
                      "budget": "its memory budget (below the free memory measured)",
                      "advertised": "advertised, default (free memory not measured)",
                      "none": "unbounded, default (neither advertised nor measured)"}
            lines.append(f"  node {f.node_id[:8]}: {compute}; memory "
                         f"{_size(f.memory) if f.memory < UNBOUNDED else '-'} "
                         f"{memory[f.memory_source]}, {self.memory_fraction:.0%} usable over "
                         f"its {f.stages} stage{'s' if f.stages != 1 else ''}")
        for link in self.links:
            latency = (f"latency {_ms(link.latency)} measured" if link.latency is not None
                       else "latency default 0 (not measured)")
            bandwidth = (f"bandwidth {link.bandwidth / 1e6:.1f} MB/s measured"
                         if link.bandwidth is not None else
                         "bandwidth default (not probed: pmetal status --probe)")
            lines.append(f"  link {link.a[:8]}-{link.b[:8]}: {latency}, {bandwidth}")
        return "\n".join(lines)


def cluster_nodes(info: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The live nodes in a node's status (``client.status()``), as
    :func:`pmetal.nodes` lists them, plus each one's ``Capacity`` when the
    status was asked with ``measure``."""
    members = (info.get("cluster") or {}).get("members") or []
    out = [{"NodeID": m["node_id"], "Resources": m.get("resources") or {},
            "Address": m.get("address", ""), "Capacity": m.get("capacity"),
            "Alive": m.get("state") != "dead" and m.get("health") != "dead"} for m in members]
    return out or [{"NodeID": info["node_id"], "Resources": info["resources"], "Alive": True}]


def place_stages(config: LlamaConfig, stages: int, nodes: Sequence[Mapping[str, Any]],
                 *, memory_fraction: float = 0.8,
                 profile: ModelProfile | None = None) -> list[StagePlacement]:
    """The placements of :func:`plan_stages`."""
    return list(plan_stages(config, stages, nodes, memory_fraction=memory_fraction,
                            profile=profile).placements)


def plan_stages(config: LlamaConfig, stages: int, nodes: Sequence[Mapping[str, Any]],
                *, memory_fraction: float = 0.8,
                profile: ModelProfile | None = None) -> StagePlan:
    """Split ``config``'s layers over ``stages`` stages on the live ``nodes``
    (as :func:`cluster_nodes` lists them; a node without ``Capacity`` gets
    the defaults). The stages go round the nodes with the most usable memory
    first; each stage may use its node's memory over the stages there, times
    ``memory_fraction``, and computes at its node's rate over the stages
    there. The cuts and the order of the stages make the slowest stage as
    fast as they can (:func:`~pmetal.pipeline.assignment.assign_layers_bandwidth_aware`
    with exactly ``stages`` stages: the last stage's LM head counts, about 8
    layers of SmolLM2-135M; a slower node gets fewer layers);
    :func:`~pmetal.pipeline.assignment.assign_layers_proportional` (by
    memory) when that finds no split. ``profile``: the model's sizes as its
    backend holds them (default: float32 weights).
    Raises :class:`PlacementError`, naming what the model needs and what
    each node has, when the stages cannot fit."""
    if type(stages) is not int or stages < 1:
        raise PMetalValueError(f"stages {stages!r} must be an int >= 1")
    if stages > config.num_hidden_layers:
        raise PlacementError(f"{stages} stages for a model of {config.num_hidden_layers} "
                             "layers: every stage needs at least one layer")
    live = [n for n in nodes if n.get("Alive", True)]
    if not live:
        raise PlacementError("no live node to place the pipeline's stages on")
    capacities = {n["NodeID"]: _capacity(n) for n in live}
    memory = {n["NodeID"]: _memory(n, capacities[n["NodeID"]]) for n in live}
    live.sort(key=lambda n: -memory[n["NodeID"]][0])
    owners = [live[i % len(live)]["NodeID"] for i in range(stages)]
    figures, per_cpu = _node_figures(live, capacities, memory, owners)
    links = _link_figures([n for n in live if n["NodeID"] in owners], capacities)
    by_id = {f.node_id: f for f in figures}
    slots = []
    for i, node_id in enumerate(owners):
        f = by_id[node_id]
        share = f.memory * memory_fraction / f.stages if f.memory < UNBOUNDED else UNBOUNDED
        # Zero-padded, so that the solver's ties go to the chain in this order.
        slots.append(StageNode(f"{i:04d}:{node_id}", int(share), f.compute / f.stages))
    table = {(x.a, x.b): x.link for x in links}

    def link(a: str, b: str) -> Link:
        a, b = a.partition(":")[2], b.partition(":")[2]
        return table.get((a, b)) or table.get((b, a)) or Link(DEFAULT_BANDWIDTH)

    profile = profile or ModelProfile.llama(
        n_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads, vocab_size=config.vocab_size,
        tied_embeddings=config.tie_word_embeddings)
    try:
        try:
            assignment = assign_layers_bandwidth_aware(profile, slots, link, stages=stages)
        except PlacementError as searched:
            # Above the exact search's limit the heuristic may miss a split.
            assignment = assign_layers_proportional(profile, slots, link)
            if len(assignment.stages) != stages:
                raise searched from None
    except PlacementError as exc:
        # The solvers see only the stages' slots; say what every node has.
        has = ", ".join(f"{node_id} {_size(size)} ({source})"
                        for node_id, (size, source) in memory.items() if size < UNBOUNDED)
        raise PlacementError(
            f"{stages} stage(s) cannot hold the model: {exc}. The live nodes have {has} "
            f"(a stage may use {memory_fraction:.0%} of its node's share); more stages "
            "spread the layers over more nodes, fewer leave the most cramped out, and "
            "freeing memory on a node gives it more") from exc
    placements = tuple(StagePlacement(i, s.node_id.partition(":")[2], s.start, s.end)
                       for i, s in enumerate(assignment.stages))
    return StagePlan(placements, assignment, tuple(figures), tuple(links), memory_fraction,
                     per_cpu)


# ----------------------------------------------------------------- internals

def _capacity(node: Mapping[str, Any]) -> Capacity | None:
    data = node.get("Capacity")
    if data is None:
        return None
    if isinstance(data, Capacity):
        return data
    try:
        return Capacity.from_dict(data)
    except ProtocolError as exc:
        raise PMetalValueError(f"node {str(node.get('NodeID'))[:8]} sent an unreadable "
                               f"capacity: {exc}") from exc


def _memory(node: Mapping[str, Any], capacity: Capacity | None) -> tuple[int, str]:
    """The bytes placement may fill on ``node`` and where the figure came
    from: the free memory measured now, capped by an advertised budget
    below it; else the advertised ``memory`` resource."""
    advertised = int(float((node.get("Resources") or {}).get("memory", 0.0)))
    free = capacity.memory_free if capacity is not None else 0
    if free:
        return (advertised, "budget") if 0 < advertised < free else (free, "measured")
    return (advertised, "advertised") if advertised else (UNBOUNDED, "none")


def _node_figures(live: list[Mapping[str, Any]], capacities: Mapping[str, Capacity | None],
                  memory: Mapping[str, tuple[int, str]],
                  owners: list[str]) -> tuple[list[NodeFigures], float]:
    cpus = {n["NodeID"]: max(float((n.get("Resources") or {}).get("CPU", 1.0)), 1.0)
            for n in live}
    measured = {i: c.compute * 1e9 for i, c in capacities.items()
                if c is not None and c.compute > 0}
    per_cpu = statistics.median(measured[i] / cpus[i] for i in measured) if measured else 0.0
    out = []
    for node_id in dict.fromkeys(owners):
        capacity = capacities[node_id]
        out.append(NodeFigures(
            node_id, *memory[node_id],
            measured.get(node_id, cpus[node_id] * per_cpu if per_cpu else cpus[node_id]),
            node_id in measured, capacity.compute_age if capacity is not None else None,
            cpus[node_id], owners.count(node_id)))
    return out, per_cpu


def _link_figures(live: list[Mapping[str, Any]],
                  capacities: Mapping[str, Capacity | None]) -> list[LinkFigure]:
    """Each pair of live nodes' link as either end measured it (the mean
    where both did)."""
    ids = [n["NodeID"] for n in live]
    out = []
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            seen = [c.links[peer] for c, peer in ((capacities[a], b), (capacities[b], a))
                    if c is not None and peer in c.links]
            latency = [f.latency for f in seen if f.latency is not None]
            bandwidth = [f.bandwidth for f in seen if f.bandwidth]
            out.append(LinkFigure(a, b, statistics.fmean(latency) if latency else None,
                                  statistics.fmean(bandwidth) if bandwidth else None))
    return out
