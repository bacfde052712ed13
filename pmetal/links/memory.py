"""What every rank's links promise, and the in-memory links.

:class:`RankLinks` is the protocol the collectives' executor
(:func:`pmetal.collectives.executor.execute`) and the pipeline's hops run
over; :class:`MemoryNetwork` and :class:`MemoryLinks` are the in-memory
links (the test double, and the shape the socket links
:mod:`pmetal.links.tcplinks` and :mod:`pmetal.links.shmlinks` match).

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

from pmetal.errors import PeerError, PMetalValueError

__all__ = ["MemoryLinks", "MemoryNetwork", "RankLinks"]


class RankLinks(Protocol):
    """One rank's messages for collective operations (see the module
    docstring for what an implementation must guarantee)."""

    def send(self, to_rank: int, op_id: int, chunk: int, data: np.ndarray) -> None: ...

    def detach(self, op_id: int, chunk: int) -> None: ...

    def release(self, op_id: int) -> None: ...

    def recv(self, from_rank: int, op_id: int, deadline: float,
             out: np.ndarray | None = None) -> tuple[int, np.ndarray]: ...

    def dead(self) -> set[int]: ...


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
