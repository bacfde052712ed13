"""Continuous batching: requests join and leave one long-running generation.

:meth:`PipelineGenerationLoop.run` generates a fixed list of prompts and
returns; a server gets its prompts one by one, at any time, and wants each
answered as soon as it can be, sharing the stages' batched decode steps with
whatever else is running. :class:`ContinuousBatcher` owns the loop's thread
for as long as it runs (:meth:`PipelineGenerationLoop.run_continuous`):

- :meth:`~ContinuousBatcher.submit` (any thread) puts a sequence in an inbox
  and wakes the loop; between two rounds of the lanes the loop moves the
  inbox into the :class:`~pmetal.pipeline.generation.StreamMultiplexer`,
  whose next hop of an idle lane admits it (its prefill rides with the
  decode steps of the sequences already there). Nothing waits for a batch
  to fill or to drain.
- Each token goes to the sequence's ``on_token(sequence_id, token)`` as it
  comes back from the last stage; the sequence's ``on_done(result)`` runs
  once, when it stopped (a stop token, ``max_tokens``), was cancelled, or
  failed. Both run in the loop's thread: they must be quick (a server hands
  the token to its event loop) and never block. An exception from one fails
  that sequence alone (it is cancelled, the error logged).
- :meth:`~ContinuousBatcher.cancel` (any thread: a client disconnected, a
  stop string matched) ends a sequence: its lane's next hop tells the stages
  to free its KV caches.

Bounds: at most ``max_running`` sequences in the lanes at once (each holds
a KV cache of its ``max_len`` in every stage) and at most ``max_waiting``
more waiting for room; beyond that :meth:`~ContinuousBatcher.submit` raises
:class:`QueueFullError` at once (a server answers 503) rather than queue
without end. A stage that stalls or dies breaks the ring: every sequence
fails with the ring's :class:`~pmetal.errors.PipelineError` (after the
loop's ``step_timeout`` at most), later submits raise it, and the batcher
stops.

:meth:`~ContinuousBatcher.statistics` says how many sequences are live and
how much the decode steps were shared (``widest_hop``: the most sequences
one hop carried).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

from pmetal.errors import PipelineError, PMetalValueError
from pmetal.pipeline.generation import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    GenerationResult,
    PipelineGenerationLoop,
    StreamMultiplexer,
)
from pmetal.pipeline.sampling import SamplingConfig

__all__ = ["BatcherStatistics", "ContinuousBatcher", "QueueFullError"]

log = logging.getLogger(__name__)

TokenCallback = Callable[[int, int], None]          # (sequence id, token)
DoneCallback = Callable[[GenerationResult], None]


class QueueFullError(PipelineError):
    """The batcher holds as many waiting sequences as it may: try again later."""


@dataclass(frozen=True, slots=True)
class BatcherStatistics:
    """A snapshot of a :class:`ContinuousBatcher`."""

    live: int           # submitted and not finished: waiting or running
    waiting: int        # not in a lane yet
    running: int        # in a lane (their KV caches held by the stages)
    submitted: int
    finished: int       # stopped (a stop token, max_tokens)
    cancelled: int
    failed: int
    tokens: int         # tokens delivered, all sequences
    max_running: int    # most sequences in the lanes at once, so far
    widest_hop: int     # most sequences one hop (a decode step of a lane) carried, since start
    broken: str | None  # why the ring broke; None while it works


class ContinuousBatcher:
    """Sequences joining and leaving one running generation loop (see the
    module docstring). ``loop``: a pipeline's generation loop, which this
    batcher holds while it runs (a :meth:`Pipeline.generate` meanwhile
    waits for :meth:`close`). Use as a context manager, or :meth:`start`
    and :meth:`close`."""

    def __init__(self, loop: PipelineGenerationLoop, *, max_running: int = 64,
                 max_waiting: int = 64) -> None:
        for name, value in (("max_running", max_running), ("max_waiting", max_waiting)):
            if type(value) is not int or value < 1:
                raise PMetalValueError(f"{name} {value!r} must be an int >= 1")
        self.loop = loop
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._inbox: collections.deque[Any] = collections.deque()
        self._live: dict[int, Any] = {}          # id -> the loop's sequence
        self._done: dict[int, DoneCallback] = {}
        self._mux: StreamMultiplexer | None = None
        self._stopping = False
        self._broken: str | None = None
        self._thread: threading.Thread | None = None
        self._counts = collections.Counter[str]()
        self._tokens = 0
        self._max_running = 0

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the loop's thread (once)."""
        with self._cond:
            if self._thread is not None:
                raise PipelineError("this batcher was already started")
            self.loop.widest = 0        # widest_hop counts from here
            self._thread = threading.Thread(target=self._run, name="pmetal-batcher",
                                            daemon=True)
            self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every sequence (their ``on_done`` sees ``cancelled``), let
        the hops in flight come back so the stages free their caches, and
        stop the thread. A ring that does not come back within ``timeout``
        is closed (the pipeline is then broken)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        if thread.is_alive():
            log.warning("the batcher's ring did not stop within %.1f s: closing it", timeout)
            self.loop.links.close(timeout=1.0)
            thread.join(timeout)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- requests

    def submit(self, prompt: Sequence[int], sampling: SamplingConfig, *, max_len: int,
               on_token: TokenCallback | None = None, on_done: DoneCallback | None = None,
               stream: int | None = None) -> int:
        """Queue one sequence; returns its id (for :meth:`cancel`).
        ``max_len``: its context, prompt included (its KV cache's size in
        every stage). ``stream``: the sampler's stream (see
        :meth:`PipelineGenerationLoop.new_sequence`). Raises
        :class:`QueueFullError` when ``max_waiting`` sequences wait already,
        :class:`PipelineError` when the batcher is stopped or its ring broke,
        :class:`PMetalValueError` for a prompt that does not fit."""
        seq = self.loop.new_sequence(prompt, sampling, max_len=max_len,
                                     on_token=self._token_callback(on_token), stream=stream)
        with self._cond:
            if self._broken is not None:
                raise PipelineError(f"the pipeline is broken ({self._broken}); it cannot "
                                    "take new requests")
            if self._stopping or self._thread is None:
                raise PipelineError("the batcher is not running (not started, or closing)")
            waiting = len(self._inbox) + self._mux_waiting()
            if waiting >= self.max_waiting:
                raise QueueFullError(f"{waiting} requests are waiting already (the most this "
                                     f"server queues, beside {self.max_running} running): "
                                     "try again later")
            self._live[seq.id] = seq
            if on_done is not None:
                self._done[seq.id] = on_done
            self._inbox.append(seq)
            self._counts["submitted"] += 1
            self._cond.notify_all()
        return seq.id

    def cancel(self, sequence_id: int) -> bool:
        """End one sequence (any thread); False when it is unknown or over.
        Its ``on_done`` runs with ``cancelled`` (in the loop's thread, or
        here when it was not admitted yet)."""
        with self._cond:
            seq = self._live.get(sequence_id)
            if seq is None or seq.done:
                return False
            if seq in self._inbox:
                self._inbox.remove(seq)
                StreamMultiplexer._finish(seq, FINISH_CANCELLED, None, time.perf_counter())
                done = [self._retire(seq)]
            else:
                mux = self._mux
                return mux.cancel(sequence_id) if mux is not None else False
        self._deliver(done)
        return True

    def statistics(self) -> BatcherStatistics:
        with self._cond:
            mux = self._mux
            running = mux.in_flight if mux is not None else 0
            return BatcherStatistics(
                live=len(self._live), waiting=len(self._inbox) + self._mux_waiting(),
                running=running, submitted=self._counts["submitted"],
                finished=self._counts["finished"], cancelled=self._counts["cancelled"],
                failed=self._counts["failed"], tokens=self._tokens,
                max_running=self._max_running, widest_hop=self.loop.widest,
                broken=self._broken)

    # ---------------------------------------------------------- loop thread

    def _mux_waiting(self) -> int:
        mux = self._mux
        return len(mux.waiting) if mux is not None else 0

    def _token_callback(self, on_token: TokenCallback | None) -> TokenCallback:
        def arrived(sequence_id: int, token: int) -> None:
            self._tokens += 1           # the loop's thread only
            if on_token is None:
                return
            try:
                on_token(sequence_id, token)
            except Exception:
                log.exception("the token callback of sequence %d raised: it is cancelled",
                              sequence_id)
                mux = self._mux
                if mux is not None:
                    mux.cancel(sequence_id)
        return arrived

    def _run(self) -> None:
        why = "the batcher stopped"
        try:
            self.loop.run_continuous(self._admit)
        except PipelineError as exc:
            why = str(exc)
            log.error("the batcher's pipeline broke: %s", why)
        except BaseException as exc:
            why = f"the batcher failed: {type(exc).__name__}: {exc}"
            log.exception("the batcher failed")
        finally:
            now = time.perf_counter()
            with self._cond:
                if not self._stopping:
                    self._broken = why
                self._stopping = True
                self._mux = None
                left = list(self._live.values())
                for seq in left:
                    if not seq.done:
                        StreamMultiplexer._finish(seq, FINISH_ERROR, why, now)
                done = [self._retire(seq) for seq in left]
                self._inbox.clear()
            self._deliver(done)

    def _admit(self, mux: StreamMultiplexer, wait: bool) -> bool:
        """The loop's hook between two rounds (see
        :meth:`PipelineGenerationLoop.run_continuous`)."""
        mux.max_in_flight = self.max_running
        with self._cond:
            self._mux = mux
            if wait:
                while not self._inbox and not self._stopping:
                    self._cond.wait()
            if self._stopping:
                now = time.perf_counter()
                for seq in self._inbox:
                    StreamMultiplexer._finish(seq, FINISH_CANCELLED, None, now)
                self._inbox.clear()
                for seq in self._live.values():
                    if not seq.done:
                        mux.cancel(seq.id)
            while self._inbox:
                mux.submit(self._inbox.popleft())
            self._max_running = max(self._max_running, mux.in_flight)
            done = [self._retire(s) for s in list(self._live.values()) if s.done]
        self._deliver(done)
        return not (wait and self._stopping)

    def _retire(self, seq: Any) -> tuple[DoneCallback | None, GenerationResult]:
        """Forget a finished sequence (under the lock); its callback and result."""
        del self._live[seq.id]
        if self._mux is not None:
            self._mux.sequences.pop(seq.id, None)
        kind = {FINISH_CANCELLED: "cancelled", FINISH_ERROR: "failed"}.get(seq.finish or "",
                                                                           "finished")
        self._counts[kind] += 1
        return self._done.pop(seq.id, None), seq.result()

    @staticmethod
    def _deliver(done: list[tuple[DoneCallback | None, GenerationResult]]) -> None:
        for callback, result in done:
            if callback is None:
                continue
            try:
                callback(result)
            except Exception:
                log.exception("the done callback of sequence %d raised", result.sequence_id)
