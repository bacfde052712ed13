"""``pmetal bench pipeline``: how fast the Llama decoder of
:mod:`pmetal.pipeline` generates, on this machine, against llama.cpp on
the same model file.

Tables:

(a) **single process**, per compute thread count (1 and 2 by default;
    :func:`pmetal.pipeline.threads.set_compute_threads`: numpy's BLAS
    threads and the decoder's own workers):
    prefill time of the prompt (one forward of all its tokens), time to
    first token (prefill plus the LM head and the greedy choice), decode
    tokens/s of one sequence (greedy, one token per step), and aggregate
    tokens/s of ``batch`` sequences decoded together
    (:meth:`~pmetal.pipeline.llama.LlamaStage.forward_batch`, every
    sequence at its own position). Medians over ``repeats`` repetitions,
    each over every prompt.
(b) **llama.cpp**, the anchor, when ``llama_cpp`` (llama-cpp-python) is
    importable and the model is a GGUF file: the same prompts, greedy,
    ``n_threads`` 1 and 2, time to first token and decode tokens/s
    (streamed: decode = tokens after the first / time after the first).
    Labelled "not installed" otherwise; llama.cpp is never a dependency.
(c) **pipeline** rows (2 stages over loopback; codec agreement): measured
    by the function given as :attr:`Options.pipeline` (the stage runtime
    provides it); the table says "not measured" until then.

What is measured on our side: the weights the :data:`weights hook
<Options.weights>` returns (the model file once a loader is available,
else random weights of the model's shape: a float32 decoder's speed does
not depend on the values). Prompts are the chat prompts below, tokenized
by llama.cpp when it is installed (so both sides see the same lengths),
else fixed ids of typical length. Decoding never stops early: the timed
step count is fixed (llama.cpp: the end-of-sequence token is biased away).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from pmetal.errors import ConfigError

if TYPE_CHECKING:  # numpy only where it is used: 'pmetal --help' need not pay it
    from pmetal.pipeline.llama import LlamaStage, LlamaWeights

__all__ = ["AnchorRow", "Options", "PipelineRow", "SingleRow", "measure_llama_cpp",
           "measure_single_process", "run"]

PROMPTS = ("What is the capital of France?",
           "Write a haiku about the sea.",
           "Explain in one sentence what a CPU cache is.",
           "List three prime numbers.")
# SmolLM2-Instruct's chat template (ChatML), applied by hand until the
# tokenizer of pmetal.pipeline applies the model's own.
CHATML = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
FALLBACK_PROMPT_LEN = 30  # tokens of a short chat prompt, when no tokenizer is at hand
TARGET_SINGLE = 25.0      # tokens/s, the single-stream target for numpy
TARGET_PIPELINE_SINGLE = 0.85   # x the single-process rate: 2 stages, 1 sequence
TARGET_PIPELINE_MANY = 1.5      # x the single-process 1-sequence rate: 2 stages, 4 sequences


@dataclass(frozen=True)
class SingleRow:
    """One compute thread count of the single-process decoder; times in
    seconds, medians."""
    threads: int
    prefill: float
    first_token: float
    decode_tps: float
    batch: int
    batch_tps: float


@dataclass(frozen=True)
class AnchorRow:
    """llama.cpp with ``threads`` threads; ``error`` when it could not run."""
    threads: int
    first_token: float = 0.0
    decode_tps: float = 0.0
    error: str = ""


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


WeightsHook = Callable[[str | None], "tuple[LlamaWeights, str]"]
PipelineHook = Callable[["Options", list[list[int]]], list[PipelineRow]]


def random_weights(shape: str) -> WeightsHook:
    """A weights hook returning random weights of a known shape."""
    def load(model: str | None) -> tuple[LlamaWeights, str]:
        from pmetal.pipeline.llama import SMOLLM2_135M, LlamaConfig, LlamaWeights
        if shape == "tiny":
            config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=True)
        else:
            config = SMOLLM2_135M
        return (LlamaWeights.random(config, seed=0),
                f"random float32 weights of the {shape} shape"
                + (" (as fast as the real ones)" if shape != "tiny" else ""))
    return load


def default_model() -> str | None:
    """The default model's file when pmetal knows where it is."""
    try:
        from pmetal.pipeline.models import resolve_model  # type: ignore[import-not-found]
    except ImportError:  # the model registry is not there yet
        return None
    return str(resolve_model(None))


def default_weights(model: str | None) -> tuple[LlamaWeights, str]:
    """The model's weights when pmetal can load them, else random weights
    of the default model's shape. The loader plugs in here."""
    try:
        from pmetal.pipeline.loader import (  # type: ignore[import-not-found]
            load_config,
            load_weights,
        )
    except ImportError:  # no loader yet: the shape is what sets the speed
        return random_weights("smollm2-135m")(model)
    path = model if model is not None else default_model()
    config = load_config(path)
    return (load_weights(path, 0, config.num_hidden_layers),
            f"{path}, dequantized to float32")


@dataclass(frozen=True)
class Options:
    model: str | None = None            # a GGUF file for llama.cpp (and the loader)
    prompts: tuple[str, ...] = PROMPTS
    decode_tokens: int = 32             # timed decode steps per sequence
    repeats: int = 3
    batch: int = 4
    threads: tuple[int, ...] = (1, 2)   # compute threads for table (a)
    anchor_threads: tuple[int, ...] = (1, 2)
    anchors: bool = True
    markdown: bool = False
    command: str = "pmetal bench pipeline"
    weights: WeightsHook = default_weights
    pipeline: PipelineHook | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.decode_tokens < 2 or self.repeats < 1 or self.batch < 1 or not self.prompts:
            raise ConfigError(
                f"--tokens {self.decode_tokens}, --repeats {self.repeats}, --batch "
                f"{self.batch}: need at least 2 tokens, 1 repetition, 1 sequence and a prompt")
        if not self.threads or min(self.threads) < 1:
            raise ConfigError(f"--threads {self.threads}: thread counts are positive integers")


# ------------------------------------------------------------ our decoder

def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def measure_single_process(stage: LlamaStage, prompts: Sequence[Sequence[int]], *,
                           decode_tokens: int, repeats: int, batch: int,
                           threads: int) -> SingleRow:
    """Table (a)'s row for one compute thread count (set here, for this process)."""
    import numpy as np

    from pmetal.pipeline.threads import set_compute_threads
    set_compute_threads(threads)
    longest = max(len(p) for p in prompts) + decode_tokens + 2
    prefills, firsts, singles, batched = [], [], [], []
    # one untimed pass first: page in the weights, start the worker threads
    warm = stage.new_cache(longest)
    stage.logits(stage.forward(stage.embed(prompts[0]), warm))
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
            singles.append(decode_tokens / (time.perf_counter() - first))
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
                     decode_tps=_median(singles), batch=batch, batch_tps=_median(batched))


# ------------------------------------------------------------ llama.cpp

def _llama_cpp_state(model: str | None) -> str:
    """Why the anchor cannot run, or '' when it can."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "not installed (pip install llama-cpp-python)"
    if model is None or not model.endswith(".gguf") or not os.path.isfile(model):
        return f"no GGUF model file ({model or 'give --model PATH.gguf'})"
    return ""


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read()
    except OSError:
        return False


@contextlib.contextmanager
def _without_extra_buffer_types() -> Iterator[None]:
    """llama.cpp built for a CPU with AMX (GGML_NATIVE) repacks the weights
    for its AMX kernels, which crash in llama_decode (SIGSEGV in
    ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36 on a Sapphire Rapids
    VM). llama-cpp-python does not expose llama.cpp's switch
    (``use_extra_bufts``), so the model parameters it starts from are
    patched while the model loads."""
    import llama_cpp.llama_cpp as api
    original = api.llama_model_default_params

    def defaults() -> Any:
        params = original()
        params.use_extra_bufts = False
        return params

    api.llama_model_default_params = defaults
    try:
        yield
    finally:
        api.llama_model_default_params = original


def _load_llama(model: str, threads: int, **kwargs: Any) -> Any:
    from llama_cpp import Llama
    guard = _without_extra_buffer_types() if _has_amx() else contextlib.nullcontext()
    with guard:
        return Llama(model_path=model, n_ctx=512, n_threads=threads, n_threads_batch=threads,
                     verbose=False, **kwargs)


def measure_llama_cpp(model: str, prompts: Sequence[str], *, threads: int,
                      decode_tokens: int, repeats: int) -> AnchorRow:
    """Greedy generation of ``decode_tokens + 1`` tokens per prompt with
    llama-cpp-python on ``threads`` threads."""
    llm = _load_llama(model, threads, seed=0)
    try:
        eos = llm.token_eos()
        firsts, rates = [], []
        llm.reset()
        llm.create_completion(prompts[0], max_tokens=2, temperature=0.0)  # warm-up
        for _ in range(repeats):
            for prompt in prompts:
                llm.reset()  # no prompt reuse between repetitions: prefill every time
                began = time.perf_counter()
                first = None
                count = 0
                for _chunk in llm.create_completion(
                        prompt, max_tokens=decode_tokens + 1, temperature=0.0, top_k=1,
                        stream=True, logit_bias={eos: -1e9}):
                    count += 1
                    if first is None:
                        first = time.perf_counter()
                end = time.perf_counter()
                if first is None or count < 2:
                    continue
                firsts.append(first - began)
                rates.append((count - 1) / (end - first))
        if not rates:
            return AnchorRow(threads=threads, error="generated fewer than 2 tokens")
        return AnchorRow(threads=threads, first_token=_median(firsts),
                         decode_tps=_median(rates))
    finally:
        llm.close()


def _tokenized(model: str | None, prompts: Sequence[str], vocab: int) -> tuple[list[list[int]], str]:
    """Token ids of the chat prompts: llama.cpp's tokenizer of the model
    when it can load it, else fixed ids of a typical length."""
    if not _llama_cpp_state(model) and model is not None:
        llm = _load_llama(model, 1, vocab_only=True)
        try:
            ids = [llm.tokenize(CHATML.format(prompt=p).encode(), add_bos=False, special=True)
                   for p in prompts]
        finally:
            llm.close()
        if all(max(p) < vocab for p in ids):
            return ids, "chat prompts tokenized by llama.cpp"
    ids = [[(7 + 31 * i + 997 * j) % vocab for i in range(FALLBACK_PROMPT_LEN)]
           for j in range(len(prompts))]
    return ids, f"{FALLBACK_PROMPT_LEN} fixed token ids per prompt (no tokenizer at hand)"


# ------------------------------------------------------------ report

def run(options: Options, out: TextIO | None = None) -> dict[str, Any]:
    """Measure and print tables (a), (b), (c) on ``out`` (default: standard
    output); returns the rows."""
    from pmetal.bench.report import _grid, _load
    from pmetal.pipeline.llama import LlamaStage
    from pmetal.pipeline.threads import compute_threads, set_compute_threads

    stream = sys.stdout if out is None else out
    p = lambda *a: print(*a, file=stream, flush=True)
    weights, described = options.weights(options.model)
    prompts, prompt_note = _tokenized(options.model, options.prompts,
                                      weights.config.vocab_size)
    p(_header(options, described, prompt_note, [len(x) for x in prompts]))
    stage = LlamaStage(weights, max_threads=max(options.threads))
    del weights
    before = compute_threads()
    singles = []
    try:
        for threads in options.threads:
            print(f"pmetal bench pipeline: single process, {threads} compute thread(s) ...",
                  file=sys.stderr, flush=True)
            singles.append(measure_single_process(
                stage, prompts, decode_tokens=options.decode_tokens, repeats=options.repeats,
                batch=options.batch, threads=threads))
    finally:
        stage.close()
        if before is not None:
            set_compute_threads(before)
    md = options.markdown
    heading = (lambda t: f"\n### {t}\n") if md else (lambda t: f"\n# {t}")
    p(heading(f"(a) single process, numpy: medians of {options.repeats} repetitions x "
              f"{len(prompts)} prompts, {options.decode_tokens} decode steps")
      + "\n" + _grid(["threads", "prefill (ms)", "first token (ms)",
                      "decode tok/s, 1 sequence", f"aggregate tok/s, {options.batch} batched"],
                     [[str(r.threads), f"{r.prefill * 1e3:.1f}", f"{r.first_token * 1e3:.1f}",
                       f"{r.decode_tps:.1f}", f"{r.batch_tps:.1f}"] for r in singles], md))

    anchors: list[AnchorRow] = []
    state = _llama_cpp_state(options.model) if options.anchors else "not run (--anchors off)"
    if not state:
        for threads in options.anchor_threads:
            print(f"pmetal bench pipeline: llama.cpp, {threads} thread(s) ...",
                  file=sys.stderr, flush=True)
            anchors.append(measure_llama_cpp(
                options.model, [CHATML.format(prompt=x) for x in options.prompts],  # type: ignore[arg-type]
                threads=threads, decode_tokens=options.decode_tokens,
                repeats=options.repeats))
    p(heading("(b) llama.cpp (llama-cpp-python) on the same GGUF, greedy, same prompts")
      + "\n" + (_grid(["threads", "first token (ms)", "decode tok/s, 1 sequence"],
                      [[str(a.threads), f"{a.first_token * 1e3:.1f}" if not a.error else "-",
                        f"{a.decode_tps:.1f}" if not a.error else a.error] for a in anchors], md)
                if anchors else f"llama.cpp: {state}"))

    rows: list[PipelineRow] = []
    if options.pipeline is not None:
        rows = options.pipeline(options, prompts)
        best = max(r.decode_tps for r in singles)
        rows = [r if r.vs_single is not None else dataclasses.replace(
            r, vs_single=r.tokens_per_s / best) for r in rows]
    p(heading("(c) pipeline of stage actors over 127.0.0.1 (x single process: against the "
              "best 1-sequence rate of (a))") + "\n" + (
        _grid(["run", "tok/s", "vs single process", "per-hop overhead (ms/token)",
               "bytes/token", "greedy tokens = codec none", "largest logit diff"],
              [[r.label, f"{r.tokens_per_s:.1f}", _opt(r.vs_single, "{:.2f}x"),
                _opt(r.hop_overhead_ms, "{:.2f}"), _opt(r.bytes_per_token, "{:,}"),
                _opt(r.agreement, "{:.1%}"), _opt(r.max_logit_diff, "{:.3g}")] for r in rows],
              md, left=1) if rows else "not measured (the pipeline stage runtime fills this "
                                       "table; --stages 0 skips it)"))
    p(heading("Targets") + "\n" + _targets(singles, anchors, rows, md))
    p(f"\nload average at the end: {_load()}")
    return {"single": singles, "anchors": anchors, "pipeline": rows}


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _targets(singles: Sequence[SingleRow], anchors: Sequence[AnchorRow],
             pipeline: Sequence[PipelineRow], md: bool) -> str:
    from pmetal.bench.report import _grid
    best_single = max(singles, key=lambda r: r.decode_tps)
    best_batch = max(singles, key=lambda r: r.batch_tps)
    two = next((a for a in anchors if a.threads == 2 and not a.error), None)
    rows = [["numpy decode, 1 sequence (tok/s)",
             f"{best_single.decode_tps:.1f} ({best_single.threads} thr)", f">= {TARGET_SINGLE:g}",
             "yes" if best_single.decode_tps >= TARGET_SINGLE else "NO"]]
    if two is None:
        rows.append([f"numpy aggregate, {best_batch.batch} sequences (tok/s)",
                     f"{best_batch.batch_tps:.1f} ({best_batch.threads} thr)",
                     ">= llama.cpp 2 threads, 1 sequence", "not measured (no anchor)"])
    else:
        rows.append([f"numpy aggregate, {best_batch.batch} sequences (tok/s)",
                     f"{best_batch.batch_tps:.1f} ({best_batch.threads} thr)",
                     f">= {two.decode_tps:.1f} (llama.cpp 2 threads, this run)",
                     "yes" if best_batch.batch_tps >= two.decode_tps else "NO"])
    for row in pipeline[:2]:
        target = TARGET_PIPELINE_SINGLE if " 1 sequence" in row.label else TARGET_PIPELINE_MANY
        rows.append([f"pipeline: {row.label} (x single process)",
                     f"{row.vs_single:.2f}x ({row.tokens_per_s:.1f} tok/s)",
                     f">= {target:g}x", "yes" if (row.vs_single or 0) >= target else "NO"])
    return _grid(["measure", "pmetal", "target", "met"], rows, md, left=1)


def _header(options: Options, described: str, prompt_note: str, lengths: list[int]) -> str:
    import pmetal
    from pmetal.bench.report import _load
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([
        f"# pmetal bench pipeline, {now}: greedy decoding, float32 numpy vs llama.cpp",
        f"# command: {options.command}",
        (f"# pmetal {pmetal.__version__} ({os.path.dirname(pmetal.__file__)}), Python "
         f"{platform.python_version()}, {os.cpu_count()} CPUs, load average {_load()}"),
        f"# pmetal weights: {described}",
        f"# prompts: {prompt_note}; lengths {lengths} tokens",
        *(["# llama.cpp: AMX weight repacking off (its kernels crash on this CPU)"]
          if _has_amx() and not _llama_cpp_state(options.model) and options.anchors else []),
    ])
