"""``pmetal bench agreement``: do pmetal's engines and llama.cpp choose the
same greedy tokens? (Issue [7/11], item 4.)

Each prompt is a raw text, turned into token ids by the model's own
tokenizer (:meth:`pmetal.pipeline.tokenizer.Tokenizer.encode_prompt`: the
chat template when the model has one); every engine continues the same ids
greedily for ``tokens`` steps, never stopping at the end-of-sequence token:

- **quantized**: :mod:`pmetal.model.quantized`, the GGUF blocks as they are,
  activations rounded to 8 bits inside the products (as llama.cpp does);
- **reference**: the float32 decoder (:mod:`pmetal.pipeline.llama`), the
  weights dequantized at load, activations float32;
- **llama.cpp**, when llama-cpp-python is installed: its own greedy tokens
  (:func:`pmetal.bench.anchor.llama_cpp_greedy`).

For each pair and prompt the table shows how many leading tokens agree,
the gap between the best two logits at the first disagreement (the smaller
of the two engines' gaps: both saw the same tokens until then, so a small
gap says the two only resolved a near-tie differently), and the fraction of
positions holding equal tokens (after a divergence the texts differ, so
later equalities are partly chance).

Greedy agreement over a few prompts turns on a handful of near-ties, so a
second table compares the engines' logits where every engine has seen the
same ids (the first generated position of each prompt): the mean of the
difference (a shift of every logit changes no choice), its standard
deviation around that mean (what reorders near-ties) and the largest
difference.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from pmetal.bench.anchor import llama_cpp_greedy, llama_cpp_state, top_gap
from pmetal.errors import ConfigError

__all__ = ["PROMPTS", "Agreement", "Continuation", "LogitDifference", "Options", "PromptRow",
           "compare", "greedy", "logit_difference", "run"]

PROMPTS = ("What is the capital of France?",
           "Write a haiku about the sea.",
           "Explain in one sentence what a CPU cache is.",
           "List three prime numbers.",
           "Give me a short recipe for pancakes.",
           "Who wrote Romeo and Juliet?",
           "Why is the sky blue?",
           "Translate 'good morning' into Spanish.")
ENGINES = ("quantized", "reference", "llama.cpp")
PAIRS = (("quantized", "reference"), ("quantized", "llama.cpp"), ("reference", "llama.cpp"))


@dataclass(frozen=True)
class Options:
    model: str
    prompts: tuple[str, ...] = PROMPTS
    tokens: int = 32
    anchors: bool = True
    markdown: bool = False
    command: str = "pmetal bench agreement"

    def __post_init__(self) -> None:
        if self.tokens < 1 or not self.prompts:
            raise ConfigError(f"--tokens {self.tokens}, {len(self.prompts)} prompts: need at "
                              "least 1 token and 1 prompt")


@dataclass(frozen=True)
class Continuation:
    """One engine's greedy tokens, at each step the gap between its best
    two logits, and the logits of the first step (float32; None when not
    kept)."""
    tokens: tuple[int, ...]
    gaps: tuple[float, ...]
    first_logits: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class LogitDifference:
    """Two engines' first-position logits, ``a - b``, over every prompt:
    the mean of the per-prompt means and standard deviations, the largest
    absolute difference."""
    mean: float
    std: float
    largest: float


@dataclass(frozen=True)
class Agreement:
    """Two continuations of one prompt compared position by position."""
    leading: int           # tokens equal before the first difference
    equal: int             # positions with equal tokens
    total: int
    gap: float | None      # the smaller top-2 gap at the first difference (None: no difference)


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    prompt_tokens: int
    pairs: dict[tuple[str, str], Agreement]


def greedy(stage: Any, ids: Sequence[int], tokens: int) -> Continuation:
    """``tokens`` greedy tokens of a pmetal stage holding the whole model."""
    cache = stage.new_cache(len(ids) + tokens + 1)
    logits = stage.logits(stage.forward(stage.embed(ids), cache)[-1:])[0]
    first = logits.copy()
    got: list[int] = []
    gaps: list[float] = []
    while True:
        got.append(int(logits.argmax()))
        gaps.append(top_gap(logits))
        if len(got) == tokens:
            return Continuation(tuple(got), tuple(gaps), first)
        logits = stage.logits(stage.forward(stage.embed([got[-1]]), cache))[0]


def compare(a: Continuation, b: Continuation) -> Agreement:
    equal = [x == y for x, y in zip(a.tokens, b.tokens, strict=True)]
    leading = equal.index(False) if False in equal else len(equal)
    gap = None if leading == len(equal) else min(a.gaps[leading], b.gaps[leading])
    return Agreement(leading, sum(equal), len(equal), gap)


def logit_difference(a: Sequence[Continuation], b: Sequence[Continuation]) -> LogitDifference:
    """``a - b`` of the first-position logits, prompt by prompt (see the
    module docstring)."""
    import numpy as np

    diffs = [np.asarray(x.first_logits, dtype=np.float64) - np.asarray(y.first_logits)
             for x, y in zip(a, b, strict=True)]
    return LogitDifference(mean=float(np.mean([d.mean() for d in diffs])),
                           std=float(np.mean([d.std() for d in diffs])),
                           largest=float(max(np.abs(d).max() for d in diffs)))


def _say(text: str) -> None:
    print(f"pmetal bench agreement: {text} ...", file=sys.stderr, flush=True)


def run(options: Options, out: TextIO | None = None) -> dict[str, Any]:
    """Generate with every engine, print the table and totals on ``out``
    (default: standard output); returns the rows and the continuations."""
    from pmetal.bench.pipeline import build_engine
    from pmetal.pipeline.tokenizer import Tokenizer

    stream = sys.stdout if out is None else out
    p = lambda *a: print(*a, file=stream, flush=True)
    tokenizer = Tokenizer.from_model(options.model)
    ids = [tokenizer.encode_prompt(text) for text in options.prompts]
    runs: dict[str, list[Continuation]] = {}
    for backend in ("quantized", "reference"):
        _say(f"{backend} engine")
        stage, *_ = build_engine(options.model, backend)
        try:
            runs[backend] = [greedy(stage, prompt, options.tokens) for prompt in ids]
        finally:
            stage.close()
    anchor = llama_cpp_state(options.model) if options.anchors else "not run (--anchors off)"
    if not anchor:
        _say("llama.cpp")
        runs["llama.cpp"] = [Continuation(tuple(t), tuple(g), first) for t, g, first in
                             llama_cpp_greedy(options.model, ids, tokens=options.tokens)]
    pairs = [pair for pair in PAIRS if all(engine in runs for engine in pair)]
    rows = [PromptRow(text, len(prompt), {pair: compare(runs[pair[0]][i], runs[pair[1]][i])
                                          for pair in pairs})
            for i, (text, prompt) in enumerate(zip(options.prompts, ids, strict=True))]
    logits = {pair: logit_difference(runs[pair[0]], runs[pair[1]]) for pair in pairs}
    p(_report(options, rows, pairs, anchor, logits))
    return {"rows": rows, "runs": runs, "ids": ids, "logits": logits}


def _report(options: Options, rows: Sequence[PromptRow], pairs: Sequence[tuple[str, str]],
            anchor: str, logits: dict[tuple[str, str], LogitDifference]) -> str:
    from pmetal.bench.report import _grid

    md = options.markdown
    heading = (lambda t: f"\n### {t}\n") if md else (lambda t: f"\n# {t}")
    header = ["prompt", "ids", *(f"{a} = {b}" for a, b in pairs)]
    body = [[_short(row.prompt), str(row.prompt_tokens),
             *(_cell(row.pairs[pair]) for pair in pairs)] for row in rows]
    totals = ["total", str(sum(r.prompt_tokens for r in rows))]
    for pair in pairs:
        results = [r.pairs[pair] for r in rows]
        whole = sum(a.leading == a.total for a in results)
        totals.append(f"{whole}/{len(results)} whole, mean leading "
                      f"{statistics.mean(a.leading for a in results):.1f}, "
                      f"{sum(a.equal for a in results) / sum(a.total for a in results):.1%}")
    return "\n".join([
        (f"# pmetal bench agreement: {len(rows)} prompts x {options.tokens} greedy tokens, "
         f"{options.model}"),
        f"# command: {options.command}",
        f"# llama.cpp: {anchor or 'llama-cpp-python, the same prompt ids'}",
        heading("Greedy agreement, prompt by prompt: leading tokens equal (gap: the smaller "
                "best-minus-second logit at the first difference), positions equal"),
        _grid(header, [*body, totals], md, left=1),
        heading("Logits at the first generated position (the same ids for every engine), "
                f"a - b, over the {len(rows)} prompts"),
        _grid(["a - b", "mean", "std around the mean", "largest abs difference"],
              [[f"{a} - {b}", f"{logits[a, b].mean:+.3f}", f"{logits[a, b].std:.3f}",
                f"{logits[a, b].largest:.3f}"] for a, b in pairs], md, left=1)])


def _cell(agreement: Agreement) -> str:
    gap = "all" if agreement.gap is None else f"gap {agreement.gap:.2g}"
    return f"{agreement.leading} ({gap}), {agreement.equal / agreement.total:.0%}"


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."
