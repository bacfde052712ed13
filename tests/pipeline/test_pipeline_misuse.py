"""The pipeline used carelessly, and its processes dying at bad moments.

Every mistake a user can make with :class:`Pipeline` raises a specific
:class:`~pmetal.errors.PMetalError` saying what to do, before any stage
actor is created where the mistake is visible that early; a stage killed
while the pipeline is being built fails ``from_pretrained`` within a
bounded time and takes the other stages with it; two pipelines in one
driver keep their rings apart; a callback that raises, two threads on one
pipeline and close() during a generate leave no corrupted ring; a driver
killed mid-generation takes its stages with it. Real stage actors on an
embedded node (or a ``pmetal start`` node), real TCP links on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from cluster.lab import read_line

from pmetal.actors import context
from pmetal.errors import (
    ActorDiedError,
    ConfigError,
    PipelineError,
    PlacementError,
    PMetalError,
    PMetalValueError,
)
from pmetal.pipeline import pipeline as pipeline_module
from pmetal.pipeline.generation import generate_single_process
from pmetal.pipeline.llama import LlamaConfig, LlamaStage, LlamaWeights
from pmetal.pipeline.models import ModelFormatError, UnknownModelError
from pmetal.pipeline.pipeline import Pipeline
from pmetal.pipeline.sampling import SamplingConfig

from .tinymodel import tiny_config, write_tiny_gguf

TINY = LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9] * 12]
MAX_LEN = 96
WAIT = 20.0          # deadline of any wait on the cluster (actors ending, a failure arriving)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    whole = LlamaStage(LlamaWeights.random(TINY, seed=3))
    return [r.tokens for r in generate_single_process(whole, PROMPTS,
                                                      SamplingConfig(max_tokens=16),
                                                      max_len=MAX_LEN)]


def build(stages: int = 2, **options: Any) -> Pipeline:
    settings: dict[str, Any] = {"random_model": TINY, "seed": 3, "stages": stages,
                                "max_len": MAX_LEN, "threads": 1}
    settings.update(options)
    return Pipeline.from_pretrained(**settings)


def live_stages() -> list[dict[str, Any]]:
    """The stage actors the node holds that are not dead."""
    return [a for a in context.current().status()["actors"]
            if a["class_name"] == "PipelineStage" and a["state"] != "dead"]


def wait_no_stages(timeout: float = WAIT) -> None:
    """Kills are asynchronous: wait (with a deadline) until no stage actor lives."""
    deadline = time.monotonic() + timeout
    while live_stages():
        assert time.monotonic() < deadline, f"stage actors left behind: {live_stages()}"
        time.sleep(0.05)


def stage_worker_pids() -> dict[str, int]:
    """actor id -> worker pid, of the node's stage actors."""
    status = context.current().status()
    stages = {a["actor_id"] for a in status["actors"] if a["class_name"] == "PipelineStage"}
    return {w["actor_id"]: w["pid"] for w in status["workers"] if w["actor_id"] in stages}


# ----------------------------------------------------------- building it wrong

@pytest.mark.parametrize(("options", "error", "message"), [
    ({"stages": 0}, PMetalValueError, r"stages 0 must be an int >= 1"),
    ({"stages": True}, PMetalValueError, r"stages True must be an int >= 1"),
    ({"stages": 7}, PlacementError, r"7 stages for a model of 6 layers: every stage needs"),
    ({"codec": "fp61"}, PMetalValueError, r"unknown activation codec 'fp61'; choose one of"),
    ({"backend": "gpu"}, ConfigError, r"backend 'gpu': choose from"),
    ({"placement": ["no-such-node", "nor-this"]}, PlacementError,
     r"placement must name 2 live node ids \(from pmetal.nodes\(\)\)"),
    ({"max_len": 1}, PMetalValueError, r"max_len 1 must be"),
    ({"threads": -1}, ConfigError, r"threads -1 must be an int >= 0"),
    ({"max_len": "64"}, PMetalValueError, r"max_len '64' must be an int >= 2"),
    ({"step_timeout": 0}, PMetalValueError, r"step_timeout 0 must be a positive number"),
    ({"connect_timeout": -1}, PMetalValueError, r"connect_timeout -1 must be a positive"),
    ({"lanes": 0}, PMetalValueError, r"lanes 0 must be an int >= 1"),
])
def test_bad_settings_fail_before_any_actor_exists(cluster: Any, options: dict[str, Any],
                                                   error: type[PMetalError],
                                                   message: str) -> None:
    wait_no_stages()
    with pytest.raises(error, match=message):
        build(**options)
    assert live_stages() == []


def test_a_placement_of_the_wrong_length_is_refused(cluster: Any) -> None:
    node = context.current().status()["node_id"]
    with pytest.raises(PlacementError, match="must name 2 live node ids"):
        build(placement=[node])
    with pytest.raises(PlacementError, match="a list of node ids, one per stage, not the "
                                             "string"):
        build(placement=node[:2])
    assert live_stages() == []


def test_a_model_that_is_not_a_llama_model_is_refused_before_any_actor(
        cluster: Any, tmp_path: Path) -> None:
    wait_no_stages()
    with pytest.raises(UnknownModelError, match="no such file or folder"):
        Pipeline.from_pretrained(tmp_path / "missing.gguf")
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    with pytest.raises(UnknownModelError,
                       match=r"neither a .gguf file nor a Hugging Face model folder"):
        Pipeline.from_pretrained(text)
    with pytest.raises(UnknownModelError, match="neither a .gguf file"):
        Pipeline.from_pretrained(tmp_path)          # a folder without config.json
    # A real GGUF file of another architecture.
    other = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFormatError, match="holds a 'gpt2' model; pmetal's decoder "
                                               "computes llama, qwen2, qwen3 GGUF models"):
        Pipeline.from_pretrained(other, stages=2)
    # A Llama GGUF file cut short (an interrupted download), and cut in its header.
    whole = tmp_path / "tiny.gguf"
    write_tiny_gguf(whole, tiny_config(layers=4), seed=7)
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) * 3 // 4])
    with pytest.raises(ModelFormatError, match=r"runs past the end of the file \(truncated"):
        Pipeline.from_pretrained(cut, stages=2)
    cut.write_bytes(data[:200])
    with pytest.raises(ModelFormatError, match="GGUF header is truncated or corrupt"):
        Pipeline.from_pretrained(cut, stages=2)
    assert live_stages() == []


# ------------------------------------------------------------ using it wrong

def test_bad_generation_settings_fail_before_anything_is_sent(cluster: Any,
                                                              expected: list[list[int]]) -> None:
    with build() as pipe:
        with pytest.raises(ConfigError, match=r"max_tokens: 0 must be an int >= 1"):
            pipe.generate(PROMPTS, max_tokens=0)
        with pytest.raises(ConfigError, match=r"max_tokens: -3 must be an int >= 1"):
            pipe.generate(PROMPTS, max_tokens=-3)
        with pytest.raises(ConfigError, match=r"temperature: -1 must be a finite number >= 0"):
            pipe.generate(PROMPTS, temperature=-1)
        with pytest.raises(ConfigError, match=r"top_p: 2 must be in \(0, 1\]"):
            pipe.generate(PROMPTS, top_p=2)
        with pytest.raises(ConfigError, match=r"stop_token_ids: .* must be a sequence of token"):
            pipe.generate(PROMPTS, stop_token_ids="ab")
        with pytest.raises(PMetalValueError, match=r"a prompt of 200 tokens leaves no room in "
                                                   r"a context of 96"):
            pipe.generate([[1] * 200])
        with pytest.raises(PMetalValueError, match="at least one token"):
            pipe.generate([[]])
        with pytest.raises(PMetalValueError, match="outside the vocabulary"):
            pipe.generate([[-1, 2]])
        with pytest.raises(PMetalValueError, match=r"a list of token ids \(ints\), not \[1.5"):
            pipe.generate([[1.5, 2]])
        with pytest.raises(PMetalValueError, match=r"a list of token ids \(ints\), not 1.5"):
            pipe.generate([1.5, 2])
        with pytest.raises(PMetalValueError, match="no tokenizer .* use on_token="):
            pipe.generate(PROMPTS, stream=lambda i, text: None)
        assert pipe.generate([]) == []
        assert pipe.cancel(3) is False              # nothing is running
        # None of it disturbed the ring.
        assert [r.tokens for r in pipe.generate(PROMPTS, max_tokens=16)] == expected
        assert all(s["in_flight"] == 0 for s in pipe.statistics()["stages"])


def test_generate_after_close_and_close_twice(cluster: Any) -> None:
    pipe = build()
    assert pipe.generate([[1, 2]], max_tokens=2)[0].ok
    pipe.close()
    pipe.close()                                   # a second close does nothing
    with pytest.raises(PipelineError, match="this pipeline is closed"):
        pipe.generate([[1, 2]])
    with pipe:                                     # leaving a closed pipeline's block is fine
        pass
    wait_no_stages()


# ------------------------------------------------------- processes that die

def test_a_stage_killed_while_the_pipeline_is_built_fails_it_and_leaves_no_actor(
        cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kill one stage's worker as soon as the stages were asked to load (a
    model big enough that loading takes a while): ``from_pretrained``
    raises within a bounded time and the other stages end with it."""
    wait_no_stages()
    big = LlamaConfig(vocab_size=4000, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=256)
    real_get = pipeline_module._get
    killed: list[int] = []

    def get_after_killing(client: Any, refs: Any, timeout: float, *rest: Any) -> list[Any]:
        if not killed:                             # the first wait is the one for load()
            pids = stage_worker_pids()
            assert len(pids) == 3, pids
            victim = sorted(pids.values())[1]
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
        return real_get(client, refs, timeout, *rest)

    monkeypatch.setattr(pipeline_module, "_get", get_after_killing)
    started = time.monotonic()
    with pytest.raises(PipelineError, match=r"stage \d \(layers \d+-\d+ on node \w+\) died "
                                            r"while loading .*build the pipeline again") as info:
        build(3, random_model=big)
    took = time.monotonic() - started
    print(f"\n[kill during load] failed after {took:.2f} s: {info.value}")
    assert killed and took < WAIT, f"from_pretrained took {took:.1f} s to fail"
    assert isinstance(info.value.__cause__, ActorDiedError)
    wait_no_stages()


def test_two_pipelines_in_one_driver_generate_at_once(cluster: Any,
                                                      expected: list[list[int]]) -> None:
    """A 2-stage and a 3-stage pipeline, each generating from its own
    thread: separate rings (their tags differ), each gives the
    single-process tokens every time."""
    results: dict[str, Any] = {}
    with build(2) as two, build(3) as three:
        def run(name: str, pipe: Pipeline) -> None:
            try:
                results[name] = [[r.tokens for r in pipe.generate(PROMPTS, max_tokens=16)]
                                 for _ in range(3)]
            except PMetalError as exc:
                results[name] = exc

        threads = [threading.Thread(target=run, args=(name, pipe))
                   for name, pipe in (("two", two), ("three", three))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT * 3)
        assert not any(t.is_alive() for t in threads)
        assert len({s["pid"] for p in (two, three) for s in p.statistics()["stages"]}) == 5
    assert results == {"two": [expected] * 3, "three": [expected] * 3}


# ---------------------------------------------------- callbacks and threads

class Interrupted(Exception):
    """What the user's callback raises."""


@pytest.mark.parametrize("raised", [Interrupted, KeyboardInterrupt])
def test_a_callback_that_raises_leaves_the_pipeline_clean(cluster: Any, raised: type,
                                                          expected: list[list[int]]) -> None:
    """An exception from ``on_token`` (or Ctrl-C in it) propagates out of
    ``generate`` with hops still in flight; the loop collects them and the
    stages drop every sequence, so the next ``generate`` is exact. (Before:
    the next call read the old hops as its own and failed with IndexError.)"""
    with build() as pipe:
        def on_token(index: int, token: int) -> None:
            if index == 1:
                raise raised("the user's callback failed")

        with pytest.raises(raised, match="the user's callback failed"):
            pipe.generate(PROMPTS, max_tokens=16, on_token=on_token)
        assert all(s["in_flight"] == 0 for s in pipe.statistics()["stages"])
        assert [r.tokens for r in pipe.generate(PROMPTS, max_tokens=16)] == expected


def test_generate_from_inside_its_own_callback_is_refused(cluster: Any,
                                                          expected: list[list[int]]) -> None:
    with build() as pipe:
        def on_token(index: int, token: int) -> None:
            pipe.generate([[1, 2]], max_tokens=2)

        with pytest.raises(PipelineError, match="called from inside a callback"):
            pipe.generate(PROMPTS, max_tokens=16, on_token=on_token)
        assert [r.tokens for r in pipe.generate(PROMPTS, max_tokens=16)] == expected


def test_one_pipeline_used_from_two_threads_runs_them_in_turn(cluster: Any,
                                                             expected: list[list[int]]) -> None:
    """Two threads calling ``generate`` on one pipeline at once. (Before: the
    two runs interleaved their hops on one ring, one of them failed with
    RuntimeError "concurrent poll() invocation" and the other got wrong
    tokens.)"""
    results: dict[int, Any] = {}
    with build() as pipe:
        def run(k: int) -> None:
            try:
                results[k] = [[r.tokens for r in pipe.generate(PROMPTS, max_tokens=16)]
                              for _ in range(3)]
            except Exception as exc:  # noqa: BLE001 - shown by the assertion below
                results[k] = exc

        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT * 3)
        assert not any(t.is_alive() for t in threads)
    assert results == {0: [expected] * 3, 1: [expected] * 3}


def test_close_from_another_thread_fails_the_running_generate(cluster: Any) -> None:
    pipe = build()
    first = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        try:
            while True:
                pipe.generate(PROMPTS, max_tokens=80, on_token=lambda i, t: first.set())
        except PMetalError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert first.wait(WAIT)
        pipe.close()
        thread.join(WAIT)
        assert not thread.is_alive()
    finally:
        pipe.close()
    assert isinstance(outcome[0], PipelineError), outcome
    wait_no_stages()


# -------------------------------------------------------- a driver that dies

DRIVER = r"""
import json, sys
import pmetal
from pmetal.pipeline.llama import LlamaConfig
from pmetal.pipeline.pipeline import Pipeline

pmetal.init(address="auto")
tiny = LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
pipe = Pipeline.from_pretrained(random_model=tiny, seed=3, stages=2, max_len=96, threads=1)
pids = [s["pid"] for s in pipe.statistics()["stages"]]
told = []

def on_token(index, token):
    if not told:
        told.append(1)
        print(json.dumps({"step": "generating", "pids": pids}), flush=True)

while True:                  # until the test kills this process with SIGKILL
    pipe.generate([[1, 2, 3], [4, 5]], max_tokens=90, on_token=on_token)
"""


def _pmetal(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pmetal", *args], env=_env(home),
                          capture_output=True, text=True, timeout=60.0, check=False)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    env["PMETAL_HOME"] = str(home)
    return env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:        # a zombie waiting for its parent to reap it has exited
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_a_driver_killed_mid_generation_takes_its_stages_with_it(tmp_path: Path) -> None:
    """The driver (a process of its own, connected to a ``pmetal start``
    node) is killed with SIGKILL while its pipeline generates: the stages'
    links break, their actors end (their owner is gone) and their worker
    processes exit, within a deadline."""
    home = tmp_path / "home"
    started = _pmetal(home, "start", "--port", "0")
    assert started.returncode == 0, started.stderr
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], env=_env(home),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = read_line(driver, 60.0, "generating")
        pids = line["pids"]
        assert all(_alive(pid) for pid in pids)
        driver.send_signal(signal.SIGKILL)
        driver.wait(WAIT)
        killed = time.monotonic()
        deadline = killed + WAIT
        while any(_alive(pid) for pid in pids):
            assert time.monotonic() < deadline, f"stage workers {pids} outlived their driver"
            time.sleep(0.05)
        while True:
            status = json.loads(_pmetal(home, "status", "--json").stdout)
            stages = [a for a in status["actors"] if a["class_name"] == "PipelineStage"]
            if stages and all(a["state"] == "dead" for a in stages):
                break
            assert time.monotonic() < deadline, stages
            time.sleep(0.1)
        print(f"\n[driver killed] stage workers gone and actors dead after "
              f"{time.monotonic() - killed:.2f} s: {[a['reason'] for a in stages]}")
        assert len(stages) == 2 and all("owner" in a["reason"] for a in stages), stages
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(WAIT)
        _pmetal(home, "stop")


def test_close_from_inside_a_callback_fails_that_generate(cluster: Any) -> None:
    pipe = build()
    with pytest.raises(PipelineError):
        pipe.generate(PROMPTS, max_tokens=40, on_token=lambda i, t: pipe.close())
    with pytest.raises(PipelineError, match="this pipeline is closed"):
        pipe.generate(PROMPTS)
    wait_no_stages()


def test_more_prompts_than_fit_in_flight_wait_their_turn(cluster: Any) -> None:
    """70 prompts, more than the 64 sequences a pipeline keeps in flight:
    the rest wait and each gets its single-process tokens."""
    prompts = [[(7 * i + j) % TINY.vocab_size for j in range(1 + i % 5)] for i in range(70)]
    whole = LlamaStage(LlamaWeights.random(TINY, seed=3))
    want = [r.tokens for r in generate_single_process(whole, prompts,
                                                      SamplingConfig(max_tokens=4),
                                                      max_len=MAX_LEN)]
    with build() as pipe:
        assert [r.tokens for r in pipe.generate(prompts, max_tokens=4)] == want
        assert all(s["in_flight"] == 0 for s in pipe.statistics()["stages"])


def test_a_stage_stalled_while_the_ring_forms_fails_at_connect_timeout(
        cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage stopped (SIGSTOP) after it opened its port, before it joins
    the ring: ``from_pretrained`` fails once ``connect_timeout`` has passed,
    naming the stage, and the stage actors are ended."""
    wait_no_stages()
    real_get = pipeline_module._get
    stopped: list[int] = []

    def get_then_stop(client: Any, refs: Any, timeout: float, placements: Any,
                      doing: str) -> list[Any]:
        out = real_get(client, refs, timeout, placements, doing)
        if doing == "opening":
            pids = stage_worker_pids()
            stopped.append(min(pids.values()))
            os.kill(stopped[0], signal.SIGSTOP)
        return out

    monkeypatch.setattr(pipeline_module, "_get", get_then_stop)
    started = time.monotonic()
    try:
        with pytest.raises(PipelineError, match=r"ring did not form within 2 s: .*rank\(s\) "
                                                r"\[\d\].*rank 1 is stage 0 \(layers 0-1") as info:
            build(3, connect_timeout=2.0)
        took = time.monotonic() - started
        print(f"\n[stalled at formation] failed after {took:.2f} s: "
              f"{type(info.value).__name__}: {info.value}")
        assert took < 15.0
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    wait_no_stages()
