"""The compute helpers of a numpy stage (pmetal.pipeline.compute): helper
processes give the same bits as threads and as one thread, a helper that
dies costs nothing but speed, and helpers neither spin while the stage
waits nor outlive their stage or its process."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from pmetal.errors import PMetalValueError
from pmetal.pipeline import compute
from pmetal.pipeline.llama import (
    SMOLLM2_135M,
    KVCache,
    LlamaConfig,
    LlamaStage,
    LlamaWeights,
)
from pmetal.pipeline.threads import compute_threads, set_compute_threads

pytestmark = pytest.mark.skipif(not compute.processes_supported(),
                                reason="helper processes need Linux on x86-64")

# The default model's widths (where products are worth sharing), 2 layers.
WIDE = LlamaConfig(**{**SMOLLM2_135M.__dict__, "vocab_size": 4096, "num_hidden_layers": 2,
                      "head_dim": 0})
PROMPTS = [[5, 9, 200, 7], [1, 2], [300, 301, 302, 303, 304, 305], [42]]


@pytest.fixture(scope="module")
def weights() -> LlamaWeights:
    return LlamaWeights.random(WIDE, seed=4)


@pytest.fixture
def two_threads():
    before = compute_threads()
    if before is None:
        pytest.skip("numpy's BLAS is not an OpenBLAS whose thread count pmetal can set")
    set_compute_threads(2)
    yield
    set_compute_threads(before)


def _decode(stage: LlamaStage, steps: int = 3) -> list[np.ndarray]:
    """Prefill PROMPTS, then a few batched decode steps and single-row
    ones; every step's logits."""
    caches = [stage.new_cache(32) for _ in PROMPTS]
    tokens = []
    for prompt, cache in zip(PROMPTS, caches):
        tokens.append(int(stage.logits(stage.forward(stage.embed(prompt), cache))[-1].argmax()))
    seen = []
    for _ in range(steps):
        logits = stage.logits(stage.forward_batch(stage.embed(tokens), caches))
        seen.append(logits)
        tokens = [int(t) for t in logits.argmax(-1)]
    seen.append(stage.logits(stage.forward(stage.embed(tokens[:1]), caches[0])))
    return seen


def _state(pid: int) -> str | None:
    """The process's state letter from /proc, or None once it is gone
    (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if state in ("Z", "X") else state


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _state(pid) is None:
            return True
        time.sleep(0.02)
    return False


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_processes_threads_and_one_thread_give_the_same_bits(weights, two_threads) -> None:
    results = {}
    for helpers in ("processes", "threads"):
        stage = LlamaStage(weights, max_threads=2, helpers=helpers)
        try:
            results[helpers] = _decode(stage)
            assert stage.helpers == helpers
            assert len(stage.helper_pids) == (1 if helpers == "processes" else 0)
        finally:
            stage.close()
    set_compute_threads(1)
    alone = LlamaStage(weights, max_threads=1)
    results["one thread"] = _decode(alone)
    assert alone.helpers is None
    for name in ("threads", "one thread"):
        for a, b in zip(results["processes"], results[name]):
            np.testing.assert_array_equal(a, b)


def test_a_killed_helper_costs_nothing_but_speed(weights, two_threads, caplog) -> None:
    reference = LlamaStage(weights, max_threads=1)
    set_compute_threads(1)
    expected = _decode(reference)
    set_compute_threads(2)
    stage = LlamaStage(weights, max_threads=2, helpers="processes")
    try:
        _decode(stage, steps=1)  # the helper is up and has worked
        [pid] = stage.helper_pids
        os.kill(pid, signal.SIGKILL)
        assert _wait_gone(pid, 5.0)
        with caplog.at_level(logging.WARNING, logger="pmetal.pipeline.compute"):
            got = _decode(stage)
        for a, b in zip(expected, got):
            np.testing.assert_array_equal(a, b)
        assert stage.helpers == "threads"
        assert stage.helper_pids == []
        assert any("compute helper 0" in r.getMessage() and "-9" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        stage.close()


def test_close_ends_the_helpers(weights, two_threads) -> None:
    stage = LlamaStage(weights, max_threads=3)
    pids = stage.helper_pids
    assert len(pids) == 2
    _decode(stage, steps=1)
    process = stage._project._helpers._helpers[0].process
    stage.close()
    assert process.returncode == 0, "a closed helper exits by itself, not by a kill"
    assert all(_state(pid) is None for pid in pids)
    assert stage.helper_pids == []
    # The stage still computes, on threads now.
    assert _decode(stage, steps=1)
    stage.close()


def test_a_resting_stage_does_not_keep_a_core_busy(weights, two_threads) -> None:
    stage = LlamaStage(weights, max_threads=2, helpers="processes")
    try:
        _decode(stage, steps=1)
        [pid] = stage.helper_pids
        stage.rest()
        control = stage._project._helpers._helpers[0].control
        deadline = time.monotonic() + 5.0
        while control[compute.STATE] != compute.SLEEPING:
            assert time.monotonic() < deadline, "the helper did not go to sleep"
            time.sleep(0.005)
        before = _cpu_seconds(pid)
        threading.Event().wait(0.3)  # a window to measure: a spinning helper uses all of it
        assert _cpu_seconds(pid) - before < 0.1
        # and it wakes for the next step, with the same bits as ever
        assert _decode(stage, steps=1)
        assert stage.helpers == "processes"
    finally:
        stage.close()


def test_helpers_end_with_a_killed_owner(tmp_path) -> None:
    script = textwrap.dedent("""
        import sys
        from pmetal.pipeline.llama import LlamaConfig, LlamaStage, LlamaWeights, SMOLLM2_135M
        from pmetal.pipeline.threads import set_compute_threads
        set_compute_threads(2)
        config = LlamaConfig(**{**SMOLLM2_135M.__dict__, "vocab_size": 1024,
                                "num_hidden_layers": 1, "head_dim": 0})
        stage = LlamaStage(LlamaWeights.random(config), max_threads=2, helpers="processes")
        cache = stage.new_cache(8)
        stage.forward_batch(stage.embed([1]), [cache])
        print(*stage.helper_pids, flush=True)
        sys.stdin.read()
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline()
        [pid] = [int(p) for p in line.split()]
        assert _state(pid) is not None
        owner.kill()
        owner.wait(timeout=10)
        assert _wait_gone(pid, 5.0), "the helper outlived its owner"
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait(timeout=10)


def test_bad_helper_options_are_refused(weights) -> None:
    with pytest.raises(PMetalValueError, match="helpers='thread'.*auto, processes, threads"):
        LlamaStage(weights, helpers="thread")
    with pytest.raises(PMetalValueError, match="max_threads must be a positive integer"):
        LlamaStage(weights, max_threads=0)
    small = LlamaWeights.random(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                            num_hidden_layers=1, num_attention_heads=4,
                                            num_key_value_heads=2), seed=1)
    with pytest.raises(PMetalValueError, match="helpers='processes' needs"):
        LlamaStage(small, max_threads=2, helpers="processes")
    assert isinstance(LlamaStage(small, max_threads=2).new_cache(4), KVCache)


def test_the_thread_hint_goes_round_the_ring() -> None:
    """A hop's count of hops in flight (the stages' thread hint) leaves a
    stage as it came: a later stage that saw the default of 1 would take
    every core while the earlier stages compute too. (Before: it did, and
    4 sequences over 2 stages ran at 41 tokens/s instead of 58.)"""
    from pmetal.pipeline.stage import PipelineStageConfig, PipelineStageRuntime
    from pmetal.pipeline.transport import Entry, Hop

    tiny = LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    first, last = (PipelineStageRuntime(PipelineStageConfig(
        start=start, end=end, index=index, num_stages=2, random_model=dict(tiny.__dict__)))
        for index, (start, end) in enumerate(((0, 2), (2, 4))))
    setup = {"max_len": 8}
    for busy in (2, 1, 3):
        hop = Hop([Entry(busy, 0, tokens=(1, 2, 3), prefill=True, setup=setup)], busy)
        middle = first.step(hop)
        assert middle.busy == busy
        assert last.step(middle).busy == busy
