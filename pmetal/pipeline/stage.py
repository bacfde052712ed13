"""A pipeline stage: a contiguous range of a model's layers, in an actor.

:class:`PipelineStageRuntime` is the engine, usable in any process: it
holds its layers (loaded from the model file, only its own range), one KV
cache per sequence in flight, and on the last stage one
:class:`~pmetal.pipeline.sampling.Sampler` per sequence. :meth:`step` turns
the :class:`~pmetal.pipeline.transport.Hop` it received into the one it
sends: stage 0 embeds tokens, every stage runs its layers (a prompt as one
forward pass, the decode steps of all sequences in the hop as one batch),
the last stage samples; activations are decoded on the way in and encoded
with the pipeline's codec on the way out.

:class:`PipelineStage` is the actor around it (placed by
:class:`~pmetal.pipeline.pipeline.Pipeline` with ``node=``): ``open``
listens, ``connect`` joins the pipeline's ring and starts the serving
thread, which receives from the previous rank, steps, and sends to the
next one until the ring closes. A failure there (a neighbour died, a
malformed hop) closes every link of this stage at once, so the failure
runs round the ring to the driver in milliseconds instead of each rank
waiting for its deadline.

A failure of one sequence (its prompt longer than its KV cache, a token id
out of the vocabulary, bad sampling settings) fails that sequence only: its
entry travels on with ``error`` set and the stages drop its state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pmetal.actors import context
from pmetal.links import tcplinks
from pmetal.errors import (
    CollectiveError,
    ConfigError,
    PeerError,
    PMetalError,
    PMetalValueError,
    ProtocolError,
)
from pmetal.pipeline.activations import ActivationCodec
from pmetal.pipeline.llama import KVCache, LlamaConfig, LlamaWeights
from pmetal.pipeline.backends import BACKENDS, build_stage
from pmetal.pipeline.sampling import Sampler, SamplingConfig
from pmetal.pipeline.threads import set_compute_threads
from pmetal.pipeline.transport import Entry, Hop, HopReceiver, HopSender
from pmetal.pipeline.weights import StageWeights, is_store_model, stage_weights
from pmetal.tally import TALLY

__all__ = ["PipelineStage", "PipelineStageConfig", "PipelineStageRuntime"]

log = logging.getLogger(__name__)

_IDLE_SLICE = 1.0   # the serving thread re-checks that it should go on this often


@dataclass(frozen=True)
class PipelineStageConfig:
    """What one stage runs.

    ``model`` is ``sha256:<hex>``, a GGUF model of the store named by its
    file's sha256 (each stage reads its own node's store and pulls the
    pieces it lacks from the members at ``sources``, checking the manifest
    against the digest ``manifest``: :mod:`pmetal.pipeline.weights`), or the
    path of a GGUF file or Hugging Face folder that every stage's machine
    sees (only the tensors of ``[start, end)`` are read); or, for tests and
    benchmarks, ``random_model``: a :class:`LlamaConfig` as a dict whose
    random weights (seeded by ``seed``) every stage draws alike.
    ``codec`` encodes the activations this stage sends; ``threads`` caps
    the BLAS threads of the stage's process while other stages compute
    too (0: leave as it is), ``threads_alone`` while it computes alone
    (the driver has one hop in flight; 0: every core of its machine);
    ``backend`` is ``quantized``, ``reference``, ``mlx`` or ``auto``, see
    :mod:`pmetal.pipeline.backends`.
    """

    start: int
    end: int
    index: int
    num_stages: int
    model: str = ""
    random_model: dict[str, Any] | None = None
    seed: int = 0
    codec: str = "none"
    threads: int = 0
    threads_alone: int = 0
    backend: str = "auto"
    manifest: str = ""
    sources: tuple[str, ...] = ()
    name: str = "pipeline"
    """The pipeline's name in its nodes' metrics (pmetal.tally)."""

    def __post_init__(self) -> None:
        if not (type(self.num_stages) is int and self.num_stages >= 1):
            raise ConfigError(f"num_stages {self.num_stages!r} must be an int >= 1")
        if not (type(self.index) is int and 0 <= self.index < self.num_stages):
            raise ConfigError(f"stage index {self.index!r} must be in 0..{self.num_stages - 1}")
        if not (type(self.start) is int and type(self.end) is int and 0 <= self.start < self.end):
            raise ConfigError(f"layer range [{self.start!r}, {self.end!r}) must be a "
                              "non-empty range of layer numbers")
        if bool(self.model) == (self.random_model is not None):
            raise ConfigError("give a stage either model= (a GGUF file or a Hugging Face "
                              "folder) or random_model= (a LlamaConfig as a dict), not both")
        if self.model.startswith("sha256:") and not (
                len(self.model) == 71 and all(c in "0123456789abcdef" for c in self.model[7:])):
            raise ConfigError(f"model {self.model!r}: a stored model is 'sha256:' and the 64 "
                              "lowercase hex digits of its file's sha256")
        ActivationCodec.parse(self.codec)
        for name in ("threads", "threads_alone"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ConfigError(f"{name} {value!r} must be an int >= 0")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r}: choose from {', '.join(BACKENDS)}")

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def _check_range(config: PipelineStageConfig, model: LlamaConfig) -> None:
    layers = model.num_hidden_layers
    if config.end > layers:
        raise PMetalValueError(f"stage {config.index}: layers [{config.start}, {config.end}) "
                               f"beyond the model's {layers} layers")
    if config.is_first != (config.start == 0) or config.is_last != (config.end == layers):
        raise PMetalValueError(
            f"stage {config.index} of {config.num_stages} holds layers [{config.start}, "
            f"{config.end}) of {layers}: the first stage must start at layer 0 and the last "
            "must end at the last layer")


@dataclass
class StageStatistics:
    """What a stage did, for the generation loop's report."""

    steps: int = 0
    rows: int = 0
    compute_seconds: float = 0.0
    decode_steps: int = 0           # steps that held decode entries only (no prompt)
    decode_seconds: float = 0.0     # their compute time
    wait_seconds: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    load_seconds: float = 0.0
    sequences: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "rows": self.rows,
                "compute_seconds": self.compute_seconds, "decode_steps": self.decode_steps,
                "decode_seconds": self.decode_seconds, "wait_seconds": self.wait_seconds,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "load_seconds": self.load_seconds, "sequences": self.sequences}


class PipelineStageRuntime:
    """One stage's engine (see the module docstring). Not thread-safe:
    one thread steps it."""

    def __init__(self, config: PipelineStageConfig, *, weights: LlamaWeights | None = None,
                 stage: Any = None) -> None:
        self.config = config
        self.codec = ActivationCodec.parse(config.codec)
        started = time.perf_counter()
        if stage is None:
            stage = build_stage(config, max_threads=self._max_threads(), weights=weights)
            _check_range(config, stage.config)
        self.stage = stage
        self.model: LlamaConfig = stage.config
        self.stats = StageStatistics(load_seconds=time.perf_counter() - started)
        self._caches: dict[int, KVCache] = {}
        self._samplers: dict[int, Sampler] = {}
        self._want_logits: set[int] = set()
        self._threads = 0

    def close(self) -> None:
        """End the stage's compute helpers (a stage object without
        ``close`` has none)."""
        close = getattr(self.stage, "close", None)
        if close is not None:
            close()

    def _max_threads(self) -> int | None:
        """The most compute threads a step will use (see :meth:`_threads_for`);
        None when the stage leaves the count as it is."""
        return max(self._wanted(1), self._wanted(2)) if self.config.threads else None

    def _wanted(self, busy: int) -> int:
        """Compute threads for a step with ``busy`` hops in flight."""
        c = self.config
        return (c.threads_alone or os.cpu_count() or 1) if busy <= 1 else c.threads

    @property
    def sequences(self) -> int:
        """Sequences whose state this stage holds."""
        return len(self._caches)

    def step(self, hop: Hop) -> Hop:
        """This stage's work on one hop; returns the hop it sends on."""
        started = time.perf_counter()
        out: dict[int, Entry] = {}
        decode: list[tuple[Entry, np.ndarray]] = []
        order: list[int] = []
        for entry in hop.entries:
            seq = entry.sequence_id
            order.append(seq)
            if entry.error is not None or (entry.end and entry.activation is None
                                           and not entry.tokens):
                self._drop(seq)
                out[seq] = Entry(seq, entry.position, end=True, error=entry.error)
                continue
            try:
                hidden = self._admit(entry)
            except (PMetalError, ValueError) as exc:
                self._drop(seq)
                out[seq] = Entry(seq, entry.position, end=True, error=self._where(exc))
                continue
            if entry.prefill or hidden.shape[0] != 1:
                try:
                    result = self.stage.forward(hidden, self._caches[seq])
                except (PMetalError, ValueError) as exc:
                    self._drop(seq)
                    out[seq] = Entry(seq, entry.position, end=True, error=self._where(exc))
                    continue
                out[seq] = self._emit(entry, result)
            else:
                decode.append((entry, hidden))
        if decode:
            self._decode(decode, out)
        self.stats.steps += 1
        self.stats.rows += sum(e.activation.shape[0] if e.activation is not None else 0
                               for e in out.values())
        took = time.perf_counter() - started
        self.stats.compute_seconds += took
        if decode and not any(e.prefill for e in hop.entries):
            self.stats.decode_steps += 1
            self.stats.decode_seconds += took
        return Hop([out[seq] for seq in order], hop.busy)  # the hint goes round the ring

    def _admit(self, entry: Entry) -> np.ndarray:
        """The entry's input as float32 rows, with its sequence's state
        made at its first step."""
        seq = entry.sequence_id
        if entry.setup is not None and seq not in self._caches:
            self._start(seq, entry.setup)
        cache = self._caches.get(seq)
        if cache is None:
            raise PMetalValueError(f"sequence {seq} is unknown at this stage (its first step "
                                   "carries its setup)")
        if entry.position != cache.length:
            raise PMetalValueError(f"sequence {seq}: a step at position {entry.position}, "
                                   f"but this stage's cache holds {cache.length} positions")
        if self.config.is_first:
            if not entry.tokens or entry.activation is not None:
                raise PMetalValueError(f"sequence {seq}: the first stage takes token ids")
            return self.stage.embed(entry.tokens)
        if entry.activation is None:
            raise PMetalValueError(f"sequence {seq}: stage {self.config.index} takes "
                                   "activations")
        return self.codec.decode(entry.activation)

    def _start(self, seq: int, setup: dict[str, Any]) -> None:
        max_len = setup.get("max_len")
        if type(max_len) is not int or not 0 < max_len <= self.model.max_position_embeddings:
            raise PMetalValueError(f"sequence {seq}: max_len {max_len!r} must be in "
                                   f"1..{self.model.max_position_embeddings}")
        if self.config.is_last:
            sampling = setup.get("sampling") or {}
            if not isinstance(sampling, dict):
                raise PMetalValueError(f"sequence {seq}: sampling settings are not a map")
            try:
                config = SamplingConfig(**{k: tuple(v) if k == "stop_token_ids" else v
                                           for k, v in sampling.items()})
            except TypeError as exc:
                # An unknown setting or a stop list that is no list: this
                # sequence fails, the serving thread must not.
                raise PMetalValueError(f"sequence {seq}: sampling settings {sampling!r:.120} "
                                       f"are not SamplingConfig's ({exc})") from exc
            self._samplers[seq] = Sampler(config, stream=int(setup.get("stream", seq)))
            if setup.get("logits"):
                self._want_logits.add(seq)
        self._caches[seq] = self.stage.new_cache(max_len)
        self.stats.sequences += 1

    def _decode(self, work: list[tuple[Entry, np.ndarray]], out: dict[int, Entry]) -> None:
        hidden = np.concatenate([h for _, h in work]) if len(work) > 1 else work[0][1]
        caches = [self._caches[e.sequence_id] for e, _ in work]
        try:
            result = self.stage.forward_batch(hidden, caches)
        except (PMetalError, ValueError) as exc:
            # One sequence out of room fails the batch: retry one by one, so
            # only that sequence fails.
            if len(work) == 1:
                seq = work[0][0].sequence_id
                self._drop(seq)
                out[seq] = Entry(seq, work[0][0].position, end=True, error=self._where(exc))
                return
            for item in work:
                self._decode([item], out)
            return
        # The last stage's head runs once for the batch: it is a fifth of
        # the model's weights, and a row's logits do not depend on its batch.
        logits = self.stage.logits(result) if self.config.is_last else None
        for row, (entry, _) in enumerate(work):
            out[entry.sequence_id] = self._emit(
                entry, result[row:row + 1], None if logits is None else logits[row])

    def _emit(self, entry: Entry, result: np.ndarray, logits: np.ndarray | None = None) -> Entry:
        seq, rows = entry.sequence_id, result.shape[0]
        if not self.config.is_last:
            message = self.codec.encode(result, sequence_id=seq, position=entry.position,
                                        prefill=entry.prefill)
            reply = Entry(seq, entry.position, activation=message, prefill=entry.prefill,
                          end=entry.end, setup=entry.setup)
        else:
            if logits is None:
                logits = self.stage.logits(result[rows - 1:rows])[0]
            try:
                token = self._samplers[seq].sample(logits)
            except PMetalError as exc:
                self._drop(seq)
                return Entry(seq, entry.position, end=True, error=self._where(exc))
            reply = Entry(seq, entry.position + rows, tokens=(token,), end=entry.end,
                          logits=logits if seq in self._want_logits else None)
        if entry.end:
            self._drop(seq)
        return reply

    def _drop(self, seq: int) -> None:
        self._caches.pop(seq, None)
        self._samplers.pop(seq, None)
        self._want_logits.discard(seq)

    def _where(self, exc: BaseException) -> str:
        return (f"stage {self.config.index} (layers {self.config.start}-"
                f"{self.config.end - 1}): {exc}")

    def _threads_for(self, busy: int) -> None:
        """BLAS threads for a step: every core when this stage computes
        alone (one hop in flight: the other stages wait), its share when
        hops keep several stages busy at once."""
        if not self.config.threads:
            return
        want = self._wanted(busy)
        if want != self._threads:
            set_compute_threads(want)
            self._threads = want

    def serve(self, links: Any, rank: int, world: int, *, stop: threading.Event,
              step_timeout: float) -> None:
        """Receive, step and send until ``stop`` is set or the ring breaks
        (then raises what broke it: ``PeerError`` when a neighbour died,
        ``ProtocolError`` for a malformed hop). Once a hop has started
        arriving, the rest of it must come within ``step_timeout``."""
        receiver = HopReceiver(links, rank - 1)
        sender = HopSender(links, (rank + 1) % world)
        rest = getattr(self.stage, "rest", None)
        while not stop.is_set():
            waited = time.perf_counter()
            try:
                hop = receiver.recv(time.monotonic() + _IDLE_SLICE, rest=step_timeout)
            except TimeoutError:
                continue        # idle (no sequence in flight): look at ``stop`` again
            self.stats.wait_seconds += time.perf_counter() - waited
            self._threads_for(hop.busy)
            if not hop.entries:
                # The driver's goodbye: pass it on and stop.
                sender.send(hop)
                stop.set()
                return
            computed = self.stats.compute_seconds
            reply = self.step(hop)
            if rest is not None:
                rest()   # compute helpers stop spinning: the next hop takes a while
            sent, sending = sender.bytes, time.perf_counter()
            sender.send(reply)
            self.stats.bytes_in = receiver.bytes
            self.stats.bytes_out = sender.bytes
            TALLY.stage_step(self.config.name, self.config.index,
                             self.stats.compute_seconds - computed, sender.bytes - sent,
                             time.perf_counter() - sending)


class PipelineStage:
    """The stage actor. Created by :class:`~pmetal.pipeline.pipeline.Pipeline`
    through ``pmetal.remote``; its methods are called by the driver."""

    def __init__(self, config: PipelineStageConfig, step_timeout: float = 60.0) -> None:
        self.config = config
        self.step_timeout = step_timeout
        self.runtime: PipelineStageRuntime | None = None
        self._listener: Any = None
        self._links: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._failure: str | None = None
        self._weights: StageWeights | None = None

    def load(self) -> dict[str, Any]:
        """Load this stage's layers (apart from the constructor, so that the
        driver has every stage load at once); where and what it is."""
        if self.runtime is None:
            config = self.config
            if is_store_model(config.model):
                # This node's store, the missing pieces pulled from the members.
                self._weights = stage_weights(config, context.current())
                config = replace(config, model=str(self._weights.path))
            if self.config.threads:
                set_compute_threads(self.config.threads)
            self.runtime = PipelineStageRuntime(config)
        c, w = self.config, self._weights
        return {"index": c.index, "start": c.start, "end": c.end, "pid": os.getpid(),
                "load_seconds": self.runtime.stats.load_seconds,
                "pulled": w.pulled if w else 0, "pull_seconds": w.seconds if w else 0.0,
                "pulled_from": dict(w.sources) if w else {}}

    def open(self) -> tuple[str, int]:
        """Listen for the ring on this worker's host; the address."""
        host = tcplinks.reachable_host(context.current())
        self._listener = tcplinks.listen(host, 0)
        return host, self._listener.getsockname()[1]

    def connect(self, addresses: list[tuple[str, int]], rank: int, tag: bytes,
                timeout: float) -> bool:
        """Join the ring (rank ``rank`` of ``addresses``) and start serving."""
        if self._listener is None or self.runtime is None:
            raise PMetalValueError("load() and open() the stage before connect()")
        client = context.current()
        try:
            self._links = tcplinks.connect_mesh(
                rank, [tuple(a) for a in addresses], self._listener,
                key=tcplinks.collective_key(client.namespace.psk), tag=tag, epoch=1,
                deadline=time.monotonic() + timeout)
        finally:
            self._listener.close()
            self._listener = None
        self._thread = threading.Thread(target=self._serve, args=(rank, len(addresses)),
                                        daemon=True,
                                        name=f"pmetal-stage-{self.config.index}")
        self._thread.start()
        return True

    def _serve(self, rank: int, world: int) -> None:
        try:
            self.runtime.serve(self._links, rank, world, stop=self._stop,
                               step_timeout=self.step_timeout)
        except (PeerError, ProtocolError, CollectiveError, PMetalError, OSError) as exc:
            self._failure = f"{type(exc).__name__}: {exc}"
            if not self._stop.is_set():
                log.warning("pipeline stage %d stops: %s", self.runtime.config.index, exc)
        except Exception as exc:
            # A bug (here or in a user's stage class): say so where the
            # driver looks (statistics), with the traceback in the log.
            self._failure = f"unexpected {type(exc).__name__}: {exc}"
            log.exception("pipeline stage %d stops on an unexpected error",
                          self.runtime.config.index)
        finally:
            # Close every link at once: the failure reaches the driver
            # round the ring instead of at each rank's deadline.
            self._links.close(timeout=1.0)

    def statistics(self) -> dict[str, Any]:
        if self.runtime is None:
            return {"failure": self._failure, "in_flight": 0, "pid": os.getpid()}
        stats = self.runtime.stats.as_dict()
        stats["pid"] = os.getpid()
        stats["failure"] = self._failure
        stats["in_flight"] = self.runtime.sequences
        return stats

    def close(self) -> bool:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_IDLE_SLICE * 3)
        if self.runtime is not None and (self._thread is None or not self._thread.is_alive()):
            self.runtime.close()
        return True
