"""``pmetal bench pipeline`` end to end on tiny models (quick settings):
the tables' shape, that every figure is a positive number, that each row
runs on the thread count it claims, and that the CPU hogs of the
under-load table never outlive the bench; no timing assertions (the
figures live in docs/performance.md)."""

from __future__ import annotations

import io
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pmetal
from pmetal.bench import hogs
from pmetal.bench.pipeline_stages import seal_cost
from pmetal.bench.pipeline import (
    PROMPTS,
    Options,
    PipelineRow,
    build_engine,
    measure_single_process,
    run,
)
from pmetal.cli import main
from pmetal.errors import ConfigError
from pmetal.model import kernels
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

SINGLE_HEADER = ["threads", "prefill (ms)", "first token (ms)", "decode tok/s, 1 sequence",
                 "aggregate tok/s, 4 batched"]
NO_ANCHOR = "not measured (no anchor)"
TARGETS = ["decode, 1 sequence, 1 thread(s): x llama.cpp",
           "decode, 1 sequence, 2 thread(s): x llama.cpp",
           "aggregate, 4 sequences batched, 2 thread(s): x llama.cpp 1 sequence",
           "prefill of 32 tokens, 1 thread(s): x llama.cpp's speed",
           "prefill of 32 tokens, 2 thread(s): x llama.cpp's speed",
           "under load (2 hogs), decode, 1 sequence, 2 thread(s): share of the quiet rate kept"]


def _table(out: str, title: str) -> list[list[str]]:
    """The rows under the '# <title>...' heading, split on runs of spaces."""
    rows: list[list[str]] = []
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"# {title}"))
    for line in lines[start + 1:]:
        if not line.strip() or line.startswith("#"):
            break
        rows.append([c.strip() for c in line.strip().split("  ") if c.strip()])
    return rows


def _running_hogs() -> list[int]:
    """Pids of live hogs whose parent is this process (found by the pid
    their program names)."""
    mark = f"os.getppid() == {os.getpid()}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if mark in f.read() and hogs.alive(int(entry)):
                        found.append(int(entry))
            except OSError:   # ended while we looked
                continue
    return found


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_tiny_gguf(path, tiny_config(), quantize=True)
    return str(path)


def test_quick_mode_prints_every_table(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "pipeline", "--quick", "--random-weights", "tiny",
                   "--anchors", "off", "--threads", "1,2", "--prefill-tokens", "32"])
    out = capsys.readouterr().out
    assert status == 0, out
    header, *rows = _table(out, "(a) single process, reference engine")
    assert header == [*SINGLE_HEADER, "prefill of 32 tokens (ms)"]
    assert [r[0] for r in rows] == ["1", "2"]
    for row in rows:
        assert all(float(cell) > 0 for cell in row[1:]), row
    assert _table(out, "(b) llama.cpp") == [["llama.cpp: not run (--anchors off)"]]
    # (c): the tiny model as 2 stage actors on a local node the command started.
    header, *rows = _table(out, "(c) pipeline")
    assert header[:3] == ["run", "tok/s", "vs single process"]
    assert [r[0] for r in rows] == [
        "2 stages, codec none, 1 sequence",
        "2 stages, codec none, 4 sequences (aggregate, prefill included)",
        *(f"2 stages, codec {c}, 2 sequences (logits returned)" for c in ("fp16", "bf16",
                                                                          "int8"))]
    assert all(float(r[1]) > 0 for r in rows)
    assert rows[0][3] != "-" and rows[0][4] != "-"          # hop overhead, bytes per token
    assert rows[0][5].endswith("%)")                         # sealing: us/token (share)
    for row in rows[2:]:                                     # agreement and logit difference
        assert row[6].endswith("%") and float(row[7]) >= 0.0
    header, *load = _table(out, "(d) under load: 2 busy-loop processes")
    assert header == ["engine", "quiet tok/s", "loaded tok/s", "share kept"]
    assert [r[0] for r in load] == ["pmetal"] and float(load[0][2]) > 0
    header, *targets = _table(out, "Targets")
    assert header == ["measure", "measured", "target", "met"]
    assert [t[0] for t in targets] == TARGETS
    assert all(t[-1] == NO_ANCHOR for t in targets)
    assert "--quick" in out and "random weights of the tiny shape (reference engine)" in out
    assert not pmetal.is_initialized()       # the local node it started is gone
    assert _running_hogs() == []


def test_quantized_gguf_against_llama_cpp(tiny_gguf: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The default backend of a GGUF file, every table and target judged
    against llama.cpp on the same file."""
    pytest.importorskip("llama_cpp")
    status = main(["bench", "pipeline", "--quick", "--model", tiny_gguf, "--stages", "0",
                   "--prefill-tokens", "32"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "(quantized engine)" in out and "chat prompts tokenized by llama.cpp" in out
    header, *rows = _table(out, "(a) single process, quantized engine")
    assert [r[0] for r in rows] == ["1", "2"]
    header, *anchors = _table(out, "(b) llama.cpp")
    assert header == ["threads", "first token (ms)", "decode tok/s, 1 sequence",
                      "prefill of 32 tokens (ms)"]
    assert [r[0] for r in anchors] == ["1", "2"]
    assert all(float(cell) > 0 for r in anchors for cell in r[1:])
    _, *load = _table(out, "(d) under load")
    assert [r[0] for r in load] == ["pmetal", "llama.cpp"]
    assert all(r[3].endswith("%") for r in load)
    _, *targets = _table(out, "Targets")
    assert [t[0] for t in targets] == TARGETS
    assert all(t[-1] in ("yes", "NO") for t in targets), targets
    assert all(t[1].endswith("tok/s)") or t[1].endswith("ms)") for t in targets[:5])
    assert _running_hogs() == []


def test_the_hogs_are_gone_after_the_run() -> None:
    out = io.StringIO()
    result = run(Options(random_shape="tiny", backend="quantized", anchors=False,
                         decode_tokens=2, repeats=1, threads=(1,), prompts=("a",),
                         prefill_tokens=0, hogs=3), out)
    pids = result["hog_pids"]
    assert len(pids) == 3 and not any(hogs.alive(pid) for pid in pids)
    assert [r.engine for r in result["load"]] == ["pmetal"]
    assert "prefill of" not in "".join(t.measure for t in result["targets"])
    assert _running_hogs() == []


def test_hogs_that_end_early_leave_the_target_unjudged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hog past its deadline mid-measurement (injected: on this machine
    the measurement is shorter than a hog's start) voids the comparison."""
    import pmetal.bench.pipeline as bench
    monkeypatch.setattr(bench, "alive", lambda pid: False)
    out = io.StringIO()
    result = run(Options(random_shape="tiny", anchors=False, decode_tokens=2, repeats=1,
                         threads=(1,), prompts=("a",), prefill_tokens=0, hogs=1,
                         hog_deadline=5.0), out)
    assert "the hogs reached their deadline (5 s) before the measurement ended" in \
        out.getvalue()
    assert result["targets"][-1].met is None
    assert _running_hogs() == []


def test_hogs_0_skips_table_d(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "pipeline", "--quick", "--random-weights", "tiny",
                   "--anchors", "off", "--threads", "1", "--stages", "0", "--hogs", "0",
                   "--prefill-tokens", "0"])
    out = capsys.readouterr().out
    assert status == 0
    assert "not measured (the pipeline stage runtime fills this table; --stages 0 skips it)" \
        in out
    assert _table(out, "(d) under load") == [["not measured (--hogs 0)"]]
    assert _table(out, "(a) single process")[1][-1] == "-"


def test_hogs_end_when_the_block_raises() -> None:
    with pytest.raises(KeyboardInterrupt), hogs.cpu_hogs(2, deadline=60) as pids:
        assert all(hogs.alive(pid) for pid in pids)
        raise KeyboardInterrupt
    assert not any(hogs.alive(pid) for pid in pids)


def test_a_hog_ends_when_the_bench_is_killed() -> None:
    """SIGKILL runs no finally: the hogs notice their parent is gone."""
    bench = subprocess.Popen(
        [sys.executable, "-c", ("import time\nfrom pmetal.bench.hogs import cpu_hogs\n"
                                "with cpu_hogs(2, deadline=60) as pids:\n"
                                "    print(*pids, flush=True)\n    time.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(
            Path(__file__).resolve().parents[1])})
    try:
        assert bench.stdout is not None
        pids = [int(p) for p in bench.stdout.readline().split()]
        assert len(pids) == 2
        handles = [os.pidfd_open(pid) for pid in pids]
    finally:
        bench.kill()
        bench.wait()
    try:
        for handle in handles:   # readable once the process has exited
            assert select.select([handle], [], [], 10.0)[0] == [handle]
    finally:
        for handle in handles:
            os.close(handle)


def test_sealing_a_tokens_hops_is_timed_and_opens() -> None:
    """The seal cost of table (c): real frames sealed and opened (a frame
    that did not open would raise); a figure per token."""
    assert seal_cost(2400, 3) > 0


def test_the_pipeline_hook_fills_table_c() -> None:
    def pipeline(options: Options, prompts: list[list[int]]) -> list[PipelineRow]:
        assert len(prompts) == len(options.prompts) and all(prompts)
        return [PipelineRow(label="2 stages, codec int8, 1 sequence", tokens_per_s=30.0,
                            vs_single=0.9, hop_overhead_ms=0.25, bytes_per_token=1160,
                            agreement=0.975, max_logit_diff=0.0123, seal_us=40.0)]
    out = io.StringIO()
    result = run(Options(random_shape="tiny", anchors=False, decode_tokens=2, repeats=1,
                         threads=(1,), prompts=("a",), prefill_tokens=8, hogs=0,
                         pipeline=pipeline), out)
    text = out.getvalue()
    (row,) = _table(text, "(c) pipeline")[1:]
    assert row == ["2 stages, codec int8, 1 sequence", "30.0", "0.90x", "0.25", "1,160",
                   "40.0 (0.12%)", "97.5%", "0.0123"]
    assert result["pipeline"][0].tokens_per_s == 30.0


@pytest.fixture
def kernel_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The ``threads`` of every kernel call (products and prefill tiles)."""
    seen: list[int] = []
    for name in ("matmul", "dequantize"):
        real = getattr(kernels, name)

        def spy(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            seen.append(kwargs["threads"])
            return _real(*args, **kwargs)
        monkeypatch.setattr(kernels, name, spy)
    yield seen


@pytest.mark.parametrize("threads", [1, 2])
def test_the_quantized_engine_runs_on_the_threads_the_row_claims(
        kernel_threads: list[int], threads: int) -> None:
    stage, _, backend, _ = build_engine(None, "quantized", random_shape="tiny", max_threads=2)
    assert backend == "quantized"
    try:
        row = measure_single_process(stage, [[1, 2, 3], [4, 5]], decode_tokens=2, repeats=1,
                                     batch=2, threads=threads, long_prompt=list(range(40)))
    finally:
        stage.close()
    assert row.threads == threads and row.long_prefill > 0
    assert kernel_threads and set(kernel_threads) == {threads}


def test_a_thread_count_the_process_cannot_set_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pmetal.pipeline.threads as threads_module
    monkeypatch.setattr(threads_module, "set_compute_threads", lambda n: None)
    stage, *_ = build_engine(None, "quantized", random_shape="tiny")
    with pytest.raises(ConfigError, match="cannot be set to 2"):
        measure_single_process(stage, [[1, 2]], decode_tokens=2, repeats=1, batch=1,
                               threads=2)


def test_single_process_measurement_decodes_every_step() -> None:
    stage, *_ = build_engine(None, "reference", random_shape="tiny")
    try:
        row = measure_single_process(stage, [[1, 2, 3], [4, 5]], decode_tokens=3, repeats=2,
                                     batch=3, threads=1)
    finally:
        stage.close()
    assert row.threads == 1 and row.batch == 3 and row.long_prefill == 0.0
    assert 0 < row.prefill <= row.first_token
    assert row.decode_tps > 0 and row.batch_tps > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--threads", "0"], "thread counts are positive"),
    (["--threads", "two"], "write thread counts"),
    (["--prompts", "9"], f"choose 1 to {len(PROMPTS)}"),
    (["--tokens", "1"], "at least 2 tokens"),
    (["--hogs", "-1"], "0 (skip) or more"),
    (["--prefill-tokens", "-5"], "0 (skip) or more"),
    (["--prefill-tokens", "300"], "the model's context is 256 tokens"),
    (["--backend", "cuda"], "choose from auto, quantized, reference, mlx"),
])
def test_bad_options_are_usage_errors(argv: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "pipeline", "--random-weights", "tiny", "--anchors", "off",
                 *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
