"""Continuous batching over a pipeline of real stage actors: sequences
submitted at any time, from several threads, join the running decode and
leave it, each with the tokens it would get alone."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pmetal.errors import PipelineError, PMetalValueError
from pmetal.pipeline.batching import ContinuousBatcher, QueueFullError
from pmetal.pipeline.generation import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    GenerationResult,
    generate_single_process,
)
from pmetal.pipeline.llama import LlamaConfig, LlamaStage, LlamaWeights
from pmetal.pipeline.pipeline import Pipeline
from pmetal.pipeline.sampling import SamplingConfig

TINY = LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9] * 12, [42, 43], [100], [7, 7, 8, 9, 10, 11],
           [3, 1, 4, 1, 5], [2, 7, 1, 8]]
MAX_LEN = 96
DEADLINE = 30.0


@pytest.fixture(scope="module")
def pipe(cluster: Any) -> Iterator[Pipeline]:
    with Pipeline.from_pretrained(random_model=TINY, seed=3, stages=2, max_len=MAX_LEN,
                                  threads=1) as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def expected() -> list[GenerationResult]:
    reference = LlamaStage(LlamaWeights.random(TINY, seed=3))
    return generate_single_process(reference, PROMPTS, SamplingConfig(max_tokens=20),
                                   max_len=MAX_LEN)


class Request:
    """One sequence's tokens and outcome, as a server would collect them."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.result: GenerationResult | None = None
        self.done = threading.Event()

    def on_token(self, _sid: int, token: int) -> None:
        self.tokens.append(token)

    def on_done(self, result: GenerationResult) -> None:
        self.result = result
        self.done.set()

    def wait(self) -> GenerationResult:
        assert self.done.wait(DEADLINE), "the sequence did not finish"
        assert self.result is not None
        return self.result


def submit(batcher: ContinuousBatcher, prompt: list[int], max_tokens: int = 20,
           **options: Any) -> tuple[int, Request]:
    request = Request()
    sid = batcher.submit(prompt, SamplingConfig(max_tokens=max_tokens, **options),
                         max_len=len(prompt) + max_tokens, on_token=request.on_token,
                         on_done=request.on_done)
    return sid, request


def wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def stages_hold(pipe: Pipeline) -> list[int]:
    return [s["in_flight"] for s in pipe.statistics()["stages"]]


def test_concurrent_submits_share_steps_and_equal_lone_answers(
        pipe: Pipeline, expected: list[GenerationResult]) -> None:
    with ContinuousBatcher(pipe.loop) as batcher:
        requests: list[Request | None] = [None] * len(PROMPTS)

        def client(i: int) -> None:
            requests[i] = submit(batcher, PROMPTS[i])[1]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE)
        results = [r.wait() for r in requests if r is not None]
        stats = batcher.statistics()
    assert [r.tokens for r in results] == [e.tokens for e in expected]
    assert [r.tokens for r in requests if r is not None] == [e.tokens for e in expected]
    assert all(r.finish_reason == FINISH_LENGTH for r in results)
    assert stats.live == 0 and stats.finished == len(PROMPTS)
    assert stats.tokens == 20 * len(PROMPTS)
    assert stats.widest_hop > 1 and stats.max_running > 1
    wait_until(lambda: stages_hold(pipe) == [0, 0], "the stages to free every cache")


def test_a_sequence_joins_a_running_decode(pipe: Pipeline,
                                           expected: list[GenerationResult]) -> None:
    """The second sequence is submitted while the first is mid-way: it is
    admitted between two steps, not after the first one ends."""
    joined = threading.Event()
    with ContinuousBatcher(pipe.loop) as batcher:
        second: list[Request] = []
        first = Request()

        def on_token(sid: int, token: int) -> None:
            first.on_token(sid, token)
            if len(first.tokens) == 5:
                second.append(submit(batcher, PROMPTS[1])[1])
            if second and second[0].tokens and not first.done.is_set():
                joined.set()

        batcher.submit(PROMPTS[0], SamplingConfig(max_tokens=20), max_len=MAX_LEN,
                       on_token=on_token, on_done=first.on_done)
        assert first.wait().tokens == expected[0].tokens
        assert second[0].wait().tokens == expected[1].tokens
    assert joined.is_set(), "the second sequence got no token while the first ran"


def test_cancel_frees_the_sequence_and_the_stages_caches(pipe: Pipeline) -> None:
    with ContinuousBatcher(pipe.loop) as batcher:
        got_one = threading.Event()
        request = Request()

        def on_token(sid: int, token: int) -> None:
            request.on_token(sid, token)
            got_one.set()

        sid = batcher.submit(PROMPTS[2], SamplingConfig(max_tokens=80), max_len=MAX_LEN,
                             on_token=on_token, on_done=request.on_done)
        other, rest = submit(batcher, PROMPTS[3])
        assert got_one.wait(DEADLINE)
        assert batcher.cancel(sid)
        assert request.wait().finish_reason == FINISH_CANCELLED
        assert len(request.tokens) < 80
        assert not batcher.cancel(sid)           # over: nothing to cancel
        assert rest.wait().finish_reason == FINISH_LENGTH   # the other went on
        wait_until(lambda: batcher.statistics().live == 0, "no live sequence")
        assert batcher.statistics().cancelled == 1
        wait_until(lambda: stages_hold(pipe) == [0, 0], "the stages to free every cache")
        del other


def test_a_full_queue_refuses_at_once_and_close_cancels(pipe: Pipeline) -> None:
    """One sequence runs (max_running=1) and its token callback holds the
    loop while the test fills the queue: two wait, the third is refused."""
    release = threading.Event()
    tokens: queue.Queue[int] = queue.Queue()
    batcher = ContinuousBatcher(pipe.loop, max_running=1, max_waiting=2)
    batcher.start()
    try:
        running = Request()

        def hold(sid: int, token: int) -> None:
            running.on_token(sid, token)
            tokens.put(token)
            release.wait(DEADLINE)

        batcher.submit(PROMPTS[0], SamplingConfig(max_tokens=50), max_len=MAX_LEN,
                       on_token=hold, on_done=running.on_done)
        tokens.get(timeout=DEADLINE)     # the loop is inside the callback now
        waiting = [submit(batcher, PROMPTS[i])[1] for i in (1, 2)]
        with pytest.raises(QueueFullError, match="2 requests are waiting"):
            submit(batcher, PROMPTS[3])
        stats = batcher.statistics()
        assert (stats.waiting, stats.running, stats.live) == (2, 1, 3)
        release.set()
    finally:
        release.set()
        batcher.close()
    assert running.wait().finish_reason in (FINISH_CANCELLED, FINISH_LENGTH)
    assert all(w.wait().finish_reason in (FINISH_CANCELLED, FINISH_LENGTH) for w in waiting)
    assert batcher.statistics().live == 0
    with pytest.raises(PipelineError, match="not running"):
        submit(batcher, PROMPTS[0])
    # The loop is free again for Pipeline.generate.
    assert len(pipe.generate([PROMPTS[0]], max_tokens=3)[0].tokens) == 3


def test_bad_prompts_and_settings_are_refused(pipe: Pipeline) -> None:
    with ContinuousBatcher(pipe.loop) as batcher:
        with pytest.raises(PMetalValueError, match="leaves no room"):
            batcher.submit(PROMPTS[2], SamplingConfig(), max_len=len(PROMPTS[2]))
        with pytest.raises(PMetalValueError, match="at least one token"):
            batcher.submit([], SamplingConfig(), max_len=10)
        assert batcher.statistics().live == 0
    with pytest.raises(PMetalValueError, match="max_waiting"):
        ContinuousBatcher(pipe.loop, max_waiting=0)


def test_a_failing_sequence_fails_alone(pipe: Pipeline,
                                        expected: list[GenerationResult]) -> None:
    """A token outside the vocabulary fails at stage 0: that sequence
    ends with an error, the batcher and the other sequence go on."""
    with ContinuousBatcher(pipe.loop) as batcher:
        _, bad = submit(batcher, [TINY.vocab_size + 5])
        _, good = submit(batcher, PROMPTS[0])
        assert bad.wait().finish_reason == FINISH_ERROR
        assert good.wait().tokens == expected[0].tokens
        assert batcher.statistics().failed == 1 and batcher.statistics().broken is None
