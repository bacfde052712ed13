"""Table (c) of ``pmetal bench pipeline``: the model as a pipeline of
stage actors on this machine, over 127.0.0.1, every stage running the
engine of ``--backend`` (as table (a) does).

- **1 sequence**: each prompt alone, greedy, ``decode_tokens`` steps after
  the first token; tokens/s = steps / (time after the first token), median
  over prompts and repetitions.
- **N sequences**: ``batch`` prompts in flight at once (the multiplexer's
  lanes keep both stages busy); aggregate tokens/s = every token generated
  / the call's whole time, prefill included (conservative).
- **per-hop overhead**: the time per decode token the stages did not
  spend computing a decode step (their own clocks, prompts left out), over
  the ring's hops per token (stages + 1): sockets, encoding and decoding
  hops, the driver's bookkeeping.
- **bytes/token**: what stage 0 sent per token (header and activation).
- **sealing**: what sealing the ring's links (always on, AES-256-GCM,
  :mod:`pmetal.links.seal`) costs per decode token: the ring's stages + 1
  hops, each sealed by its sender and opened by its receiver as the links
  do it (two link messages: the hop's header, about 64 bytes, and its
  activation, the rest of bytes/token; each a sealed 28-byte link header
  and a sealed payload), timed in this process (:func:`seal_cost`, median
  of 7 runs of 500 hops); the share is of the decode step (1 / tok/s).
- **codecs**: the same prompts with fp16, bf16 and int8 activations
  against codec none: the fraction of greedy tokens equal position by
  position, and the largest logit difference while both runs still agreed
  on every earlier token (after a divergence the two continue different
  texts, so their logits are no longer comparable).

It needs a connected cluster (``pmetal.init``; the command line starts a
local one).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from pmetal.bench.pipeline import Options, PipelineRow

__all__ = ["measure_pipeline"]

CODECS = ("fp16", "bf16", "int8")


def seal_cost(hop_bytes: int, hops: int) -> float:
    """Microseconds per decode token that sealing ``hops`` hops of
    ``hop_bytes`` bytes costs, both ends (see the module docstring)."""
    from pmetal.links.seal import OVERHEAD, Direction, derive

    tx_key, _ = derive(b"k" * 32, b"t" * 32, 0, 1, b"n" * 31, b"\x01\x01")
    sizes = [64, max(hop_bytes - 64, 1)]
    head = bytes(28)
    payloads = [bytes(n) for n in sizes]
    opened = [bytearray(28), *(bytearray(n) for n in sizes)]
    runs = []
    for _ in range(7):
        tx, rx = Direction(tx_key), Direction(tx_key)
        began = time.perf_counter()
        for _ in range(500):
            for payload, out in zip(payloads, opened[1:], strict=True):
                frame = bytearray(28 + len(payload) + 2 * OVERHEAD)   # as post_sealed does
                view = memoryview(frame)
                tx.seal_into(head, view[:28 + OVERHEAD])
                tx.seal_into(payload, view[28 + OVERHEAD:])
                if not (rx.open_into(view[:28 + OVERHEAD], opened[0])
                        and rx.open_into(view[28 + OVERHEAD:], out)):
                    raise AssertionError("a sealed hop did not open")
        runs.append((time.perf_counter() - began) / 500)
    return statistics.median(runs) * hops * 1e6


def _build(options: Options, stages: int, codec: str, max_len: int) -> Any:
    """The pipeline, its stages running the engine of ``options.backend``."""
    from pmetal.bench.pipeline import random_config
    from pmetal.pipeline.pipeline import Pipeline

    if options.random_shape is not None:
        return Pipeline.from_pretrained(random_model=random_config(options.random_shape),
                                        stages=stages, codec=codec, max_len=max_len,
                                        backend=options.backend)
    return Pipeline.from_pretrained(options.model, stages=stages, codec=codec,
                                    max_len=max_len, backend=options.backend)


def measure_pipeline(options: Options, prompts: list[list[int]]) -> list[PipelineRow]:
    """Table (c)'s rows (see the module docstring)."""
    stages = int(options.extra.get("stages", 2))
    steps = options.decode_tokens
    max_len = max(len(p) for p in prompts) + steps + 4
    say = lambda text: print(f"pmetal bench pipeline: {text} ...", file=sys.stderr, flush=True)
    rows: list[PipelineRow] = []
    say(f"{stages} stages, codec none")
    with _build(options, stages, "none", max_len) as pipe:
        pipe.generate([prompts[0]], max_tokens=4, ignore_eos=True)       # warm: page in
        before = pipe.statistics()["stages"]
        rates = []
        for _ in range(options.repeats):
            for prompt in prompts:
                r = pipe.generate([prompt], max_tokens=steps + 1, ignore_eos=True)[0]
                rates.append(steps / (r.seconds - (r.time_to_first_token or 0.0)))
        after = pipe.statistics()["stages"]
        single = statistics.median(rates)
        compute = sum((a["decode_seconds"] - b["decode_seconds"])
                      / max(a["decode_steps"] - b["decode_steps"], 1)
                      for a, b in zip(after, before, strict=True))
        overhead = max(1.0 / single - compute, 0.0) / (stages + 1)
        rows_out = after[0]["bytes_out"] - before[0]["bytes_out"]
        tokens_in = sum(len(p) + steps for p in prompts) * options.repeats
        per_token = round(rows_out / tokens_in)
        rows.append(PipelineRow(f"{stages} stages, codec none, 1 sequence", single,
                                hop_overhead_ms=overhead * 1e3, bytes_per_token=per_token,
                                seal_us=seal_cost(per_token, stages + 1)))
        batch = [prompts[i % len(prompts)] for i in range(options.batch)]
        totals = []
        for _ in range(options.repeats):
            began = time.perf_counter()
            results = pipe.generate(batch, max_tokens=steps + 1, ignore_eos=True)
            totals.append(sum(len(r.tokens) for r in results)
                          / (time.perf_counter() - began))
        rows.append(PipelineRow(f"{stages} stages, codec none, {options.batch} sequences "
                                "(aggregate, prefill included)", statistics.median(totals)))
        reference = pipe.generate(prompts, max_tokens=steps, ignore_eos=True, logits=True)
    for codec in CODECS:
        say(f"{stages} stages, codec {codec}")
        with _build(options, stages, codec, max_len) as pipe:
            began = time.perf_counter()
            got = pipe.generate(prompts, max_tokens=steps, ignore_eos=True, logits=True)
            elapsed = time.perf_counter() - began
            stats = pipe.statistics()["stages"]
        equal, total, worst = _agreement(reference, got)
        rows.append(PipelineRow(
            f"{stages} stages, codec {codec}, {len(prompts)} sequences (logits returned)",
            sum(len(r.tokens) for r in got) / elapsed,
            bytes_per_token=round(stats[0]["bytes_out"] / sum(len(p) + steps - 1
                                                              for p in prompts)),
            agreement=equal / total, max_logit_diff=worst))
    return rows


def _agreement(reference: Sequence[Any], got: Sequence[Any]) -> tuple[int, int, float]:
    import numpy as np

    equal = total = 0
    worst = 0.0
    for ref, run in zip(reference, got, strict=True):
        same_prefix = True
        for i, (a, b) in enumerate(zip(ref.tokens, run.tokens, strict=False)):
            total += 1
            equal += a == b
            if same_prefix:
                worst = max(worst, float(np.max(np.abs(ref.logits[i] - run.logits[i]))))
                same_prefix = a == b
        total += abs(len(ref.tokens) - len(run.tokens))
    return equal, max(total, 1), worst
