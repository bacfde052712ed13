"""Collective operations (ring, tree, naive) scheduled by the elected master.

So far the pure half: :func:`make_plan` builds a :class:`Plan` (who sends
which chunk to whom, step by step) for each operation and strategy,
:mod:`pmetal.collectives.ops` holds the reduce operators, and
:mod:`pmetal.collectives.compression` the gradient compressors (with error
feedback, summed only after decompression), and
:mod:`pmetal.collectives.executor` runs one rank's part of a plan over
injected links (:func:`execute`; in-memory links for tests). The socket
links, the groups and the SPMD API come with the rest of the issue."""

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
from pmetal.collectives.executor import MemoryLinks, MemoryNetwork, RankLinks, execute
from pmetal.collectives.ops import ReduceOp, chunk_bounds
from pmetal.collectives.plan import Plan, PlanRequest, Recv, Send, Step, check_plan
from pmetal.collectives.planner import make_plan
from pmetal.errors import CollectiveError

__all__ = [
    "CollectiveError",
    "Compressed",
    "CompressionConfig",
    "CompressionStatistics",
    "CompressionStrategy",
    "GradientCompressor",
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
    "check_plan",
    "chunk_bounds",
    "decompress",
    "execute",
    "make_plan",
]
