"""Run one rank's part of a collective :class:`~pmetal.collectives.plan.Plan`.

:func:`execute` is the executor every transport shares: it runs
``plan.steps[rank]`` over an injected :class:`RankLinks` (the messages of
one rank), reduces or copies what arrives, applies ``finish`` and returns
the buffer. It owns the checks a rank makes of what its peers send (the
chunk index the plan expects, the size and dtype) and the operation's
deadline; it moves no bytes itself. The links (:mod:`pmetal.links`: in
memory, TCP, shared memory) move them.

It is synchronous and runs in the caller's thread: a blocking Python TCP
round trip costs 34-39 us on the machines pmetal targets and an asyncio
ZeroMQ one 290-480 us, and a 4 KiB all_reduce is two to four one-way
trips. The asyncio API runs it in a worker thread.

What a caller gets: the buffer, reduced in place, bit-identical on every
rank (the plan fixes the order of every reduction); or a
:class:`~pmetal.errors.CollectiveError` naming the operation, the step and
the peer when a peer is dead, stalls past the deadline or sends a chunk
the plan does not expect. Never a hang: every wait is bounded by the one
deadline of the whole operation.

What links must guarantee is in :mod:`pmetal.links.memory`.
"""

from __future__ import annotations

import time

import numpy as np

from pmetal.collectives.ops import ReduceOp, finish, reduce_into
from pmetal.collectives.plan import Plan, Recv, Send
from pmetal.errors import (
    AuthenticationError,
    CollectiveError,
    PMetalValueError,
    TransportError,
)
from pmetal.links.memory import RankLinks

__all__ = ["execute"]

_REFORM = ("re-form the group over the live members (a new plan with a new op_id) and "
           "run the operation again")


def execute(plan: Plan, rank: int, buffer: np.ndarray, links: RankLinks, *,
            op: ReduceOp, op_id: int, timeout: float) -> np.ndarray:
    """Run ``rank``'s program of ``plan`` on ``buffer`` (flat, or any
    contiguous array of ``plan.n_elements`` elements) and return it, in
    place. ``op`` is the reduction (ignored by broadcast and all_gather),
    ``op_id`` names this operation's messages on ``links``, ``timeout``
    (seconds) bounds the whole operation. Raises
    :class:`~pmetal.errors.CollectiveError` when a peer dies, stalls or
    sends the wrong chunk; :class:`~pmetal.errors.PMetalValueError` for a
    buffer or rank that does not fit the plan."""
    if not 0 <= rank < plan.world:
        raise PMetalValueError(f"rank {rank} is not in the plan's world of {plan.world}")
    if buffer.size != plan.n_elements:
        raise PMetalValueError(f"the buffer has {buffer.size} elements but the plan of "
                               f"{plan.op_name} is for {plan.n_elements}")
    if timeout <= 0:
        raise PMetalValueError(f"timeout must be positive, not {timeout}")
    flat = buffer.reshape(-1)
    if not np.shares_memory(flat, buffer) and buffer.size:
        raise PMetalValueError("the buffer must be contiguous: the operation works in place")
    deadline = time.monotonic() + timeout
    what = f"{plan.op_name} (op_id {op_id}, {plan.strategy}, world {plan.world})"
    try:
        _run(plan, rank, flat, links, op, op_id, deadline, what)
    finally:
        links.release(op_id)
    if plan.reduces:
        for start, end in plan.result_bounds(rank):
            finish(op, flat[start:end], plan.world)
    return buffer


def _run(plan: Plan, rank: int, flat: np.ndarray, links: RankLinks, op: ReduceOp,
         op_id: int, deadline: float, what: str) -> None:
    sent: set[int] = set()  # chunks a send may still reference
    scratch: np.ndarray | None = None
    for index, step in enumerate(plan.steps[rank]):
        # A step's sends go out first (buffered, to different peers they are
        # independent); its receives then run in program order, which keeps
        # the FIFO matching and the order of reductions on every chunk.
        for a in step.actions:
            if isinstance(a, Send):
                try:
                    links.send(a.to_rank, op_id, a.chunk, _view(plan, flat, a.chunk))
                except TransportError as exc:
                    raise _lost(what, rank, index, a.to_rank, exc) from exc
                sent.add(a.chunk)
        for a in step.actions:
            if not isinstance(a, Recv):
                continue
            local = _view(plan, flat, a.chunk)
            if a.chunk in sent:
                links.detach(op_id, a.chunk)
                sent.discard(a.chunk)
            if a.reduce:
                if scratch is None or scratch.size < local.size:
                    scratch = np.empty(plan.max_chunk, dtype=flat.dtype)
                out = scratch[:local.size]
            else:
                out = local
            try:
                chunk, data = links.recv(a.from_rank, op_id, deadline, out)
            except TimeoutError as exc:
                dead = sorted(links.dead())
                known = (f" ({', '.join(f'rank {r}' for r in dead)} known dead)"
                         if dead else "")
                raise CollectiveError(
                    f"{what}: rank {rank} at step {index} waited for rank {a.from_rank} "
                    f"past the deadline{known}; that member stalled or died: "
                    f"{_REFORM}") from exc
            except TransportError as exc:
                raise _lost(what, rank, index, a.from_rank, exc) from exc
            except AuthenticationError as exc:
                raise CollectiveError(
                    f"{what}: rank {rank} at step {index} refused what rank {a.from_rank} "
                    f"sent: {exc}; {_REFORM}") from exc
            if chunk != a.chunk:
                raise CollectiveError(
                    f"{what}: rank {rank} at step {index} expected chunk {a.chunk} from "
                    f"rank {a.from_rank} but was sent chunk {chunk}; the peers disagree "
                    f"on the plan: every rank must pass the same shape and dtype (else a "
                    f"stale or corrupt plan, or a bug): {_REFORM}")
            if data.dtype != local.dtype or data.size != local.size:
                raise CollectiveError(
                    f"{what}: rank {rank} at step {index} received chunk {chunk} from rank "
                    f"{a.from_rank} as {data.size} x {data.dtype}, but holds it as "
                    f"{local.size} x {local.dtype}; every rank must pass the same shape "
                    "and dtype")
            if a.reduce:
                reduce_into(op, local, data.reshape(-1))
            elif data is not local:
                local[...] = data.reshape(-1)


def _lost(what: str, rank: int, step: int, peer: int, exc: Exception) -> CollectiveError:
    return CollectiveError(
        f"{what}: rank {rank} at step {step} lost rank {peer} ({exc}); that member is "
        f"dead or unreachable: {_REFORM}")


def _view(plan: Plan, flat: np.ndarray, chunk: int) -> np.ndarray:
    start, end = plan.chunks[chunk]
    return flat[start:end]
