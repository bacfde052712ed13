"""Collective operations (ring, tree, naive) scheduled by the elected master.

So far the pure half: :func:`make_plan` builds a :class:`Plan` (who sends
which chunk to whom, step by step) for each operation and strategy,
:mod:`pmetal.collectives.ops` holds the reduce operators, and
:mod:`pmetal.collectives.compression` the gradient compressors (with error
feedback, summed only after decompression), and
:mod:`pmetal.collectives.executor` runs one rank's part of a plan over
injected links (:func:`execute`; the links, in memory, TCP and shared
memory, are the package :mod:`pmetal.links`, which the pipeline uses too), the groups
(:mod:`pmetal.collectives.group`) and the SPMD API
(:mod:`pmetal.collectives.spmd`) carry them between processes;
:func:`all_reduce_compressed` reduces compressed gradients over a group."""

from pmetal.collectives.compressed import (
    LinkTraffic,
    all_reduce_compressed,
    all_reduce_compressed_many,
    traffic,
)
from pmetal.collectives.compression import (
    Compressed,
    CompressionConfig,
    CompressionStatistics,
    CompressionStrategy,
    GradientCompressor,
    QuantizationType,
    aggregate,
    decompress,
)
from pmetal.collectives.executor import execute
from pmetal.collectives.ops import ReduceOp, chunk_bounds
from pmetal.collectives.plan import Plan, PlanRequest, Recv, Send, Step, check_plan
from pmetal.collectives.planner import make_plan
from pmetal.errors import CollectiveError
from pmetal.links.memory import MemoryLinks, MemoryNetwork, RankLinks

__all__ = [
    "CollectiveError",
    "Compressed",
    "CompressionConfig",
    "CompressionStatistics",
    "CompressionStrategy",
    "GradientCompressor",
    "LinkTraffic",
    "MemoryLinks",
    "MemoryNetwork",
    "Plan",
    "PlanRequest",
    "QuantizationType",
    "RankLinks",
    "Recv",
    "ReduceOp",
    "Send",
    "Step",
    "aggregate",
    "all_reduce_compressed",
    "all_reduce_compressed_many",
    "check_plan",
    "chunk_bounds",
    "decompress",
    "execute",
    "make_plan",
    "traffic",
]
