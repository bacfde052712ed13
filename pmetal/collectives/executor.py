"""Run one rank's part of a collective :class:`~pmetal.collectives.plan.Plan`.

:func:`execute` is the executor every transport shares: it runs
``plan.steps[rank]`` over an injected :class:`RankLinks` (the messages of
one rank), reduces or copies what arrives, applies ``finish`` and returns
the buffer. It owns the checks a rank makes of what its peers send (the
chunk index the plan expects, the size and dtype) and the operation's
deadline; it moves no bytes itself. :class:`MemoryNetwork` and
:class:`MemoryLinks` are the in-memory links: the test double, and the
shape the socket links (:mod:`pmetal.collectives.tcplinks`) match.

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

What a :class:`RankLinks` must guarantee (the socket links included):

- ``send`` is buffered: it never waits for the receiver's program (plans
  rely on it to be deadlock-free). It may keep a reference to ``data`` (a
  view of the caller's buffer) until ``detach`` names that chunk or
  ``release`` ends the operation; then it copies what it has not sent
  yet. The executor calls ``detach`` before it overwrites a chunk it sent
  earlier in the operation, and ``release`` before it returns or raises.
- ``recv(from_rank, op_id, deadline, out)`` returns the next message
  ``from_rank`` sent this rank for ``op_id``, first in first out, as
  ``(chunk, data)``; messages of other operations never mix in (``op_id``
  is fresh per operation, so a late message of a failed operation is never
  taken for the next one's). When ``out`` matches the message's dtype and
  length the payload lands in ``out`` and ``out`` is returned (no copy:
  the executor passes the destination chunk of a copy and a scratch buffer
  for a reduction). Past ``deadline`` (``time.monotonic()``) it raises
  :class:`TimeoutError`.
- Once ``from_rank`` is known dead and every message it sent before dying
  has been returned, ``recv`` raises :class:`~pmetal.errors.PeerError`
  instead of waiting; ``dead()`` lists the ranks known dead (may be empty
  when the links cannot tell: the deadline still ends the operation).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Protocol

import numpy as np

from pmetal.collectives.ops import ReduceOp, finish, reduce_into
from pmetal.collectives.plan import Plan, Recv, Send
from pmetal.errors import CollectiveError, PeerError, PMetalValueError, TransportError

__all__ = ["MemoryLinks", "MemoryNetwork", "RankLinks", "execute"]

_REFORM = ("re-form the group over the live members (a new plan with a new op_id) and "
           "run the operation again")


class RankLinks(Protocol):
    """One rank's messages for collective operations (see the module
    docstring for what an implementation must guarantee)."""

    def send(self, to_rank: int, op_id: int, chunk: int, data: np.ndarray) -> None: ...

    def detach(self, op_id: int, chunk: int) -> None: ...

    def release(self, op_id: int) -> None: ...

    def recv(self, from_rank: int, op_id: int, deadline: float,
             out: np.ndarray | None = None) -> tuple[int, np.ndarray]: ...

    def dead(self) -> set[int]: ...


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


class MemoryNetwork:
    """The in-memory links of one world of ``world`` ranks: a FIFO queue per
    (source, destination, op_id), shared by every rank's
    :class:`MemoryLinks` (``network.links(rank)``); each rank runs in its
    own thread.

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
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, int, int], queue.SimpleQueue[tuple[int, np.ndarray] | None]] = {}
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
        with self._lock:
            self._killed.add(rank)
            self._silence(rank, after_sends)

    def stall(self, rank: int, *, after_sends: int = 0) -> None:
        """``rank`` goes silent after ``after_sends`` more sends and is never
        reported dead."""
        with self._lock:
            self._silence(rank, after_sends)

    def dead(self) -> set[int]:
        with self._lock:
            return set(self._dead)

    def _silence(self, rank: int, after_sends: int) -> None:
        self._budget[rank] = after_sends
        if after_sends == 0:
            self._went_silent(rank)

    def _went_silent(self, rank: int) -> None:
        if rank in self._killed:
            timer = threading.Timer(self.detection_delay, self._declare_dead, (rank,))
            timer.daemon = True  # a health monitor's verdict; nothing to join
            timer.start()

    def _declare_dead(self, rank: int) -> None:
        with self._lock:
            self._dead.add(rank)
            # Wake every receive waiting on the dead rank; None sorts after
            # the messages it sent before dying, which are still delivered.
            for (src, _dst, _op), q in self._queues.items():
                if src == rank:
                    q.put(None)

    def _queue(self, src: int, dst: int, op_id: int
               ) -> queue.SimpleQueue[tuple[int, np.ndarray] | None]:
        key = (src, dst, op_id)
        with self._lock:
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = queue.SimpleQueue()
                if src in self._dead:
                    q.put(None)
            return q

    def _send(self, src: int, dst: int, op_id: int, chunk: int, data: np.ndarray) -> None:
        if not 0 <= dst < self.world or dst == src:
            raise PMetalValueError(f"rank {src} cannot send to rank {dst} in a world of "
                                   f"{self.world}")
        with self._lock:
            budget = self._budget.get(src)
            if budget is not None:
                if budget == 0:
                    return  # silent: the message vanishes, as on a dead or stuck host
                self._budget[src] = budget - 1
                if budget == 1:
                    self._went_silent(src)
            self.sent += 1
        self._queue(src, dst, op_id).put((chunk, data.copy()))

    def _recv(self, src: int, dst: int, op_id: int, deadline: float) -> tuple[int, np.ndarray]:
        q = self._queue(src, dst, op_id)
        try:
            item = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"no message from rank {src} before the deadline") from None
        if item is None:
            q.put(None)  # later receives from the dead rank fail too
            raise PeerError(f"rank {src} is dead")
        return item


class MemoryLinks:
    """One rank's :class:`RankLinks` on a :class:`MemoryNetwork`. ``send``
    copies the data into the queue at once (buffered, never waits, keeps
    no reference), so ``detach`` and ``release`` have nothing to do."""

    def __init__(self, network: MemoryNetwork, rank: int) -> None:
        self.network = network
        self.rank = rank
        self.world = network.world

    def send(self, to_rank: int, op_id: int, chunk: int, data: np.ndarray) -> None:
        self.network._send(self.rank, to_rank, op_id, chunk, data)

    def detach(self, op_id: int, chunk: int) -> None:
        pass

    def release(self, op_id: int) -> None:
        pass

    def recv(self, from_rank: int, op_id: int, deadline: float,
             out: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        return self.network._recv(from_rank, self.rank, op_id, deadline)

    def dead(self) -> set[int]:
        return self.network.dead()
