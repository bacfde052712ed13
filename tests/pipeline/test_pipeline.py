"""Pipelines of real stage actors (worker processes joined by TCP links on
loopback) against the same model generated in this process."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

import pmetal
from pmetal.errors import (
    ConfigError,
    PipelineError,
    PlacementError,
    PMetalTypeError,
    PMetalValueError,
)
from pmetal.pipeline.generation import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    generate_single_process,
)
from pmetal.model.quantized import QuantizedStage, QuantizedWeights
from pmetal.pipeline.llama import LlamaConfig, LlamaStage, LlamaWeights
from pmetal.pipeline.pipeline import Pipeline, place_stages
from pmetal.pipeline.sampling import SamplingConfig
from pmetal.pipeline.stage import PipelineStage

TINY = LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9] * 12, [42, 43], [100], [7, 7, 8, 9, 10, 11]]
MAX_LEN = 96


@pytest.fixture(scope="module")
def reference() -> LlamaStage:
    return LlamaStage(LlamaWeights.random(TINY, seed=3))


def build(stages: int, **options: Any) -> Pipeline:
    return Pipeline.from_pretrained(random_model=TINY, seed=3, stages=stages, max_len=MAX_LEN,
                                    threads=1, **options)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_greedy_output_equals_one_process(cluster: Any, reference: LlamaStage,
                                          stages: int) -> None:
    expected = generate_single_process(reference, PROMPTS, SamplingConfig(max_tokens=24),
                                       max_len=MAX_LEN)
    with build(stages) as pipe:
        assert pipe.placements[0].start == 0
        assert pipe.placements[-1].end == TINY.num_hidden_layers
        # All prompts in flight at once (batched decode in every stage) ...
        together = pipe.generate(PROMPTS, max_tokens=24)
        # ... and one at a time.
        alone = [pipe.generate([p], max_tokens=24)[0] for p in PROMPTS[:2]]
        stats = pipe.statistics()
    assert [r.tokens for r in together] == [r.tokens for r in expected]
    assert [r.tokens for r in alone] == [r.tokens for r in expected[:2]]
    assert all(r.finish_reason == FINISH_LENGTH and len(r.tokens) == 24 for r in together)
    # Every stage worked on every step, and they are different processes.
    assert len({s["pid"] for s in stats["stages"]}) == stages
    assert all(s["steps"] > 0 and s["failure"] is None for s in stats["stages"])


@pytest.mark.parametrize("stages", [1, 3])
def test_quantized_stages_equal_one_quantized_process(cluster: Any, stages: int) -> None:
    """The quantized engine's pipeline gives its own single process's tokens
    exactly (a random model is quantized to Q8_0 blocks at load)."""
    engine = QuantizedStage(QuantizedWeights.from_float(LlamaWeights.random(TINY, seed=3)))
    expected = generate_single_process(engine, PROMPTS, SamplingConfig(max_tokens=16),
                                       max_len=MAX_LEN)
    with build(stages, backend="quantized") as pipe:
        together = pipe.generate(PROMPTS, max_tokens=16)
    assert [r.tokens for r in together] == [r.tokens for r in expected]


def test_seeded_sampling_equals_one_process(cluster: Any, reference: LlamaStage) -> None:
    sampling = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, seed=11, max_tokens=16)
    expected = generate_single_process(reference, PROMPTS[:3], sampling, max_len=MAX_LEN)
    with build(2) as pipe:
        got = pipe.generate(PROMPTS[:3], max_tokens=16, temperature=0.9, top_k=20, top_p=0.9,
                            seed=11)
    assert [r.tokens for r in got] == [r.tokens for r in expected]


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
def test_lossy_codecs_run_and_mostly_agree(cluster: Any, reference: LlamaStage,
                                           codec: str) -> None:
    with build(2, codec=codec) as pipe:
        got = pipe.generate(PROMPTS[:3], max_tokens=12, logits=True)
        stats = pipe.statistics()
    expected = generate_single_process(reference, PROMPTS[:3], SamplingConfig(max_tokens=12),
                                       max_len=MAX_LEN, want_logits=True)
    # The first token depends on the prompt only: its logits are close.
    for r, e in zip(got, expected, strict=True):
        assert r.logits is not None and e.logits is not None
        assert np.max(np.abs(r.logits[0] - e.logits[0])) < 0.5
    # The activations crossed as the codec's wire type: fewer bytes than float32.
    hidden_bytes = {"fp16": 2, "bf16": 2, "int8": 1}[codec]
    rows = sum(len(p) + 11 for p in PROMPTS[:3])
    assert stats["stages"][0]["bytes_out"] < rows * TINY.hidden_size * 4
    assert stats["stages"][0]["bytes_out"] >= rows * TINY.hidden_size * hidden_bytes


def test_stop_tokens_end_one_sequence_only(cluster: Any, reference: LlamaStage) -> None:
    free = generate_single_process(reference, PROMPTS[:2], SamplingConfig(max_tokens=20),
                                   max_len=MAX_LEN)
    stop = free[0].tokens[5]
    with build(2) as pipe:
        got = pipe.generate(PROMPTS[:2], max_tokens=20, stop_token_ids=[stop])
    first = free[0].tokens.index(stop)
    assert got[0].tokens == free[0].tokens[:first + 1]
    assert got[0].finish_reason == FINISH_STOP
    if stop in free[1].tokens:
        assert got[1].finish_reason == FINISH_STOP
    else:
        assert got[1].tokens == free[1].tokens


def test_context_limit_ends_a_sequence(cluster: Any) -> None:
    with build(2) as pipe:
        got = pipe.generate([[1] * (MAX_LEN - 3)], max_tokens=50)
    # The prompt fills MAX_LEN - 3 positions: 3 more tokens fit, the last one
    # sampled without being fed back.
    assert got[0].finish_reason == FINISH_LENGTH and len(got[0].tokens) == 4


def test_cancel_one_sequence_leaves_the_others(cluster: Any, reference: LlamaStage) -> None:
    expected = generate_single_process(reference, PROMPTS[:3], SamplingConfig(max_tokens=60),
                                       max_len=MAX_LEN)
    seen: dict[int, int] = {}
    cancelled = threading.Event()
    with build(2) as pipe:

        def on_token(index: int, token: int) -> None:
            seen[index] = seen.get(index, 0) + 1
            if index == 1 and seen[index] == 3 and not cancelled.is_set():
                # From the loop's own thread: it takes effect at the next step.
                assert pipe.cancel(1)
                cancelled.set()

        got = pipe.generate(PROMPTS[:3], max_tokens=60, on_token=on_token)
        again = pipe.generate(PROMPTS[:1], max_tokens=5)
        stats = pipe.statistics()
    assert got[1].finish_reason == FINISH_CANCELLED and 3 <= len(got[1].tokens) < 60
    assert got[1].tokens == expected[1].tokens[:len(got[1].tokens)]
    assert [got[0].tokens, got[2].tokens] == [expected[0].tokens, expected[2].tokens]
    assert again[0].tokens == expected[0].tokens[:5]
    # The stages dropped every sequence's state, the cancelled one's too.
    assert all(s["in_flight"] == 0 for s in stats["stages"])


def test_bad_prompts_are_refused_before_anything_runs(cluster: Any) -> None:
    with build(2) as pipe:
        with pytest.raises(PMetalValueError, match="outside the vocabulary"):
            pipe.generate([[1, TINY.vocab_size]])
        with pytest.raises(PMetalValueError, match="no room"):
            pipe.generate([[1] * MAX_LEN])
        with pytest.raises(PMetalValueError, match="no tokenizer"):
            pipe.generate("hello")
        assert pipe.generate([[1, 2]], max_tokens=2)[0].tokens


def test_a_killed_stage_fails_its_sequences_fast(cluster: Any) -> None:
    pipe = build(3, step_timeout=20.0)
    try:
        pids = [s["pid"] for s in pipe.statistics()["stages"]]
        killed = threading.Event()

        def on_token(index: int, token: int) -> None:
            if not killed.is_set():
                os.kill(pids[1], signal.SIGKILL)
                killed.set()

        started = time.monotonic()
        with pytest.raises(PipelineError, match=r"stage 1 \(layers 2-3 .*\) died") as info:
            pipe.generate(PROMPTS[:2], max_tokens=80, on_token=on_token)
        took = time.monotonic() - started
        assert "every sequence in flight failed" in str(info.value)
        assert took < 10.0, f"the failure took {took:.1f} s to reach the driver"
        with pytest.raises(PipelineError, match="broken"):
            pipe.generate(PROMPTS[:1])
    finally:
        pipe.close()


def test_a_stalled_stage_fails_at_the_step_timeout(cluster: Any) -> None:
    pipe = build(2, step_timeout=1.5)
    pids = [s["pid"] for s in pipe.statistics()["stages"]]
    try:
        os.kill(pids[0], signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(PipelineError, match="within 1.5 s"):
            pipe.generate(PROMPTS[:1], max_tokens=5)
        assert time.monotonic() - started < 8.0
    finally:
        os.kill(pids[0], signal.SIGCONT)
        pipe.close()


def test_placement_spreads_layers_and_refuses_what_cannot_fit() -> None:
    one = [{"NodeID": "a" * 32, "Alive": True, "Resources": {"memory": 8e9}}]
    assert [(p.start, p.end) for p in place_stages(TINY, 3, one)] == [(0, 2), (2, 4), (4, 6)]
    # The faster node (more CPUs) gets more layers; a dead node none.
    two = [{"NodeID": "a" * 32, "Alive": True, "Resources": {"memory": 3e9, "CPU": 4}},
           {"NodeID": "b" * 32, "Alive": True, "Resources": {"memory": 1e9, "CPU": 1}},
           {"NodeID": "c" * 32, "Alive": False, "Resources": {"memory": 9e9, "CPU": 16}}]
    placed = place_stages(TINY, 2, two)
    assert [p.node_id[0] for p in placed] == ["a", "b"]
    assert placed[0].end - placed[0].start > placed[1].end - placed[1].start
    # Memory still bounds a stage: b holds room for one layer and the head only.
    layer = 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64)
    head = 4 * (TINY.vocab_size * 64 + 64)
    cramped = [{"NodeID": "a" * 32, "Alive": True, "Resources": {"memory": 1e9, "CPU": 1}},
               {"NodeID": "b" * 32, "Alive": True,
                "Resources": {"memory": (layer + head) / 0.8 + 1, "CPU": 64}}]
    placed = place_stages(TINY, 2, cramped)
    assert [(p.node_id[0], p.end - p.start) for p in placed] == [("a", 5), ("b", 1)]
    with pytest.raises(PlacementError, match="at least one layer"):
        place_stages(TINY, 7, one)
    tiny_memory = [{"NodeID": "a" * 32, "Alive": True, "Resources": {"memory": 1e3}}]
    with pytest.raises(PlacementError):
        place_stages(TINY, 2, tiny_memory)


def test_mlx_stages_run_the_same_model(cluster: Any, reference: LlamaStage) -> None:
    pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'mlx[cpu]' on "
                                           "Linux)")
    expected = generate_single_process(reference, PROMPTS[:2], SamplingConfig(max_tokens=6),
                                       max_len=MAX_LEN, want_logits=True)
    with build(2, backend="mlx") as pipe:
        got = pipe.generate(PROMPTS[:2], max_tokens=6, logits=True)
    # MLX agrees with numpy to float32 rounding, not bit for bit: compare the
    # logits of the first token (the prompt's alone decides them).
    for r, e in zip(got, expected, strict=True):
        assert r.logits is not None and e.logits is not None
        np.testing.assert_allclose(r.logits[0], e.logits[0], atol=1e-3)
    with pytest.raises(ConfigError, match="backend 'gpu'"):
        build(2, backend="gpu")


class CountingStage(PipelineStage):
    """A user's own stage class: the pipeline's stage, plus a method."""

    def hops(self) -> int:
        assert self.runtime is not None
        return self.runtime.stats.steps


class FaultyStage(PipelineStage):
    """A stage whose step has a bug that shows at its fourth hop."""

    def load(self) -> dict[str, Any]:
        info = super().load()
        runtime = self.runtime
        assert runtime is not None
        step = runtime.step

        def faulty(hop: Any) -> Any:
            if runtime.stats.steps >= 3:
                raise KeyError("a bug in the stage")
            return step(hop)

        runtime.step = faulty  # type: ignore[method-assign]
        return info


def test_a_bug_in_a_stage_fails_the_generate_and_says_what(cluster: Any) -> None:
    """An exception no one expected (a bug in a user's stage class, say)
    ends the stage's serving; generate fails fast with a PipelineError that
    carries the stage's own account, not only a broken link."""
    with build(2, stage_class=FaultyStage) as pipe:
        began = time.monotonic()
        with pytest.raises(PipelineError, match=r"stopped: unexpected KeyError: 'a bug in the "
                                                r"stage'"):
            pipe.generate(PROMPTS[:1], max_tokens=8)
        assert time.monotonic() - began < 10.0


def test_a_users_own_stage_class(cluster: Any, reference: LlamaStage) -> None:
    expected = generate_single_process(reference, PROMPTS[:2], SamplingConfig(max_tokens=8),
                                       max_len=MAX_LEN)
    for stage_class in (CountingStage, pmetal.remote(max_concurrency=2)(CountingStage)):
        with build(2, stage_class=stage_class) as pipe:
            got = pipe.generate(PROMPTS[:2], max_tokens=8)
            hops = pmetal.get([h.hops.remote() for h in pipe.handles], timeout=10.0)
        assert [r.tokens for r in got] == [r.tokens for r in expected]
        assert all(n >= 8 for n in hops)
    with pytest.raises(PMetalTypeError, match="subclass of pmetal.pipeline.PipelineStage"):
        build(2, stage_class=LlamaStage)
