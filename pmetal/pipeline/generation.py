"""The driver's side of pipeline generation: the multiplexer and the loop.

:class:`StreamMultiplexer` decides what the next hop into stage 0 carries.
Sequences are spread over ``lanes`` micro-batches (one per stage by
default): while stage 1 works on lane A, stage 0 works on lane B, so with
as many lanes as stages every stage stays busy. A lane's hop carries one
decode step of each of its sequences (run by every stage as one batch),
the prompts of sequences admitted into it (prefill) and end-only entries
that free the stages' state of sequences that finished or were cancelled.

:class:`PipelineGenerationLoop` runs the lanes round the ring in the
caller's thread: it sends every lane that has work, then receives the
lanes back in the order they went (each stage is first in, first out),
hands each sampled token to the sequence's callback, stops a sequence at a
stop token or ``max_tokens`` and sends the lane straight back out. A
sequence's prefill is its first step (its first token comes back from
it), so time to first token is one trip round the ring.

Failures: a hop that does not come back within ``step_timeout`` (a stage
stalled), a broken link (a stage died: its neighbours close their links,
so the break reaches the driver in milliseconds), or a stage that the
cluster holds dead (its host was lost silently: no link breaks, but the
loop's ``health`` check, asked every ``HEALTH_SLICE`` while it waits, says
so within a slice of the cluster's verdict) fails every sequence in flight
and not yet started with :class:`~pmetal.errors.PipelineError`; the loop's
links are then unusable.
A sequence that failed at a stage fails alone, the others go on.

One run at a time: runs called from several threads take turns (a ring
carries one run's hops, numbered in order). :meth:`PipelineGenerationLoop.run`
takes a fixed list of prompts; :meth:`PipelineGenerationLoop.run_continuous`
runs until told to stop, its caller admitting sequences between rounds
(continuous batching, :mod:`pmetal.pipeline.batching`). A run interrupted by an
exception from its caller's callback (or Ctrl-C) first collects the hops
still in flight and has the stages drop its sequences, so the next run
starts on a clean ring.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pmetal.errors import (
    CollectiveError,
    PeerError,
    PipelineError,
    PMetalValueError,
    ProtocolError,
    SecurityError,
)
from pmetal.pipeline.sampling import Sampler, SamplingConfig
from pmetal.pipeline.transport import Entry, Hop, HopReceiver, HopSender
from pmetal.tally import TALLY

__all__ = ["GenerationResult", "PipelineGenerationLoop", "StreamMultiplexer",
           "generate_single_process"]

FINISH_STOP = "stop"            # a stop token (it is the last token of the output)
FINISH_LENGTH = "length"        # max_tokens, or the model's context
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"

TokenCallback = Callable[[int, int], None]   # (sequence id, token)


@dataclass
class GenerationResult:
    """One sequence's outcome. ``tokens`` are the new tokens (a stop token
    included); ``logits`` (when asked for) the float32 logits each token was
    sampled from."""

    sequence_id: int
    prompt: list[int]
    tokens: list[int]
    finish_reason: str
    error: str | None = None
    time_to_first_token: float | None = None
    seconds: float = 0.0
    logits: list[np.ndarray] | None = None
    text: str | None = None

    @property
    def ok(self) -> bool:
        return self.finish_reason != FINISH_ERROR


@dataclass
class _Sequence:
    id: int
    prompt: list[int]
    sampling: SamplingConfig
    max_len: int
    want_logits: bool
    on_token: TokenCallback | None
    stream: int | None = None      # the sampler's stream (None: the sequence id)
    lane: int = -1
    position: int = 0
    started: float = 0.0
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    first_token: float | None = None
    finished: float | None = None
    finish: str | None = None
    error: str | None = None
    cancel: bool = False

    @property
    def done(self) -> bool:
        return self.finish is not None

    def result(self) -> GenerationResult:
        ttft = None if self.first_token is None else self.first_token - self.started
        end = self.finished if self.finished is not None else time.perf_counter()
        return GenerationResult(self.id, self.prompt, list(self.tokens), self.finish or "",
                                self.error, ttft, end - self.started,
                                self.logits if self.want_logits else None)


class StreamMultiplexer:
    """Which sequences ride in which lane (see the module docstring).
    Thread-safe for :meth:`cancel`; everything else runs in the loop's thread."""

    def __init__(self, lanes: int, max_in_flight: int) -> None:
        if lanes < 1 or max_in_flight < 1:
            raise PMetalValueError(f"lanes {lanes} and max_in_flight {max_in_flight} must "
                                   "be >= 1")
        self.lanes = lanes
        self.max_in_flight = max_in_flight
        self.waiting: collections.deque[_Sequence] = collections.deque()
        self.members: list[list[_Sequence]] = [[] for _ in range(lanes)]
        self.drops: list[list[int]] = [[] for _ in range(lanes)]  # ids the stages still hold
        self.sequences: dict[int, _Sequence] = {}
        self._lock = threading.Lock()

    def submit(self, seq: _Sequence) -> None:
        if seq.id in self.sequences:
            raise PMetalValueError(f"sequence {seq.id} is already in this pipeline")
        self.sequences[seq.id] = seq
        self.waiting.append(seq)

    def cancel(self, sequence_id: int) -> bool:
        """Stop one sequence; the others go on undisturbed. False when it is
        unknown or already finished."""
        with self._lock:
            seq = self.sequences.get(sequence_id)
            if seq is None or seq.done:
                return False
            seq.cancel = True
            return True

    @property
    def in_flight(self) -> int:
        return sum(len(m) for m in self.members)

    def pending(self) -> bool:
        """Whether any sequence is still waiting or running."""
        return bool(self.waiting) or self.in_flight > 0

    def next_hop(self, lane: int, now: float) -> Hop | None:
        """The hop lane ``lane`` sends next, or None when it has nothing to do."""
        entries = [Entry(sid, end=True) for sid in self.drops[lane]]
        self.drops[lane].clear()
        members = self.members[lane]
        with self._lock:
            for seq in [s for s in members if s.cancel]:
                members.remove(seq)
                self._finish(seq, FINISH_CANCELLED, None, now)
                entries.append(Entry(seq.id, end=True))
            for seq in [s for s in self.waiting if s.cancel]:
                self.waiting.remove(seq)
                self._finish(seq, FINISH_CANCELLED, None, now)
        for seq in members:
            last = len(seq.tokens) + 1 >= seq.sampling.max_tokens \
                or seq.position + 1 >= seq.max_len
            entries.append(Entry(seq.id, seq.position, tokens=(seq.tokens[-1],), end=last))
        # Admit waiting sequences while there is room, up to this lane's
        # share of everything there is to run, so the lanes stay even.
        share = -(-min(self.in_flight + len(self.waiting), self.max_in_flight) // self.lanes)
        while self.waiting and self.in_flight < self.max_in_flight and len(members) < share:
            seq = self.waiting.popleft()
            seq.lane, seq.started = lane, now
            members.append(seq)
            setup = {"max_len": seq.max_len, "sampling": dataclasses.asdict(seq.sampling),
                     "stream": seq.id if seq.stream is None else seq.stream,
                     "logits": seq.want_logits}
            last = seq.sampling.max_tokens == 1 or len(seq.prompt) + 1 >= seq.max_len
            entries.append(Entry(seq.id, 0, tokens=tuple(seq.prompt), prefill=True,
                                 end=last, setup=setup))
        return Hop(entries) if entries else None

    def on_hop(self, lane: int, hop: Hop, now: float) -> None:
        """Take the tokens of a lane that came back round the ring."""
        members = {s.id: s for s in self.members[lane]}
        for entry in hop.entries:
            seq = members.get(entry.sequence_id)
            if seq is None or seq.cancel:
                continue            # an end-only entry, or cancelled: no more tokens
            if entry.error is not None:
                self._leave(seq, FINISH_ERROR, entry.error, now, held=False)
                continue
            if len(entry.tokens) != 1:
                self._leave(seq, FINISH_ERROR, f"the last stage sent {len(entry.tokens)} "
                            "tokens for one step", now, held=True)
                continue
            token = entry.tokens[0]
            seq.position = entry.position
            seq.tokens.append(token)
            if entry.logits is not None and seq.want_logits:
                seq.logits.append(entry.logits)
            if seq.first_token is None:
                seq.first_token = now
            if seq.on_token is not None:
                seq.on_token(seq.id, token)
            if token in seq.sampling.stop_token_ids:
                self._leave(seq, FINISH_STOP, None, now, held=not entry.end)
            elif len(seq.tokens) >= seq.sampling.max_tokens or seq.position >= seq.max_len:
                self._leave(seq, FINISH_LENGTH, None, now, held=not entry.end)

    def _leave(self, seq: _Sequence, reason: str, error: str | None, now: float, *,
               held: bool) -> None:
        self.members[seq.lane].remove(seq)
        if held:
            self.drops[seq.lane].append(seq.id)   # free its caches with the next hop
        self._finish(seq, reason, error, now)

    def fail_all(self, error: str, now: float) -> None:
        for lane in self.members:
            for seq in lane:
                self._finish(seq, FINISH_ERROR, error, now)
            lane.clear()
        while self.waiting:
            self._finish(self.waiting.popleft(), FINISH_ERROR, error, now)

    @staticmethod
    def _finish(seq: _Sequence, reason: str, error: str | None, now: float) -> None:
        if seq.started == 0.0:
            seq.started = now
        seq.finish, seq.error, seq.finished = reason, error, now


HEALTH_SLICE = 0.1   # s between two health checks while a hop is awaited


class PipelineGenerationLoop:
    """Generation round a connected ring (rank 0: this driver; ranks
    ``1..stages``: the stages, see :mod:`pmetal.pipeline.transport`).
    ``health()``, when given, says why the ring cannot go on (a stage's
    host is dead) or returns None; it is asked while a hop is awaited."""

    def __init__(self, links: Any, stages: int, *, lanes: int | None = None,
                 max_in_flight: int = 64, step_timeout: float = 60.0,
                 describe_failure: Callable[[str], str] | None = None,
                 health: Callable[[], str | None] | None = None) -> None:
        self.links = links
        self.stages = stages
        self.lanes = lanes or stages
        self.max_in_flight = max_in_flight
        self.step_timeout = step_timeout
        self.sender = HopSender(links, 1)
        self.receiver = HopReceiver(links, stages)
        self.broken: str | None = None
        self.describe_failure = describe_failure or (lambda why: why)
        self.health = health
        self._mux: StreamMultiplexer | None = None
        self._ids = 0
        self.hops = 0
        self.widest = 0         # most sequences one hop carried (decode and prefill)
        self.name = "pipeline"  # in the node's metrics (pmetal.tally)
        # One run() at a time: two interleaved would number their hops from
        # the same counters and read each other's tokens.
        self._lock = threading.Lock()
        self._id_lock = threading.Lock()
        self._owner: int | None = None      # the thread in run()
        self._io = False                    # a send or receive is under way

    def cancel(self, sequence_id: int) -> bool:
        """Cancel one sequence of the running :meth:`run` (any thread)."""
        mux = self._mux
        return mux.cancel(sequence_id) if mux is not None else False

    def new_sequence(self, prompt: Sequence[int], sampling: SamplingConfig, *, max_len: int,
                     on_token: TokenCallback | None = None,
                     stream: int | None = None) -> _Sequence:
        """A sequence with a fresh id, for :meth:`StreamMultiplexer.submit`
        (by the ``admit`` of :meth:`run_continuous`). ``stream``: the
        sampler's stream (default: the id, so that no two sequences draw
        the same random numbers); give one to make a seeded sequence's
        tokens independent of what else ran before it."""
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise PMetalValueError("a prompt must have at least one token")
        if len(tokens) >= max_len:
            raise PMetalValueError(f"a prompt of {len(tokens)} tokens leaves no room in a "
                                   f"context of {max_len}")
        with self._id_lock:
            self._ids += 1
            number = self._ids
        return _Sequence(number, tokens, sampling, max_len, False, on_token, stream)

    def run_continuous(self, admit: Callable[[StreamMultiplexer, bool], bool]) -> None:
        """Generate for as long as ``admit`` wants (continuous batching).
        ``admit(mux, wait)`` is called in this thread before every round
        of the lanes: it submits new sequences into ``mux``, cancels the
        ones it wants stopped, and looks at those that finished. With
        ``wait`` True nothing is in flight and nothing is left to send: it
        may block until there is work, and returns False to end the run
        (else True). Takes the loop as :meth:`run` does; raises
        :class:`PipelineError` when the ring breaks (every sequence of
        ``mux`` failed with it)."""
        with self._lock:
            self._owner = threading.get_ident()
            try:
                if self.broken is not None:
                    raise PipelineError(f"this pipeline is broken ({self.broken}); build it "
                                        "again")
                mux = StreamMultiplexer(self.lanes, self.max_in_flight)
                self._mux = mux
                try:
                    self._loop(mux, admit)
                finally:
                    self._mux = None
            finally:
                self._owner = None

    def run(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[
            SamplingConfig], *, max_len: int, on_token: TokenCallback | None = None,
            want_logits: bool = False, started: Callable[[list[int]], None] | None = None,
            ) -> list[GenerationResult]:
        """Generate for every prompt (token ids); returns one result per
        prompt, in order. ``on_token(sequence_id, token)`` sees every token
        as it arrives; ``started(ids)`` the sequence ids, before the first
        hop (for :meth:`cancel`). Calls from several threads run one after
        the other; a call from inside a callback of the running one raises
        :class:`PipelineError`."""
        if self._owner == threading.get_ident():
            raise PipelineError("generate() was called from inside a callback of the "
                                "generate() running in this thread: put every prompt in one "
                                "call, or call again after it returns")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                return self._run(prompts, sampling, max_len=max_len, on_token=on_token,
                                 want_logits=want_logits, started=started)
            finally:
                self._owner = None

    def _run(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[
            SamplingConfig], *, max_len: int, on_token: TokenCallback | None,
             want_logits: bool, started: Callable[[list[int]], None] | None,
             ) -> list[GenerationResult]:
        if self.broken is not None:
            raise PipelineError(f"this pipeline is broken ({self.broken}); build it again")
        settings = [sampling] * len(prompts) if isinstance(sampling, SamplingConfig) \
            else list(sampling)
        if len(settings) != len(prompts):
            raise PMetalValueError(f"{len(settings)} sampling settings for {len(prompts)} "
                                   "prompts")
        mux = StreamMultiplexer(self.lanes, self.max_in_flight)
        seqs = []
        for prompt, config in zip(prompts, settings, strict=True):
            seq = self.new_sequence(prompt, config, max_len=max_len, on_token=on_token)
            seq.want_logits = want_logits
            mux.submit(seq)
            seqs.append(seq)
        self._mux = mux
        if started is not None:
            started([s.id for s in seqs])
        try:
            self._loop(mux)
        finally:
            self._mux = None
        return [s.result() for s in seqs]

    def _loop(self, mux: StreamMultiplexer,
              admit: Callable[[StreamMultiplexer, bool], bool] | None = None) -> None:
        in_flight: collections.deque[int] = collections.deque()
        try:
            self._lanes(mux, in_flight, admit)
        except BaseException as exc:
            # The user's callback raised, or Ctrl-C: hops are still going
            # round the ring, and the next run would take them for its own.
            # (A broken ring has nothing left to collect.)
            if self.broken is None:
                self._abandon(mux, in_flight, exc)
            raise

    def _lanes(self, mux: StreamMultiplexer, in_flight: collections.deque[int],
               admit: Callable[[StreamMultiplexer, bool], bool] | None) -> None:
        idle = list(range(self.lanes))
        # lane -> when its hop left, its bytes, and the seconds sending took
        left: dict[int, tuple[float, int, float]] = {}
        while True:
            if admit is not None:
                admit(mux, False)
            now = time.perf_counter()
            ready = [(lane, mux.next_hop(lane, now)) for lane in list(idle)]
            sending = [(lane, hop) for lane, hop in ready if hop is not None]
            for lane, hop in sending:
                hop.busy = len(in_flight) + len(sending)   # the stages' thread hint
                self.widest = max(self.widest, sum(1 for e in hop.entries if e.tokens))
                sent, began = self.sender.bytes, time.perf_counter()
                self._send(hop, mux)
                left[lane] = (began, self.sender.bytes - sent, time.perf_counter() - began)
                idle.remove(lane)
                in_flight.append(lane)
            if not in_flight:
                if admit is None or not admit(mux, True):
                    return
                continue
            lane = in_flight.popleft()
            received = self.receiver.bytes
            hop = self._recv(mux)
            now = time.perf_counter()
            mux.on_hop(lane, hop, now)
            idle.append(lane)
            began, sent, send_seconds = left.pop(lane, (now, 0, 0.0))
            TALLY.pipeline_step(self.name, self.stages,
                                sum(1 for e in hop.entries if len(e.tokens) == 1 and not e.error),
                                now - began, sent, self.receiver.bytes - received, send_seconds)

    def _abandon(self, mux: StreamMultiplexer, in_flight: collections.deque[int],
                 exc: BaseException) -> None:
        """After an interrupted run: collect the hops still in flight and have
        the stages drop every sequence they hold, so the ring is clean for
        the next run. When that cannot be done (the interruption came in the
        middle of a send or a receive, or the ring does not answer), the
        loop is broken and later runs say so."""
        why = f"generate() was interrupted ({type(exc).__name__}: {exc})"
        if not self._io and self.broken is None:
            try:
                deadline = time.monotonic() + self.step_timeout
                for _ in in_flight:
                    self.receiver.recv(deadline, rest=self.step_timeout)
                ends = [Entry(sid, end=True) for lane in mux.drops for sid in lane]
                ends += [Entry(seq.id, end=True) for lane in mux.members for seq in lane]
                if ends:
                    self.sender.send(Hop(ends))
                    self.receiver.recv(deadline, rest=self.step_timeout)
                return
            except BaseException as again:  # noqa: BLE001 - a second Ctrl-C included
                why += f" and its steps in flight could not be collected ({again!r})"
        else:
            why += " in the middle of a hop"
        if self.broken is None:
            self.broken = why
            self.links.close(timeout=1.0)

    def _send(self, hop: Hop, mux: StreamMultiplexer) -> None:
        try:
            self._io = True
            self.sender.send(hop)
            self._io = False
            self.hops += 1
        except (PeerError, CollectiveError, SecurityError, OSError) as exc:
            self._break(mux, f"sending to stage 0 failed: {exc}")

    def _recv(self, mux: StreamMultiplexer) -> Hop:
        deadline = time.monotonic() + self.step_timeout
        try:
            self._io = True
            while True:
                # A hop's first part is awaited in slices, between which the
                # cluster is asked about the stages: a host lost without a
                # word breaks no link, and step_timeout is a minute.
                wait = deadline if self.health is None else \
                    min(deadline, time.monotonic() + HEALTH_SLICE)
                try:
                    hop = self.receiver.recv(wait, rest=self.step_timeout)
                    break
                except TimeoutError:
                    if wait >= deadline:
                        raise
                why = self.health() if self.health is not None else None
                if why is not None:
                    self._io = False
                    self._break(mux, why, describe=False)
            self._io = False
            return hop
        except TimeoutError as exc:
            self._break(mux, f"no step came back from the last stage within "
                        f"{self.step_timeout:g} s (a stage stalled: {exc})")
        except (PeerError, CollectiveError, ProtocolError, SecurityError, OSError) as exc:
            self._break(mux, f"the ring broke: {exc}")
        raise AssertionError("unreachable")

    def _break(self, mux: StreamMultiplexer, why: str, *, describe: bool = True) -> None:
        if describe:
            why = self.describe_failure(why)
        self.broken = why
        mux.fail_all(why, time.perf_counter())
        self.links.close(timeout=1.0)   # the stages see it and stop serving
        raise PipelineError(f"pipeline failed: {why}; every sequence in flight failed "
                            "with it")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the stages: an empty hop goes round the ring (each stage
        passes it on and stops serving); then the links close. A broken
        ring just closes. Called while a run is under way (from another
        thread or a callback), it closes the links: the run fails with
        :class:`PipelineError`."""
        if not self._lock.acquire(blocking=False):
            self.broken = self.broken or "closed while generate() was running"
            self.links.close(timeout=1.0)
            return
        try:
            self._close(timeout)
        finally:
            self._lock.release()

    def _close(self, timeout: float) -> None:
        if self.broken is None:
            try:
                self.sender.send(Hop([]))
                self.receiver.recv(time.monotonic() + timeout, rest=timeout)
            except (PeerError, CollectiveError, ProtocolError, SecurityError, TimeoutError,
                    OSError) as exc:
                # Already gone: closing the links is all that is left.
                self.broken = f"closed ({exc})"
        self.links.close(timeout=1.0)

    def statistics(self) -> dict[str, Any]:
        return {"hops": self.hops, "bytes_sent": self.sender.bytes,
                "bytes_received": self.receiver.bytes, "widest_hop": self.widest}



def generate_single_process(stage: Any, prompts: Sequence[Sequence[int]],
                            sampling: SamplingConfig, *, max_len: int,
                            want_logits: bool = False) -> list[GenerationResult]:
    """The reference a pipeline must equal: every prompt generated alone in
    this process by ``stage`` (a stage over all of the model's layers),
    with the same steps as the pipeline (the prompt in one forward pass,
    then one decode step at a time) and the same sampling streams."""
    results = []
    for number, prompt in enumerate(prompts, 1):
        started = time.perf_counter()
        tokens = [int(t) for t in prompt]
        cache = stage.new_cache(max_len)
        sampler = Sampler(sampling, stream=number)
        hidden = stage.forward(stage.embed(tokens), cache)
        out: list[int] = []
        logits_seen: list[np.ndarray] = []
        first = None
        finish = FINISH_LENGTH
        while True:
            logits = stage.logits(hidden[-1:])[0]
            if want_logits:
                logits_seen.append(logits)
            token = sampler.sample(logits)
            out.append(token)
            first = first if first is not None else time.perf_counter()
            if token in sampling.stop_token_ids:
                finish = FINISH_STOP
                break
            if len(out) >= sampling.max_tokens or cache.length >= max_len:
                break
            hidden = stage.forward_batch(stage.embed([token]), [cache])
        results.append(GenerationResult(number, tokens, out, finish, None, first - started,
                                        time.perf_counter() - started,
                                        logits_seen if want_logits else None))
    return results
