"""``pmetal bench pipeline``: how fast pmetal's model engine generates on
this machine, against llama.cpp on the same GGUF file in the same sitting,
and whether it meets the speed targets of issue [7/11].

The engine is the one ``--backend`` names (:mod:`pmetal.pipeline.backends`;
``auto``: the quantized engine for a GGUF file), built as a pipeline stage
holding every layer, so the bench measures what ``pmetal generate`` runs.
``--backend reference`` measures the float32 decoder the others are checked
against.

Tables:

(a) **single process**, per compute thread count (1 and 2 by default;
    :func:`pmetal.pipeline.threads.set_compute_threads`, which the engines
    read before every product; the bench refuses a count it cannot set):
    prefill time of the chat prompts (one forward of all their tokens),
    time to first token (prefill plus the LM head and the greedy choice),
    decode tokens/s of one sequence (greedy, one token per step), aggregate
    tokens/s of ``batch`` sequences decoded together (``forward_batch``,
    every sequence at its own position), and the prefill of one long prompt
    (``prefill_tokens`` ids: embedding, every layer, the last row's logits:
    what ``Llama.eval`` computes). Medians over ``repeats`` repetitions,
    each over every prompt.
(b) **llama.cpp**, the anchor (:mod:`pmetal.bench.anchor`), when
    llama-cpp-python is importable and the model is a GGUF file: the same
    prompt ids, greedy (its own sampler), the same thread counts, time to
    first token and decode tokens/s, and ``Llama.eval`` of the same long
    prompt after a reset. Labelled "not installed" otherwise; never a
    dependency.
(c) **pipeline** rows (stages of the same backend over loopback; codec
    agreement): measured by the function given as :attr:`Options.pipeline`;
    "not measured" without one.
(d) **under load**: ``hogs`` busy-loop processes (:mod:`pmetal.bench.hogs`)
    beside the bench while both engines decode one sequence on the most
    threads of (a); the share of the quiet rate (from (a) and (b)) each
    keeps.

Then the **targets** of issue [7/11], every ratio within this run: decode of
one sequence >= 0.8x llama.cpp at each thread count; ``batch`` sequences
batched >= 1.5x llama.cpp's single stream (most threads); the long prefill
>= 0.5x llama.cpp's speed at each thread count; under load, a share of the
quiet rate at least llama.cpp's.

Prompts are the chat prompts below, tokenized by llama.cpp when it is
installed, else by pmetal's tokenizer of the model, else fixed ids of a
typical length; both engines get the same ids, and the long prompt is
their ids repeated. Decoding never stops early: the timed step count is
fixed.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from pmetal.bench.anchor import (
    AnchorRow,
    has_amx,
    llama_cpp_prefill,
    llama_cpp_state,
    load_llama,
    measure_llama_cpp,
)
from pmetal.bench.hogs import HOG_DEADLINE, alive, cpu_hogs
from pmetal.errors import ConfigError

if TYPE_CHECKING:  # numpy only where it is used: 'pmetal --help' need not pay it
    from pmetal.pipeline.llama import LlamaConfig

__all__ = ["AnchorRow", "LoadRow", "Options", "PipelineRow", "SingleRow", "TargetRow",
           "build_engine", "measure_llama_cpp", "measure_single_process", "random_config",
           "run"]

PROMPTS = ("What is the capital of France?",
           "Write a haiku about the sea.",
           "Explain in one sentence what a CPU cache is.",
           "List three prime numbers.")
# SmolLM2-Instruct's chat template (ChatML), applied by hand so that llama.cpp's
# tokenizer gives both sides the same ids.
CHATML = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
FALLBACK_PROMPT_LEN = 30  # tokens of a short chat prompt, when no tokenizer is at hand
SHAPES = ("smollm2-135m", "tiny")
# Issue [7/11]'s targets, as ratios to llama.cpp in the same run.
TARGET_DECODE = 0.8     # x llama.cpp, one sequence, same thread count
TARGET_BATCHED = 1.5    # x llama.cpp's single stream, aggregate of the batch
TARGET_PREFILL = 0.5    # x llama.cpp's speed on the long prompt, same thread count


@dataclass(frozen=True)
class SingleRow:
    """One compute thread count of the single-process engine; times in
    seconds, medians. ``long_prefill``: the long prompt (0.0: not measured)."""
    threads: int
    prefill: float
    first_token: float
    decode_tps: float
    batch: int
    batch_tps: float
    long_prefill: float = 0.0


@dataclass(frozen=True)
class PipelineRow:
    """One line of table (c), filled by the pipeline's measuring function."""
    label: str                       # e.g. "2 stages, codec none, 1 sequence"
    tokens_per_s: float
    vs_single: float | None = None   # ratio to the single-process single-stream rate
    hop_overhead_ms: float | None = None
    bytes_per_token: int | None = None
    agreement: float | None = None   # fraction of greedy tokens equal to codec none
    max_logit_diff: float | None = None
    seal_us: float | None = None     # sealing and opening a token's hops, microseconds


@dataclass(frozen=True)
class LoadRow:
    """Decode of one sequence on ``threads`` threads, quiet and beside the hogs."""
    engine: str
    threads: int
    quiet_tps: float
    loaded_tps: float

    @property
    def share(self) -> float:
        return self.loaded_tps / self.quiet_tps


@dataclass(frozen=True)
class TargetRow:
    """One line of the targets table; ``met`` is None when it could not be
    judged, for the reason ``why``."""
    measure: str
    measured: str
    target: str
    met: bool | None
    why: str = "no anchor"


PipelineHook = Callable[["Options", list[list[int]]], list[PipelineRow]]


@dataclass(frozen=True)
class Options:
    model: str | None = None            # a GGUF file (or a Hugging Face folder: no anchor)
    backend: str = "auto"               # see pmetal.pipeline.backends
    random_shape: str | None = None     # random weights of one of SHAPES instead of the model's
    prompts: tuple[str, ...] = PROMPTS
    decode_tokens: int = 32             # timed decode steps per sequence
    repeats: int = 3
    batch: int = 4
    threads: tuple[int, ...] = (1, 2)   # compute threads of (a); llama.cpp's threads of (b)
    prefill_tokens: int = 512           # the long prompt (0: not measured)
    hogs: int = 2                       # busy loops beside table (d) (0: no table (d))
    hog_deadline: float = HOG_DEADLINE  # seconds a hog lives at most
    anchors: bool = True
    markdown: bool = False
    command: str = "pmetal bench pipeline"
    pipeline: PipelineHook | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.decode_tokens < 2 or self.repeats < 1 or self.batch < 1 or not self.prompts:
            raise ConfigError(
                f"--tokens {self.decode_tokens}, --repeats {self.repeats}, --batch "
                f"{self.batch}: need at least 2 tokens, 1 repetition, 1 sequence and a prompt")
        if not self.threads or min(self.threads) < 1:
            raise ConfigError(f"--threads {self.threads}: thread counts are positive integers")
        if self.prefill_tokens < 0 or self.hogs < 0:
            raise ConfigError(f"--prefill-tokens {self.prefill_tokens}, --hogs {self.hogs}: "
                              "0 (skip) or more")
        if self.random_shape is not None and self.random_shape not in SHAPES:
            raise ConfigError(f"--random-weights {self.random_shape!r}: choose from "
                              f"{', '.join(SHAPES)}")
        if self.random_shape is None and not self.model:
            raise ConfigError("give a model (--model PATH) or --random-weights SHAPE")


def default_model() -> str:
    """The default model's file (fetched on first use)."""
    from pmetal.pipeline.models import resolve_model
    return str(resolve_model(None))


def random_config(shape: str) -> LlamaConfig:
    """The shape of random weights: ``tiny`` for tests, or the default model's."""
    from pmetal.pipeline.llama import SMOLLM2_135M, LlamaConfig
    if shape == "tiny":
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, tie_word_embeddings=True)
    return SMOLLM2_135M


def build_engine(model: str | None, backend: str, *, random_shape: str | None = None,
                 max_threads: int | None = None) -> tuple[Any, LlamaConfig, str, str]:
    """The whole model as one pipeline stage of ``backend``, built as
    ``pmetal generate`` builds its stages; returns the stage, the model's
    shape, the backend ``auto`` resolved to and a line saying what was loaded."""
    from pathlib import Path

    from pmetal.pipeline.backends import build_stage, resolve_backend
    from pmetal.pipeline.stage import PipelineStageConfig

    if random_shape is not None:
        config = random_config(random_shape)
        resolved = resolve_backend(backend, gguf=False)
        spec = PipelineStageConfig(start=0, end=config.num_hidden_layers, index=0, num_stages=1,
                                   random_model=dict(config.__dict__), backend=resolved)
        described = f"random weights of the {random_shape} shape" + (
            ", quantized to Q8_0 at load" if resolved == "quantized" else "")
    else:
        from pmetal.pipeline import loader

        assert model is not None
        config = loader.load_config(model)
        resolved = resolve_backend(backend, gguf=loader.is_gguf(Path(model)))
        spec = PipelineStageConfig(start=0, end=config.num_hidden_layers, index=0, num_stages=1,
                                   model=model, backend=resolved)
        described = model + {"quantized": ", its blocks as stored",
                             "reference": ", dequantized to float32",
                             "mlx": ", float32 MLX arrays"}[resolved]
    stage = build_stage(spec, max_threads=max_threads)
    return stage, config, resolved, f"{described} ({resolved} engine)"


# ------------------------------------------------------------ our engine

def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _use_threads(threads: int) -> None:
    """Set this process's compute threads, or refuse: a row must run on the
    thread count it claims."""
    from pmetal.pipeline.threads import set_compute_threads
    got = set_compute_threads(threads)
    if got != threads:
        raise ConfigError(
            f"--threads {threads}: this process's compute threads cannot be set to {threads} "
            f"(numpy's BLAS {'is not an OpenBLAS pmetal can reach' if got is None else f'gives {got}'}); "
            "measure thread counts it can run, e.g. --threads 1")


def _decode(stage: Any, prompts: Sequence[Sequence[int]], *, decode_tokens: int, repeats: int
            ) -> tuple[list[float], list[float], list[float]]:
    """Prefill seconds, first-token seconds and decode tokens/s of each
    prompt alone, ``repeats`` times."""
    longest = max(len(p) for p in prompts) + decode_tokens + 2
    prefills, firsts, rates = [], [], []
    for _ in range(repeats):
        for prompt in prompts:
            cache = stage.new_cache(longest)
            began = time.perf_counter()
            hidden = stage.forward(stage.embed(prompt), cache)
            prefilled = time.perf_counter()
            token = int(stage.logits(hidden[-1:])[0].argmax())
            first = time.perf_counter()
            prefills.append(prefilled - began)
            firsts.append(first - began)
            for _ in range(decode_tokens):
                token = int(stage.logits(stage.forward(stage.embed([token]), cache))[0].argmax())
            rates.append(decode_tokens / (time.perf_counter() - first))
    return prefills, firsts, rates


def _long_prefill(stage: Any, ids: Sequence[int], repeats: int) -> float:
    """Median seconds of the long prompt from an empty cache (embedding,
    every layer, the last row's logits), after one untimed run."""
    times = []
    for repeat in range(repeats + 1):
        cache = stage.new_cache(len(ids) + 1)
        began = time.perf_counter()
        stage.logits(stage.forward(stage.embed(ids), cache)[-1:])
        if repeat:
            times.append(time.perf_counter() - began)
    return _median(times)


def measure_single_process(stage: Any, prompts: Sequence[Sequence[int]], *,
                           decode_tokens: int, repeats: int, batch: int, threads: int,
                           long_prompt: Sequence[int] = ()) -> SingleRow:
    """Table (a)'s row for one compute thread count (set here, for this process)."""
    import numpy as np

    _use_threads(threads)
    longest = max(len(p) for p in prompts) + decode_tokens + 2
    # one untimed pass first: page in the weights, start the worker threads
    warm = stage.new_cache(longest)
    stage.logits(stage.forward(stage.embed(prompts[0]), warm))
    prefills, firsts, singles = _decode(stage, prompts, decode_tokens=decode_tokens,
                                        repeats=repeats)
    batched = []
    for _ in range(repeats):
        caches, tokens = [], []
        for i in range(batch):  # different prompts: the sequences sit at different positions
            cache = stage.new_cache(longest)
            hidden = stage.forward(stage.embed(prompts[i % len(prompts)]), cache)
            tokens.append(int(stage.logits(hidden[-1:])[0].argmax()))
            caches.append(cache)
        began = time.perf_counter()
        for _ in range(decode_tokens):
            logits = stage.logits(stage.forward_batch(stage.embed(tokens), caches))
            tokens = [int(t) for t in np.argmax(logits, axis=-1)]
        batched.append(batch * decode_tokens / (time.perf_counter() - began))
    return SingleRow(threads=threads, prefill=_median(prefills), first_token=_median(firsts),
                     decode_tps=_median(singles), batch=batch, batch_tps=_median(batched),
                     long_prefill=_long_prefill(stage, long_prompt, repeats) if long_prompt
                     else 0.0)


def _tokenized(model: str | None, prompts: Sequence[str], vocab: int,
               llama_cpp: bool) -> tuple[list[list[int]], str]:
    """Token ids of the chat prompts: llama.cpp's tokenizer of the model
    when it is at hand (both sides see the same ids), else pmetal's
    tokenizer of the model, else fixed ids of a typical length."""
    texts = [CHATML.format(prompt=p) for p in prompts]
    ids: list[list[int]] = []
    if model is not None and llama_cpp:
        llm = load_llama(model, 1, vocab_only=True)
        try:
            ids = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]
        finally:
            llm.close()
        note = "chat prompts tokenized by llama.cpp"
    elif model is not None:
        from pmetal.pipeline.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_model(model)
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        note = "chat prompts tokenized by pmetal"
    if ids and all(p and max(p) < vocab for p in ids):
        return ids, note
    ids = [[(7 + 31 * i + 997 * j) % vocab for i in range(FALLBACK_PROMPT_LEN)]
           for j in range(len(prompts))]
    return ids, f"{FALLBACK_PROMPT_LEN} fixed token ids per prompt (no tokenizer at hand)"


def _check(options: Options) -> None:
    """Refuse a backend or a long prompt the model cannot take before any
    engine loads (the model file's header alone)."""
    from pathlib import Path

    from pmetal.pipeline import loader
    from pmetal.pipeline.backends import resolve_backend

    if options.random_shape is not None:
        config, gguf = random_config(options.random_shape), False
    else:
        assert options.model is not None
        config, gguf = loader.load_config(options.model), loader.is_gguf(Path(options.model))
    resolve_backend(options.backend, gguf=gguf)
    if options.prefill_tokens >= config.max_position_embeddings:
        raise ConfigError(f"--prefill-tokens {options.prefill_tokens}: the model's context is "
                          f"{config.max_position_embeddings} tokens")


def _long_prompt(prompts: Sequence[Sequence[int]], tokens: int) -> list[int]:
    """``tokens`` ids: the chat prompts' ids one after another, repeated."""
    flat = [t for p in prompts for t in p]
    return (flat * (tokens // len(flat) + 1))[:tokens]


# ------------------------------------------------------------ report

def _say(text: str) -> None:
    print(f"pmetal bench pipeline: {text} ...", file=sys.stderr, flush=True)


def run(options: Options, out: TextIO | None = None) -> dict[str, Any]:
    """Measure and print tables (a) to (d) and the targets on ``out``
    (default: standard output); returns the rows, and the hogs' pids."""
    from pmetal.bench.report import _grid, _load
    from pmetal.pipeline.threads import compute_threads, set_compute_threads

    stream = sys.stdout if out is None else out
    p = lambda *a: print(*a, file=stream, flush=True)
    md = options.markdown
    heading = (lambda t: f"\n### {t}\n") if md else (lambda t: f"\n# {t}")
    top = max(options.threads)
    anchor = "" if options.anchors else "not run (--anchors off)"
    anchor = anchor or (llama_cpp_state(options.model) if options.random_shape is None
                        else "not run (random weights: no GGUF file)")
    _check(options)
    stage, config, backend, described = build_engine(
        options.model, options.backend, random_shape=options.random_shape, max_threads=top)
    singles: list[SingleRow] = []
    anchors: list[AnchorRow] = []
    load: list[LoadRow] = []
    hog_pids: list[int] = []
    held = True
    before = compute_threads()
    try:
        prompts, prompt_note = _tokenized(
            None if options.random_shape else options.model, options.prompts,
            config.vocab_size, llama_cpp=not llama_cpp_state(options.model))
        long_prompt = (_long_prompt(prompts, options.prefill_tokens)
                       if options.prefill_tokens else [])
        p(_header(options, backend, described, prompt_note, [len(x) for x in prompts]))
        for threads in options.threads:
            _say(f"single process, {backend} engine, {threads} compute thread(s)")
            singles.append(measure_single_process(
                stage, prompts, decode_tokens=options.decode_tokens, repeats=options.repeats,
                batch=options.batch, threads=threads, long_prompt=long_prompt))
        p(heading(f"(a) single process, {backend} engine: medians of {options.repeats} "
                  f"repetitions x {len(prompts)} prompts, {options.decode_tokens} decode steps")
          + "\n" + _grid(
              ["threads", "prefill (ms)", "first token (ms)", "decode tok/s, 1 sequence",
               f"aggregate tok/s, {options.batch} batched",
               f"prefill of {options.prefill_tokens} tokens (ms)"],
              [[str(r.threads), f"{r.prefill * 1e3:.1f}", f"{r.first_token * 1e3:.1f}",
                f"{r.decode_tps:.1f}", f"{r.batch_tps:.1f}", _ms(r.long_prefill)]
               for r in singles], md))
        stage.rest()
        if not anchor:
            for threads in options.threads:
                anchors.append(_measure_anchor(options, threads, prompts, long_prompt))
        p(heading("(b) llama.cpp (llama-cpp-python) on the same GGUF, greedy, same prompts, "
                  "same thread counts") + "\n" + (
            _grid(["threads", "first token (ms)", "decode tok/s, 1 sequence",
                   f"prefill of {options.prefill_tokens} tokens (ms)"],
                  [[str(a.threads), f"{a.first_token * 1e3:.1f}" if not a.error else "-",
                    f"{a.decode_tps:.1f}" if not a.error else a.error, _ms(a.prefill)]
                   for a in anchors], md) if anchors else f"llama.cpp: {anchor}"))
        if options.hogs:
            load, hog_pids, held = _measure_load(options, stage, prompts, top, singles,
                                                 anchors)
    finally:
        stage.close()
        if before is not None:
            set_compute_threads(before)

    rows: list[PipelineRow] = []
    if options.pipeline is not None:
        rows = options.pipeline(options, prompts)
        best = max(r.decode_tps for r in singles)
        rows = [r if r.vs_single is not None else dataclasses.replace(
            r, vs_single=r.tokens_per_s / best) for r in rows]
    p(heading(f"(c) pipeline of stage actors over 127.0.0.1, {backend} engine (x single "
              "process: against the best 1-sequence rate of (a))") + "\n" + (
        _grid(["run", "tok/s", "vs single process", "per-hop overhead (ms/token)",
               "bytes/token", "sealing (us/token, share of a step)",
               "greedy tokens = codec none", "largest logit diff"],
              [[r.label, f"{r.tokens_per_s:.1f}", _opt(r.vs_single, "{:.2f}x"),
                _opt(r.hop_overhead_ms, "{:.2f}"), _opt(r.bytes_per_token, "{:,}"),
                "-" if r.seal_us is None else
                f"{r.seal_us:.1f} ({r.seal_us * 1e-6 * r.tokens_per_s:.2%})",
                _opt(r.agreement, "{:.1%}"), _opt(r.max_logit_diff, "{:.3g}")] for r in rows],
              md, left=1) if rows else "not measured (the pipeline stage runtime fills this "
                                       "table; --stages 0 skips it)"))
    p(heading(f"(d) under load: {options.hogs} busy-loop processes beside the bench, decode "
              f"of 1 sequence, {top} thread(s) (quiet: from (a) and (b))") + "\n" + (
        _grid(["engine", "quiet tok/s", "loaded tok/s", "share kept"],
              [[r.engine, f"{r.quiet_tps:.1f}", f"{r.loaded_tps:.1f}", f"{r.share:.0%}"]
               for r in load], md, left=1) if load else "not measured (--hogs 0)")
      + ("" if held else f"\nthe hogs reached their deadline ({options.hog_deadline:g} s) "
                         "before the measurement ended: these rates are partly quiet"))
    targets = _targets(options, singles, anchors, load, held)
    p(heading("Targets (issue [7/11]; ratios within this run)") + "\n" + _grid(
        ["measure", "measured", "target", "met"],
        [[t.measure, t.measured, t.target,
          f"not measured ({t.why})" if t.met is None else "yes" if t.met else "NO"]
         for t in targets], md, left=1))
    p(f"\nload average at the end: {_load()}")
    return {"single": singles, "anchors": anchors, "pipeline": rows, "load": load,
            "targets": targets, "hog_pids": hog_pids}


def _measure_anchor(options: Options, threads: int, prompts: Sequence[Sequence[int]],
                    long_prompt: Sequence[int]) -> AnchorRow:
    """Table (b)'s row; llama.cpp's refusal (a model it cannot load) is
    the row's error, not the bench's end."""
    assert options.model is not None
    _say(f"llama.cpp, {threads} thread(s)")
    try:
        row = measure_llama_cpp(options.model, prompts, threads=threads,
                                decode_tokens=options.decode_tokens, repeats=options.repeats)
        if long_prompt:
            row = dataclasses.replace(row, prefill=llama_cpp_prefill(
                options.model, long_prompt, threads=threads, repeats=options.repeats))
    except (ValueError, RuntimeError) as exc:   # what llama-cpp-python raises
        return AnchorRow(threads=threads, error=f"failed: {exc}")
    return row


def _measure_load(options: Options, stage: Any, prompts: Sequence[Sequence[int]], threads: int,
                  singles: Sequence[SingleRow], anchors: Sequence[AnchorRow]
                  ) -> tuple[list[LoadRow], list[int], bool]:
    """Table (d): both engines' decode rate beside ``options.hogs`` busy loops,
    the hogs' pids, and whether every hog lasted to the end."""
    quiet = next(r for r in singles if r.threads == threads)
    anchor = next((a for a in anchors if a.threads == threads and not a.error), None)
    rows = []
    with cpu_hogs(options.hogs, deadline=options.hog_deadline) as pids:
        _say(f"under load ({options.hogs} hogs), pmetal, {threads} compute thread(s)")
        _use_threads(threads)
        rates = _decode(stage, prompts, decode_tokens=options.decode_tokens,
                        repeats=options.repeats)[2]
        stage.rest()
        rows.append(LoadRow("pmetal", threads, quiet.decode_tps, _median(rates)))
        if anchor is not None:
            assert options.model is not None
            _say(f"under load ({options.hogs} hogs), llama.cpp, {threads} thread(s)")
            loaded = measure_llama_cpp(options.model, prompts, threads=threads,
                                       decode_tokens=options.decode_tokens,
                                       repeats=options.repeats)
            rows.append(LoadRow("llama.cpp", threads, anchor.decode_tps, loaded.decode_tps))
        held = all(alive(pid) for pid in pids)   # False: a hog reached its deadline meanwhile
    return rows, pids, held


def _ms(seconds: float) -> str:
    """Milliseconds, '-' for a time not measured."""
    if not seconds:
        return "-"
    return f"{seconds * 1e3:.0f}" if seconds >= 1.0 else f"{seconds * 1e3:.1f}"


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _targets(options: Options, singles: Sequence[SingleRow], anchors: Sequence[AnchorRow],
             load: Sequence[LoadRow], held: bool) -> list[TargetRow]:
    """Issue [7/11]'s targets: pmetal against llama.cpp at the same thread
    counts, in this run. Without an anchor the rows show pmetal's figure
    and cannot be judged."""
    by_threads = {a.threads: a for a in anchors if not a.error}
    top = max(options.threads)
    rows = []

    def ratio(measure: str, ours: float, theirs: float | None, target: float,
              shown: Callable[[float], str]) -> TargetRow:
        if not theirs:
            return TargetRow(measure, shown(ours), f">= {target:g}x", None)
        value = ours / theirs
        return TargetRow(measure, f"{value:.2f}x ({shown(ours)} / {shown(theirs)})",
                         f">= {target:g}x", value >= target)

    for r in singles:
        a = by_threads.get(r.threads)
        rows.append(ratio(f"decode, 1 sequence, {r.threads} thread(s): x llama.cpp",
                          r.decode_tps, a and a.decode_tps, TARGET_DECODE,
                          lambda v: f"{v:.1f} tok/s"))
    r = next(s for s in singles if s.threads == top)
    a = by_threads.get(top)
    rows.append(ratio(f"aggregate, {r.batch} sequences batched, {top} thread(s): x llama.cpp "
                      "1 sequence", r.batch_tps, a and a.decode_tps, TARGET_BATCHED,
                      lambda v: f"{v:.1f} tok/s"))
    if options.prefill_tokens:
        for r in singles:
            a = by_threads.get(r.threads)
            # speed is 1 / time: pmetal's speed over llama.cpp's = llama.cpp's time over pmetal's
            rows.append(ratio(
                f"prefill of {options.prefill_tokens} tokens, {r.threads} thread(s): x "
                "llama.cpp's speed", 1.0 / r.long_prefill,
                1.0 / a.prefill if a and a.prefill else None, TARGET_PREFILL,
                lambda v: f"{_ms(1.0 / v)} ms"))
    if load:
        ours, theirs = load[0], next((x for x in load if x.engine == "llama.cpp"), None)
        measure = (f"under load ({options.hogs} hogs), decode, 1 sequence, {top} thread(s): "
                   "share of the quiet rate kept")
        rows.append(TargetRow(
            measure, f"{ours.share:.0%}" + (f" (llama.cpp {theirs.share:.0%})" if theirs else ""),
            ">= llama.cpp's share",
            None if theirs is None or not held else ours.share >= theirs.share,
            "no anchor" if theirs is None else "the hogs ended early"))
    return rows


def _header(options: Options, backend: str, described: str, prompt_note: str,
            lengths: list[int]) -> str:
    import pmetal
    from pmetal.bench.report import _load
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([
        (f"# pmetal bench pipeline, {now}: greedy decoding, pmetal's {backend} engine vs "
         "llama.cpp"),
        f"# command: {options.command}",
        (f"# pmetal {pmetal.__version__} ({os.path.dirname(pmetal.__file__)}), Python "
         f"{platform.python_version()}, {os.cpu_count()} CPUs, load average {_load()}"),
        f"# pmetal weights: {described}",
        (f"# prompts: {prompt_note}; lengths {lengths} tokens"
         + (f"; long prompt: {options.prefill_tokens} tokens" if options.prefill_tokens
            else "")),
        *(["# llama.cpp: AMX weight repacking off (its kernels crash on this CPU)"]
          if has_amx() and options.model and not llama_cpp_state(options.model)
          and options.anchors else []),
    ])
