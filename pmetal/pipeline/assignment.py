"""Which node runs which layers: contiguous layer ranges over a chain of nodes.

Pure logic (numpy, no I/O): the master's shell feeds it the model's sizes
and the nodes' measured free memory, speed and links, and places the stage
actors it returns. Two strategies:

* :func:`assign_layers_proportional` keeps the nodes in the order given and
  shares the layers out in proportion to the memory each has free for them,
  with largest-remainder rounding. It needs no measurements but memory.
* :func:`assign_layers_bandwidth_aware` chooses which nodes take part, in
  what order, and where to cut, to make the slowest stage as fast as
  possible. A stage's time per token is its layers' compute on its node
  plus sending the activation to the next stage over the measured link
  (the last stage computes the head and sends the sampled token back to the
  first). The slowest stage bounds the tokens/s of a full pipeline. Exact
  (every chain, a dynamic programme over the cuts) up to ``exact_limit``
  nodes; above, a heuristic chain (see the function).

Both check that each node's share fits in its free memory (the first stage
also holds the token embedding, the last the final norm and output head)
and raise :class:`~pmetal.errors.PlacementError` saying by how much the
model misses when it cannot fit.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pmetal.errors import PlacementError, PMetalValueError

__all__ = [
    "Assignment",
    "Link",
    "ModelProfile",
    "Stage",
    "StageNode",
    "assign_layers_bandwidth_aware",
    "assign_layers_proportional",
]

EXACT_LIMIT = 6          # clusters up to this many nodes are searched exhaustively
_TIE = 1e-9              # relative: bottlenecks this close count as equal


# ------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class ModelProfile:
    """A decoder's sizes as the solver needs them.

    ``layer_bytes`` and ``layer_cost`` are per layer: one number for every
    layer, or a sequence of ``n_layers``. Costs are in any unit (FLOPs per
    token is natural) as long as :attr:`StageNode.speed` uses the same unit
    per second. ``embedding_bytes`` is held by the first stage,
    ``head_bytes`` (final norm and output projection) and ``head_cost`` by
    the last; with ``tied_embeddings`` one node that is both holds the
    matrix once. Between stages one token's activation is ``hidden_size *
    dtype_bytes * codec_factor`` bytes (``codec_factor`` 0.5 for fp16 over
    a float32 model, about 0.25 for int8); the last stage sends back
    ``token_bytes``.
    """

    n_layers: int
    layer_bytes: int | Sequence[int]
    hidden_size: int
    embedding_bytes: int = 0
    head_bytes: int = 0
    tied_embeddings: bool = False
    layer_cost: float | Sequence[float] = 1.0
    head_cost: float = 0.0
    dtype_bytes: int = 4
    codec_factor: float = 1.0
    token_bytes: int = 8

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise PMetalValueError(f"a model needs at least one layer, not {self.n_layers}")
        for name in ("layer_bytes", "layer_cost"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)):
                object.__setattr__(self, name, tuple(value))
                if len(getattr(self, name)) != self.n_layers:
                    raise PMetalValueError(
                        f"{name} has {len(getattr(self, name))} entries for {self.n_layers} layers")
        numbers = {"hidden_size": self.hidden_size, "embedding_bytes": self.embedding_bytes,
                   "head_bytes": self.head_bytes, "head_cost": self.head_cost,
                   "dtype_bytes": self.dtype_bytes, "codec_factor": self.codec_factor,
                   "token_bytes": self.token_bytes}
        for name, value in numbers.items():
            if not value >= 0:
                raise PMetalValueError(f"{name} must be >= 0, not {value}")
        if min(self.bytes_per_layer) < 0 or min(self.cost_per_layer) < 0:
            raise PMetalValueError("layer_bytes and layer_cost must be >= 0")

    @classmethod
    def llama(cls, *, n_layers: int, hidden_size: int, intermediate_size: int, n_heads: int,
              n_kv_heads: int, vocab_size: int, tied_embeddings: bool,
              weight_bytes: float = 4, dtype_bytes: int = 4,
              codec_factor: float = 1.0) -> ModelProfile:
        """The profile of a Llama-architecture decoder from its config:
        ``weight_bytes`` per parameter as held in memory (4 for float32), cost
        in FLOPs per token (two per weight; attention over the context is left
        out, small at the lengths a home cluster serves)."""
        head_dim = hidden_size // n_heads
        attention = 2 * hidden_size * hidden_size + 2 * hidden_size * n_kv_heads * head_dim
        per_layer = attention + 3 * hidden_size * intermediate_size + 2 * hidden_size
        embedding = vocab_size * hidden_size
        return cls(n_layers, int(per_layer * weight_bytes), hidden_size,
                   embedding_bytes=int(embedding * weight_bytes),
                   head_bytes=int((embedding + hidden_size) * weight_bytes),
                   tied_embeddings=tied_embeddings, layer_cost=2.0 * per_layer,
                   head_cost=2.0 * embedding, dtype_bytes=dtype_bytes, codec_factor=codec_factor)

    @property
    def bytes_per_layer(self) -> tuple[int, ...]:
        if isinstance(self.layer_bytes, (int, float)):
            return (int(self.layer_bytes),) * self.n_layers
        return tuple(int(b) for b in self.layer_bytes)

    @property
    def cost_per_layer(self) -> tuple[float, ...]:
        if isinstance(self.layer_cost, (int, float)):
            return (float(self.layer_cost),) * self.n_layers
        return tuple(float(c) for c in self.layer_cost)

    @property
    def activation_bytes(self) -> float:
        """Bytes one token's hidden state takes between two stages."""
        return self.hidden_size * self.dtype_bytes * self.codec_factor

    @property
    def total_bytes(self) -> int:
        """The whole model in one place."""
        return sum(self.bytes_per_layer) + self.fixed_bytes(first=True, last=True)

    def fixed_bytes(self, *, first: bool, last: bool) -> int:
        """Bytes beyond its layers a stage holds: embedding if first, head if last."""
        if first and last and self.tied_embeddings:
            return max(self.embedding_bytes, self.head_bytes)
        return (self.embedding_bytes if first else 0) + (self.head_bytes if last else 0)


@dataclass(frozen=True)
class StageNode:
    """A node that may run a stage: its free memory in bytes and its measured
    speed in layer-cost units per second (0.0 when not measured; the
    bandwidth-aware solver needs it)."""

    node_id: str
    memory_free: int
    speed: float = 0.0

    def __post_init__(self) -> None:
        if self.memory_free < 0 or not self.speed >= 0:
            raise PMetalValueError(f"node {self.node_id!r}: memory_free and speed must be >= 0")


@dataclass(frozen=True)
class Link:
    """A link between two nodes: ``bandwidth`` in bytes/s, ``latency`` one way in s."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise PMetalValueError(
                f"a link needs bandwidth > 0 and latency >= 0, not {self.bandwidth}, {self.latency}")

    def time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` one way."""
        return self.latency + nbytes / self.bandwidth


Links = Mapping[tuple[str, str], Link] | Callable[[str, str], Link]


# ------------------------------------------------------------------ outputs

@dataclass(frozen=True)
class Stage:
    """One stage: ``node_id`` runs layers ``[start, end)``. Times are the
    predicted seconds per token (None when the node's speed or the link was
    not given): ``compute`` its layers (and the head on the last stage),
    ``transfer`` sending the result on."""

    node_id: str
    start: int
    end: int
    memory_bytes: int
    memory_free: int
    compute: float | None
    transfer: float | None

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    @property
    def time(self) -> float | None:
        if self.compute is None or self.transfer is None:
            return None
        return self.compute + self.transfer


@dataclass(frozen=True)
class Assignment:
    """Stages in pipeline order; ``strategy`` says how they were chosen."""

    stages: tuple[Stage, ...]
    strategy: str

    @property
    def node_ids(self) -> list[str]:
        return [s.node_id for s in self.stages]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.start, s.end) for s in self.stages]

    @property
    def memory(self) -> dict[str, int]:
        """Bytes each taking part node holds."""
        return {s.node_id: s.memory_bytes for s in self.stages}

    @property
    def bottleneck(self) -> Stage | None:
        """The slowest stage (the first of equals), None when not timed."""
        times = [s.time for s in self.stages]
        if any(t is None for t in times):
            return None
        return self.stages[int(np.argmax(np.asarray(times, dtype=np.float64)))]

    @property
    def time_per_token(self) -> float | None:
        """The slowest stage's time: a full pipeline's seconds per token."""
        slowest = self.bottleneck
        return None if slowest is None else slowest.time

    @property
    def latency_per_token(self) -> float | None:
        """All stages' times added: one sequence alone, seconds per token."""
        times = [s.time for s in self.stages]
        return None if any(t is None for t in times) else math.fsum(times)  # type: ignore[arg-type]

    def describe(self) -> str:
        """Several lines for ``pmetal generate``: one per stage, then the bottleneck."""
        n = len(self.stages)
        lines = [f"{n} stage{'s' if n != 1 else ''} ({self.strategy}):"]
        for i, s in enumerate(self.stages, 1):
            line = (f"  stage {i}  {s.node_id}  layers {s.start}-{s.end - 1} ({s.end - s.start})"
                    f"  {_size(s.memory_bytes)} of {_size(s.memory_free)} free")
            if s.time is not None:
                line += (f"  compute {_ms(s.compute)} + send {_ms(s.transfer)}"
                         f" = {_ms(s.time)}/token")
            lines.append(line)
        slowest = self.bottleneck
        if slowest is not None:
            rate = 1.0 / slowest.time if slowest.time else math.inf  # type: ignore[operator]
            lines.append(f"  bottleneck: stage {self.stages.index(slowest) + 1} ({slowest.node_id}),"
                         f" {_ms(slowest.time)}/token, at most {rate:.1f} tokens/s with the"
                         f" pipeline full; one sequence alone {_ms(self.latency_per_token)}/token")
        return "\n".join(lines)


# ---------------------------------------------------------------- strategies

def assign_layers_proportional(model: ModelProfile, nodes: Sequence[StageNode],
                               links: Links | None = None) -> Assignment:
    """Contiguous ranges in the order of ``nodes``, each node's share of the
    layers in proportion to the memory it has free for layers (its free
    memory less the embedding on the first node and the head on the last),
    rounded by largest remainder (ties to the earlier node). A node whose
    share rounds to 0 is left out. Times are filled in where speeds and
    ``links`` are given.

    Raises PlacementError when the model is larger than the memory free in
    all nodes together, or when a node's share does not fit in it (possible
    with layers of uneven size; the bandwidth-aware solver searches every
    split)."""
    nodes = _check_nodes(nodes)
    _check_total(model, nodes)
    n, count = len(nodes), model.n_layers
    weights = [max(0, node.memory_free - model.fixed_bytes(first=i == 0, last=i == n - 1))
               for i, node in enumerate(nodes)]
    total = sum(weights)
    if total == 0:
        raise PlacementError(_shortfall(model, nodes, "no node has memory free beyond the "
                                        "embedding and head"))
    # Integer arithmetic, so equal remainders are equal and ties are decided by order.
    shares = [count * w // total for w in weights]
    remainders = [count * w % total for w in weights]
    for i in sorted(range(n), key=lambda i: (-remainders[i], i))[:count - sum(shares)]:
        shares[i] += 1
    chain, cuts, start = [], [0], 0
    for node, share in zip(nodes, shares):
        if share:
            chain.append(node)
            start += share
            cuts.append(start)
    costs = _Costs(model, links)
    stages = costs.stages(chain, cuts, timed=links is not None and all(n.speed > 0 for n in chain))
    for stage in stages:
        if stage.memory_bytes > stage.memory_free:
            raise PlacementError(_shortfall(
                model, nodes,
                f"node {stage.node_id!r} would hold layers {stage.start}-{stage.end - 1} "
                f"({_size(stage.memory_bytes)} with what the stage keeps beside them) but has "
                f"{_size(stage.memory_free)} free; assign_layers_bandwidth_aware searches "
                f"every split"))
    return Assignment(tuple(stages), "proportional to free memory")


def assign_layers_bandwidth_aware(model: ModelProfile, nodes: Sequence[StageNode],
                                  links: Links, *,
                                  exact_limit: int = EXACT_LIMIT,
                                  stages: int | None = None) -> Assignment:
    """The chain and cuts that make the slowest stage fastest.

    A stage's time per token is ``(its layers' cost [+ head_cost if last]) /
    speed`` plus ``link.time(activation_bytes)`` to the next node, or, on the
    last stage, ``link.time(token_bytes)`` back to the first (nothing for a
    single stage). Every stage holds at least one layer and fits in its
    node's free memory.

    With at most ``exact_limit`` nodes every subset in every order is tried,
    each with an exact dynamic programme over the cut points (O(layers^2) per
    stage, vectorised), so the result is optimal. Ties, bottlenecks within a
    relative 1e-9, go to the fewest stages, then the chain first in node-id
    order, then each cut as early as it can be, from the last one back: every
    master computes the same answer.
    Above the limit, a heuristic: chains grown greedily (from the fastest
    node, each next the one with the quickest link to the last; and by free
    memory, largest first), every prefix of each solved exactly for its cuts.

    ``stages``: exactly this many stages (chains of that length only), where
    the default lets the solver leave slow or distant nodes out.

    ``links`` maps a pair of node ids (either order) to a :class:`Link`, or is
    a function of two node ids returning one. Raises PlacementError when no
    split fits in memory, PMetalValueError when a node's speed is 0."""
    nodes = sorted(_check_nodes(nodes), key=lambda node: node.node_id)
    slow = [node.node_id for node in nodes if node.speed <= 0]
    if slow:
        raise PMetalValueError(f"nodes {slow} have no measured speed; the bandwidth-aware "
                               f"solver needs every node's speed (or use "
                               f"assign_layers_proportional)")
    if stages is not None and not (type(stages) is int and 1 <= stages <= len(nodes)):
        raise PMetalValueError(f"stages {stages!r} must be an int from 1 to the {len(nodes)} "
                               f"nodes given")
    _check_total(model, nodes)
    costs = _Costs(model, links)
    lengths = range(1, len(nodes) + 1) if stages is None else (stages,)
    if len(nodes) <= exact_limit:
        chains: Sequence[tuple[StageNode, ...]] = [
            chain for k in lengths for chain in itertools.permutations(nodes, k)]
        strategy = "bandwidth-aware, exact"
    else:
        chains = [c for c in _heuristic_chains(nodes, costs) if len(c) in lengths]
        strategy = "bandwidth-aware, heuristic"
    solved = [(*costs.solve(chain), chain) for chain in chains]
    solved = [found for found in solved if math.isfinite(found[0])]
    if not solved:
        raise PlacementError(_shortfall(model, nodes, _why_no_split(model, nodes)))
    least = min(value for value, _, _ in solved)
    # Chains come by length then id order, so the first of the (near) equals wins.
    _, cuts, chain = next(found for found in solved if found[0] <= least * (1 + _TIE))
    return Assignment(tuple(costs.stages(list(chain), cuts, timed=True)), strategy)


# ----------------------------------------------------------------- internals

class _Costs:
    """Stage costs for one model and one set of links, with the stage-time
    matrices of a (node, role, next) cached across the chains that share it."""

    def __init__(self, model: ModelProfile, links: Links | None) -> None:
        self.model = model
        self._links = links
        self._prefix_cost = np.concatenate(([0.0], np.cumsum(model.cost_per_layer)))
        self._prefix_bytes = np.concatenate(([0], np.cumsum(model.bytes_per_layer)))
        self._matrices: dict[tuple[str, bool, bool, str | None], np.ndarray] = {}

    def link(self, a: str, b: str) -> Link:
        links = self._links
        if links is None:
            raise PMetalValueError("no links given")
        if callable(links):
            return links(a, b)
        found = links.get((a, b)) or links.get((b, a))
        if found is None:
            raise PMetalValueError(f"no link between {a!r} and {b!r}; the links must cover "
                                   f"every pair of nodes")
        return found

    def transfer(self, node: StageNode, after: StageNode | None, first: StageNode) -> float:
        """Seconds a stage spends sending on: the activation to ``after``, or
        (last stage) the token back to ``first``."""
        if after is not None:
            return self.link(node.node_id, after.node_id).time(self.model.activation_bytes)
        if node is first:
            return 0.0
        return self.link(node.node_id, first.node_id).time(self.model.token_bytes)

    def stages(self, chain: list[StageNode], cuts: list[int], *, timed: bool) -> list[Stage]:
        out = []
        for i, node in enumerate(chain):
            start, end = cuts[i], cuts[i + 1]
            first, last = i == 0, i == len(chain) - 1
            memory = (int(self._prefix_bytes[end] - self._prefix_bytes[start])
                      + self.model.fixed_bytes(first=first, last=last))
            compute = transfer = None
            if timed:
                work = float(self._prefix_cost[end] - self._prefix_cost[start])
                compute = (work + (self.model.head_cost if last else 0.0)) / node.speed
                transfer = self.transfer(node, None if last else chain[i + 1], chain[0])
            out.append(Stage(node.node_id, start, end, memory, node.memory_free,
                             compute, transfer))
        return out

    def _matrix(self, node: StageNode, first: bool, last: bool, send: float,
                after: str | None) -> np.ndarray:
        """``T[s, e]``: the stage's seconds per token when it holds layers
        ``[s, e)``; inf where e <= s or the layers do not fit."""
        key = (node.node_id, first, last, after)
        found = self._matrices.get(key)
        if found is not None:
            return found
        pc, pb = self._prefix_cost, self._prefix_bytes
        head = self.model.head_cost if last else 0.0
        times = (pc[None, :] - pc[:, None] + head) / node.speed + send
        memory = pb[None, :] - pb[:, None] + self.model.fixed_bytes(first=first, last=last)
        ok = np.triu(np.ones_like(times, dtype=bool), 1) & (memory <= node.memory_free)
        matrix = np.where(ok, times, np.inf)
        self._matrices[key] = matrix
        return matrix

    def solve(self, chain: Sequence[StageNode]) -> tuple[float, list[int]]:
        """The least bottleneck over the cuts of ``chain`` and cuts that reach
        it, each as early as it can be from the last back (inf and [] when
        none fits)."""
        count = self.model.n_layers
        if len(chain) > count:
            return math.inf, []
        best = np.full(count + 1, np.inf)
        best[0] = 0.0
        choices = []
        for i, node in enumerate(chain):
            last = i == len(chain) - 1
            after = None if last else chain[i + 1]
            target = after.node_id if after is not None else (
                None if node is chain[0] else f"<{chain[0].node_id}")
            matrix = self._matrix(node, i == 0, last, self.transfer(node, after, chain[0]), target)
            through = np.maximum(best[:, None], matrix)
            choice = np.argmin(through, axis=0)     # the earliest start among equals
            best = through[choice, np.arange(count + 1)]
            choices.append(choice)
        value = float(best[count])
        if not math.isfinite(value):
            return math.inf, []
        cuts, end = [count], count
        for choice in reversed(choices):
            end = int(choice[end])
            cuts.append(end)
        return value, cuts[::-1]


def _heuristic_chains(nodes: list[StageNode], costs: _Costs) -> list[tuple[StageNode, ...]]:
    by_speed = sorted(nodes, key=lambda n: (-n.speed, n.node_id))
    greedy, left = [by_speed[0]], by_speed[1:]
    while left:
        here = greedy[-1].node_id
        nxt = min(left, key=lambda n: (costs.link(here, n.node_id).time(
            costs.model.activation_bytes), -n.speed, n.node_id))
        greedy.append(nxt)
        left.remove(nxt)
    by_memory = sorted(nodes, key=lambda n: (-n.memory_free, n.node_id))
    chains: list[tuple[StageNode, ...]] = []
    for order in (greedy, by_memory):
        chains.extend(tuple(order[:k]) for k in range(1, len(order) + 1))
    return sorted(set(chains), key=lambda c: (len(c), [n.node_id for n in c]))


def _check_nodes(nodes: Sequence[StageNode]) -> list[StageNode]:
    nodes = list(nodes)
    if not nodes:
        raise PlacementError("there are no nodes to place the model's stages on")
    ids = [node.node_id for node in nodes]
    if len(set(ids)) != len(ids):
        raise PMetalValueError(f"node ids repeat: {ids}")
    return nodes


def _check_total(model: ModelProfile, nodes: list[StageNode]) -> None:
    free = sum(node.memory_free for node in nodes)
    if model.total_bytes > free:
        raise PlacementError(_shortfall(model, nodes, f"{_size(model.total_bytes - free)} short"))


def _why_no_split(model: ModelProfile, nodes: list[StageNode]) -> str:
    largest, least = max(model.bytes_per_layer), min(model.bytes_per_layer)
    roomiest = max(node.memory_free for node in nodes)
    if largest > roomiest:
        return (f"one layer takes {_size(largest)}, more than the {_size(roomiest)} "
                f"the roomiest node has free")
    for part, fixed in (("embedding", model.embedding_bytes), ("head", model.head_bytes)):
        if fixed + least > roomiest:
            return (f"the stage with the {part} ({_size(fixed)}) and a layer needs "
                    f"{_size(fixed + least)}, more than the {_size(roomiest)} the roomiest "
                    f"node has free")
    return ("enough in total, but split so that no contiguous split of the layers fits "
            "the nodes' free memory, the embedding and head included")


def _shortfall(model: ModelProfile, nodes: list[StageNode], why: str) -> str:
    free = sum(node.memory_free for node in nodes)
    each = ", ".join(f"{node.node_id} {_size(node.memory_free)}" for node in nodes)
    return (f"the model needs {_size(model.total_bytes)}, the cluster has {_size(free)} free "
            f"on {len(nodes)} node{'s' if len(nodes) != 1 else ''} ({each}; {why}): add "
            f"nodes or free memory on them, or use a smaller or more quantized model")


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.3f} ms"
