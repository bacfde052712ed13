"""Collective operations (ring, tree, naive) scheduled by the elected master.

So far the pure half: :func:`make_plan` builds a :class:`Plan` (who sends
which chunk to whom, step by step) for each operation and strategy, and
:mod:`pmetal.collectives.ops` holds the reduce operators. The executor that
moves bytes, the groups and the SPMD API come with the rest of the issue."""

from pmetal.collectives.ops import ReduceOp, chunk_bounds
from pmetal.collectives.plan import Plan, PlanRequest, Recv, Send, Step, check_plan
from pmetal.collectives.planner import make_plan

__all__ = ["Plan", "PlanRequest", "Recv", "ReduceOp", "Send", "Step", "check_plan",
           "chunk_bounds", "make_plan"]
