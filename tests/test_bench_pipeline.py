"""``pmetal bench pipeline`` end to end on a tiny random model (quick
mode): the tables' shape and that every figure is a positive number; no
timing assertions (the figures live in docs/performance.md)."""

from __future__ import annotations

import io

import pytest

import pmetal
from pmetal.bench.pipeline import (
    Options,
    PipelineRow,
    measure_single_process,
    random_weights,
    run,
)
from pmetal.cli import main
from pmetal.pipeline.llama import LlamaStage

SINGLE_HEADER = ["threads", "prefill (ms)", "first token (ms)",
                 "decode tok/s, 1 sequence", "aggregate tok/s, 4 batched"]


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


def test_quick_mode_prints_every_table(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "pipeline", "--quick", "--random-weights", "tiny",
                   "--anchors", "off", "--threads", "1,2"])
    out = capsys.readouterr().out
    assert status == 0, out
    header, *rows = _table(out, "(a) single process")
    assert header == SINGLE_HEADER
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
    for row in rows[2:]:                                     # agreement and logit difference
        assert row[5].endswith("%") and float(row[6]) >= 0.0
    targets = _table(out, "Targets")
    assert targets[0] == ["measure", "pmetal", "target", "met"]
    assert targets[2][-1] == "not measured (no anchor)"
    assert [t[0] for t in targets[3:]] == [f"pipeline: {r[0]} (x single process)"
                                           for r in rows[:2]]
    assert "--quick" in out and "random float32 weights of the tiny shape" in out
    assert not pmetal.is_initialized()       # the local node it started is gone


def test_stages_0_skips_the_pipeline_table(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "pipeline", "--quick", "--random-weights", "tiny",
                   "--anchors", "off", "--threads", "1", "--stages", "0"])
    assert status == 0
    assert "not measured (the pipeline stage runtime fills this table; --stages 0 skips it)" in \
        capsys.readouterr().out


def test_the_pipeline_hook_fills_table_c() -> None:
    def pipeline(options: Options, prompts: list[list[int]]) -> list[PipelineRow]:
        assert len(prompts) == len(options.prompts) and all(prompts)
        return [PipelineRow(label="2 stages, codec int8, 1 sequence", tokens_per_s=30.0,
                            vs_single=0.9, hop_overhead_ms=0.25, bytes_per_token=1160,
                            agreement=0.975, max_logit_diff=0.0123)]
    out = io.StringIO()
    result = run(Options(weights=random_weights("tiny"), anchors=False, decode_tokens=2,
                         repeats=1, threads=(1,), prompts=("a",), pipeline=pipeline), out)
    text = out.getvalue()
    (row,) = _table(text, "(c) pipeline")[1:]
    assert row == ["2 stages, codec int8, 1 sequence", "30.0", "0.90x", "0.25", "1,160",
                   "97.5%", "0.0123"]
    assert result["pipeline"][0].tokens_per_s == 30.0


def test_single_process_measurement_decodes_every_step() -> None:
    weights, _ = random_weights("tiny")(None)
    stage = LlamaStage(weights)
    row = measure_single_process(stage, [[1, 2, 3], [4, 5]], decode_tokens=3, repeats=2,
                                 batch=3, threads=1)
    assert row.threads == 1 and row.batch == 3
    assert 0 < row.prefill <= row.first_token
    assert row.decode_tps > 0 and row.batch_tps > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--threads", "0"], "thread counts are positive"),
    (["--threads", "two"], "write thread counts"),
    (["--prompts", "9"], "choose 1 to 4"),
    (["--tokens", "1"], "at least 2 tokens"),
])
def test_bad_options_are_usage_errors(argv: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "pipeline", "--random-weights", "tiny", "--anchors", "off",
                 *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
