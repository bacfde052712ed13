"""Run one rank's part of a collective :class:`~pmetal.collectives.plan.Plan`.

:func:`execute` is the executor every transport shares: it runs
``plan.steps[rank]`` over an injected :class:`RankLinks` (the messages of
one rank), reduces or copies what arrives, applies ``finish`` and returns
the buffer. It owns the checks a rank makes of what its peers send (the
chunk index the plan expects, the size and dtype) and the operation's
deadline; it moves no bytes itself. :class:`MemoryNetwork` and
:class:`MemoryLinks` are the in-memory links: the test double, and the
shape the socket-backed links match.

What a caller gets: the buffer, reduced in place, bit-identical on every
rank (the plan fixes the order of every reduction); or a
:class:`~pmetal.errors.CollectiveError` naming the operation, the step and
the peer when a peer is dead, stalls past the deadline or sends a chunk
the plan does not expect. Never a hang: every wait is bounded by the one
deadline of the whole operation.

What a :class:`RankLinks` must guarantee (the socket links included):

- ``send`` is buffered: it returns once the data is queued or written,
  never waiting for the receiver's program (plans rely on it to be
  deadlock-free), and it keeps no reference to ``data`` after it returns
  (the executor passes a view of the buffer, which the next receive may
  overwrite).
- ``recv(from_rank, op_id)`` returns the messages ``from_rank`` sent this
  rank for ``op_id``, first in first out, as ``(chunk, data)``; messages of
  other operations never mix in (``op_id`` is fresh per operation, so a
  late message of a failed operation is never taken for the next one's).
- Once ``from_rank`` is known dead and every message it sent before dying
  has been returned, ``recv`` raises :class:`~pmetal.errors.PeerError`
  instead of waiting; ``dead()`` lists the ranks known dead (may be empty
  when the links cannot tell: the deadline still ends the operation).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol, TypeVar

import numpy as np

from pmetal.collectives.ops import ReduceOp, finish, reduce_into
from pmetal.collectives.plan import Plan, Recv, Send
from pmetal.errors import CollectiveError, PeerError, PMetalValueError, TransportError

__all__ = ["MemoryLinks", "MemoryNetwork", "RankLinks", "execute"]

_T = TypeVar("_T")

_REFORM = ("re-form the group over the live members (a new plan with a new op_id) and "
           "run the operation again")


class RankLinks(Protocol):
    """One rank's messages for collective operations (see the module
    docstring for what an implementation must guarantee)."""

    async def send(self, to_rank: int, op_id: int, chunk: int, data: np.ndarray) -> None: ...

    async def recv(self, from_rank: int, op_id: int) -> tuple[int, np.ndarray]: ...

    def dead(self) -> set[int]: ...


async def execute(plan: Plan, rank: int, buffer: np.ndarray, links: RankLinks, *,
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
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    what = f"{plan.op_name} (op_id {op_id}, {plan.strategy}, world {plan.world})"
    for index, step in enumerate(plan.steps[rank]):
        sends = [a for a in step.actions if isinstance(a, Send)]
        recvs = [a for a in step.actions if isinstance(a, Recv)]
        # A step's sends go out together (to different peers, they are
        # independent); its receives then run in program order, which keeps
        # the FIFO matching and the order of reductions on every chunk.
        if sends:
            await _bounded(_post(plan, flat, sends, links, op_id), loop, deadline, links,
                           what, rank, index, peer=None)
        for a in recvs:
            chunk, data = await _bounded(links.recv(a.from_rank, op_id), loop, deadline,
                                         links, what, rank, index, peer=a.from_rank)
            local = _view(plan, flat, a.chunk)
            if chunk != a.chunk:
                raise CollectiveError(
                    f"{what}: rank {rank} at step {index} expected chunk {a.chunk} from "
                    f"rank {a.from_rank} but was sent chunk {chunk}; the peers disagree "
                    f"on the plan (a stale or corrupt plan, or a bug): {_REFORM}")
            if data.dtype != local.dtype or data.size != local.size:
                raise CollectiveError(
                    f"{what}: rank {rank} at step {index} received chunk {chunk} from rank "
                    f"{a.from_rank} as {data.size} x {data.dtype}, but holds it as "
                    f"{local.size} x {local.dtype}; every rank must pass the same shape "
                    "and dtype")
            if a.reduce:
                reduce_into(op, local, data.reshape(-1))
            else:
                local[...] = data.reshape(-1)
    if plan.reduces:
        for start, end in plan.result_bounds(rank):
            finish(op, flat[start:end], plan.world)
    return buffer


async def _post(plan: Plan, flat: np.ndarray, sends: list[Send], links: RankLinks,
                op_id: int) -> None:
    """Post a step's sends together; the task group owns them, so a failed
    or timed-out step leaves no send running behind it."""
    if len(sends) == 1:
        a = sends[0]
        await links.send(a.to_rank, op_id, a.chunk, _view(plan, flat, a.chunk))
        return
    try:
        async with asyncio.TaskGroup() as group:
            for a in sends:
                group.create_task(
                    links.send(a.to_rank, op_id, a.chunk, _view(plan, flat, a.chunk)))
    except ExceptionGroup as failed:
        # One cause is enough for the CollectiveError the caller raises.
        raise failed.exceptions[0] from failed


def _view(plan: Plan, flat: np.ndarray, chunk: int) -> np.ndarray:
    start, end = plan.chunks[chunk]
    return flat[start:end]


async def _bounded(awaitable: Awaitable[_T], loop: asyncio.AbstractEventLoop,
                   deadline: float, links: RankLinks, what: str, rank: int, step: int, *,
                   peer: int | None) -> _T:
    """``awaitable`` within the operation's deadline; a timeout or a broken
    link becomes a :class:`CollectiveError` naming the step and the peer."""
    waiting_for = f"rank {peer}" if peer is not None else "its sends to be queued"
    try:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - loop.time()))
    except TimeoutError as exc:
        dead = sorted(links.dead())
        known = (f" ({', '.join(f'rank {r}' for r in dead)} known dead)" if dead else "")
        raise CollectiveError(
            f"{what}: rank {rank} at step {step} waited for {waiting_for} past the "
            f"deadline{known}; that member stalled or died: {_REFORM}") from exc
    except TransportError as exc:
        raise CollectiveError(
            f"{what}: rank {rank} at step {step} lost {waiting_for} ({exc}); that member "
            f"is dead or unreachable: {_REFORM}") from exc


class MemoryNetwork:
    """The in-memory links of one world of ``world`` ranks: a FIFO queue per
    (source, destination, op_id), shared by every rank's
    :class:`MemoryLinks` (``network.links(rank)``), all on one event loop.

    Failure injection for tests: :meth:`kill` makes a rank's later sends
    vanish and reports it dead ``detection_delay`` seconds later (as a
    health monitor would); :meth:`stall` makes its later sends vanish
    without it ever being reported dead, so only the deadline ends the
    operations waiting for it. ``after_sends`` lets a rank post that many
    more messages first, to fail it in the middle of an operation."""

    def __init__(self, world: int, *, detection_delay: float = 0.0) -> None:
        if world < 1:
            raise PMetalValueError(f"world must be at least 1, not {world}")
        self.world = world
        self.detection_delay = detection_delay
        self._queues: dict[tuple[int, int, int], asyncio.Queue[tuple[int, np.ndarray] | None]] = {}
        self._dead: set[int] = set()
        # rank -> sends it may still post before it goes silent (None: no limit)
        self._budget: dict[int, int] = {}
        self._killed: set[int] = set()
        self.sent = 0  # messages delivered, for tests that check traffic

    def links(self, rank: int) -> MemoryLinks:
        if not 0 <= rank < self.world:
            raise PMetalValueError(f"rank {rank} is not in a world of {self.world}")
        return MemoryLinks(self, rank)

    def kill(self, rank: int, *, after_sends: int = 0) -> None:
        """``rank`` goes silent after ``after_sends`` more sends and is
        reported dead ``detection_delay`` seconds after it goes silent."""
        self._killed.add(rank)
        self._silence(rank, after_sends)

    def stall(self, rank: int, *, after_sends: int = 0) -> None:
        """``rank`` goes silent after ``after_sends`` more sends and is never
        reported dead."""
        self._silence(rank, after_sends)

    def dead(self) -> set[int]:
        return set(self._dead)

    def _silence(self, rank: int, after_sends: int) -> None:
        self._budget[rank] = after_sends
        if after_sends == 0:
            self._went_silent(rank)

    def _went_silent(self, rank: int) -> None:
        if rank in self._killed:
            # A timer callback, not a task: nothing to own or cancel.
            asyncio.get_running_loop().call_later(self.detection_delay, self._declare_dead,
                                                  rank)

    def _declare_dead(self, rank: int) -> None:
        self._dead.add(rank)
        # Wake every receive waiting on the dead rank; None sorts after the
        # messages it sent before dying, which are still delivered.
        for (src, _dst, _op), queue in self._queues.items():
            if src == rank:
                queue.put_nowait(None)

    def _queue(self, src: int, dst: int, op_id: int
               ) -> asyncio.Queue[tuple[int, np.ndarray] | None]:
        key = (src, dst, op_id)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = asyncio.Queue()
            if src in self._dead:
                queue.put_nowait(None)
        return queue

    def _send(self, src: int, dst: int, op_id: int, chunk: int, data: np.ndarray) -> None:
        if not 0 <= dst < self.world or dst == src:
            raise PMetalValueError(f"rank {src} cannot send to rank {dst} in a world of "
                                   f"{self.world}")
        budget = self._budget.get(src)
        if budget is not None:
            if budget == 0:
                return  # silent: the message vanishes, as on a dead or stuck host
            self._budget[src] = budget - 1
            if budget == 1:
                self._went_silent(src)
        self._queue(src, dst, op_id).put_nowait((chunk, data.copy()))
        self.sent += 1

    async def _recv(self, src: int, dst: int, op_id: int) -> tuple[int, np.ndarray]:
        queue = self._queue(src, dst, op_id)
        item = await queue.get()
        if item is None:
            queue.put_nowait(None)  # later receives from the dead rank fail too
            raise PeerError(f"rank {src} is dead")
        return item


class MemoryLinks:
    """One rank's :class:`RankLinks` on a :class:`MemoryNetwork`. ``send``
    copies the data into the queue at once (buffered, never waits)."""

    def __init__(self, network: MemoryNetwork, rank: int) -> None:
        self.network = network
        self.rank = rank

    async def send(self, to_rank: int, op_id: int, chunk: int, data: np.ndarray) -> None:
        self.network._send(self.rank, to_rank, op_id, chunk, data)

    async def recv(self, from_rank: int, op_id: int) -> tuple[int, np.ndarray]:
        return await self.network._recv(from_rank, self.rank, op_id)

    def dead(self) -> set[int]:
        return self.network.dead()
