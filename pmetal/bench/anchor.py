"""llama.cpp, the anchor of ``pmetal bench pipeline`` and ``pmetal bench
agreement``: llama-cpp-python on the same GGUF file, when it is installed.
It is never a dependency: :func:`llama_cpp_state` says why it cannot run,
and the benches print that instead of its rows.

Measured here, each with its own ``Llama`` on ``threads`` threads (prompt
and generation alike):

- :func:`measure_llama_cpp`: greedy generation from the same token ids as
  pmetal's, time to first token and decode tokens/s of one sequence.
- :func:`llama_cpp_prefill`: the time ``Llama.eval`` takes for a list of
  ids after a reset (the KV cache emptied), median of repeats.
- :func:`llama_cpp_greedy`: llama.cpp's own greedy tokens for a list of
  ids: ``eval`` then the argmax of its logits, step by step (with each
  step's gap between the best two logits).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["AnchorRow", "has_amx", "llama_cpp_greedy", "llama_cpp_prefill",
           "llama_cpp_state", "load_llama", "measure_llama_cpp", "top_gap"]


@dataclass(frozen=True)
class AnchorRow:
    """llama.cpp with ``threads`` threads; ``error`` when it could not run.
    ``prefill`` is the time for the long prompt (0.0: not measured)."""
    threads: int
    first_token: float = 0.0
    decode_tps: float = 0.0
    prefill: float = 0.0
    error: str = ""


def llama_cpp_state(model: str | None) -> str:
    """Why the anchor cannot run, or '' when it can."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "not installed (pip install llama-cpp-python)"
    if model is None or not model.endswith(".gguf") or not os.path.isfile(model):
        return f"no GGUF model file ({model or 'give --model PATH.gguf'})"
    return ""


def has_amx() -> bool:
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


def load_llama(model: str, threads: int, *, n_ctx: int = 512, **kwargs: Any) -> Any:
    """A ``Llama`` on ``threads`` threads for prompts and generation alike;
    a batch as long as the context, so that a prompt is one ``decode``."""
    from llama_cpp import Llama
    guard = _without_extra_buffer_types() if has_amx() else contextlib.nullcontext()
    with guard:
        return Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                     n_threads=threads, n_threads_batch=threads, verbose=False, **kwargs)


def measure_llama_cpp(model: str, prompts: Sequence[Sequence[int]], *, threads: int,
                      decode_tokens: int, repeats: int) -> AnchorRow:
    """Greedy generation of ``decode_tokens + 1`` tokens from each prompt
    (token ids) with llama.cpp's own sampler (``Llama.generate``,
    temperature 0) on ``threads`` threads: time to first token and decode
    tokens/s (tokens after the first / time after the first), medians.
    Token ids, not text: no detokenizing in the timing, and no early stop
    at the end-of-sequence token."""
    llm = load_llama(model, threads, n_ctx=_context(max(len(p) for p in prompts)
                                                    + decode_tokens + 2), seed=0)
    try:
        firsts, rates = [], []
        for repeat in range(repeats + 1):   # the first pass is a warm-up
            for prompt in prompts if repeat else prompts[:1]:
                llm.reset()  # no prompt reuse between repetitions: prefill every time
                began = time.perf_counter()
                first = 0.0
                for count, _token in enumerate(
                        llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0), 1):
                    if count == 1:
                        first = time.perf_counter()
                    if count == decode_tokens + 1:
                        break
                if repeat:
                    rates.append(decode_tokens / (time.perf_counter() - first))
                    firsts.append(first - began)
        return AnchorRow(threads=threads, first_token=statistics.median(firsts),
                         decode_tps=statistics.median(rates))
    finally:
        llm.close()


def llama_cpp_prefill(model: str, ids: Sequence[int], *, threads: int, repeats: int) -> float:
    """Median seconds of ``Llama.eval(ids)`` from an empty KV cache, after
    one untimed run."""
    llm = load_llama(model, threads, n_ctx=_context(len(ids)))
    try:
        times = []
        for repeat in range(repeats + 1):
            llm.reset()
            began = time.perf_counter()
            llm.eval(list(ids))
            if repeat:
                times.append(time.perf_counter() - began)
        return statistics.median(times)
    finally:
        llm.close()


def llama_cpp_greedy(model: str, prompts: Sequence[Sequence[int]], *, tokens: int,
                     threads: int = 1) -> list[tuple[list[int], list[float], Any]]:
    """llama.cpp's greedy continuation of each prompt (token ids), ``tokens``
    long: the argmax of its own logits after each ``eval``, the gap between
    its best and second-best logit at each step, and the logits of the first
    step (float32). Never stops at the end-of-sequence token (neither do the
    engines it is compared with)."""
    import numpy as np

    longest = max(len(p) for p in prompts) + tokens
    llm = load_llama(model, threads, n_ctx=_context(longest), logits_all=True)
    try:
        out = []
        for prompt in prompts:
            llm.reset()
            llm.eval(list(prompt))
            got: list[int] = []
            gaps: list[float] = []
            first = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            while True:
                logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
                got.append(int(np.argmax(logits)))
                gaps.append(top_gap(logits))
                if len(got) == tokens:
                    break
                llm.eval([got[-1]])
            out.append((got, gaps, first))
        return out
    finally:
        llm.close()


def top_gap(logits: Any) -> float:
    """The best logit minus the second best: how near a greedy choice was a tie."""
    import numpy as np

    top2 = np.partition(np.asarray(logits, dtype=np.float32).ravel(), -2)[-2:]
    return float(top2[1] - top2[0])


def _context(tokens: int) -> int:
    """A context for ``tokens`` tokens: a multiple of 256, at least 512."""
    return max(512, -(-tokens // 256) * 256)
