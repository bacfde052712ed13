"""``pmetal bench agreement`` on a tiny quantized GGUF: the table's shape
and totals, with llama.cpp when it is installed and without; the
comparison itself on hand-made continuations."""

from __future__ import annotations

import io
import re

import pytest

from pmetal.bench.agreement import (
    Continuation,
    Options,
    compare,
    greedy,
    logit_difference,
    run,
)
from pmetal.bench.pipeline import build_engine
from pmetal.cli import main
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

CELL = re.compile(r"^\d+ \((all|gap [0-9.e+-]+)\), \d+%$")
TOTAL = re.compile(r"^\d+/\d+ whole, mean leading [0-9.]+, [0-9.]+%$")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_tiny_gguf(path, tiny_config(), quantize=True)
    return str(path)


def _rows(out: str, title: str = "Greedy agreement") -> list[list[str]]:
    """The rows under the '# <title>...' heading, split on runs of spaces."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"# {title}"))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip() or line.startswith("#"):
            break
        rows.append([c.strip() for c in line.split("  ") if c.strip()])
    return rows


def test_every_pair_with_llama_cpp(tiny_gguf: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("llama_cpp")
    assert main(["bench", "agreement", "--model", tiny_gguf, "--tokens", "6",
                 "--prompts", "3"]) == 0
    out = capsys.readouterr().out
    header, *rows, total = _rows(out)
    assert header == ["prompt", "ids", "quantized = reference", "quantized = llama.cpp",
                      "reference = llama.cpp"]
    assert [r[0] for r in rows] == ["What is the capital of France?",
                                    "Write a haiku about the sea.",
                                    "Explain in one sentence what a CPU ca..."]
    for row in rows:
        assert int(row[1]) > 0 and all(CELL.match(c) for c in row[2:]), row
    assert total[0] == "total" and all(TOTAL.match(c) for c in total[2:]), total
    header, *logits = _rows(out, "Logits at the first generated position")
    assert header == ["a - b", "mean", "std around the mean", "largest abs difference"]
    assert [r[0] for r in logits] == ["quantized - reference", "quantized - llama.cpp",
                                      "reference - llama.cpp"]
    for row in logits:
        assert 0.0 <= float(row[2]) <= float(row[3]), row


def test_without_llama_cpp_only_pmetal_engines(tiny_gguf: str) -> None:
    out = io.StringIO()
    result = run(Options(model=tiny_gguf, prompts=("Why is the sky blue?",), tokens=5,
                         anchors=False), out)
    text = out.getvalue()
    assert "# llama.cpp: not run (--anchors off)" in text
    header, row, total = _rows(text)
    assert header == ["prompt", "ids", "quantized = reference"]
    assert CELL.match(row[2]) and TOTAL.match(total[2])
    assert set(result["runs"]) == {"quantized", "reference"}
    assert list(result["logits"]) == [("quantized", "reference")]
    assert all(len(c.tokens) == 5 for runs in result["runs"].values() for c in runs)


def test_greedy_is_the_engines_own_decoding(tiny_gguf: str) -> None:
    """The same tokens as the engine's argmax, prompt fed at once or not."""
    stage, *_ = build_engine(tiny_gguf, "quantized")
    ids = [1, 40, 77, 5]
    got = greedy(stage, ids, 4)
    cache = stage.new_cache(16)
    stage.forward(stage.embed(ids[:2]), cache)
    hidden = stage.forward(stage.embed(ids[2:]), cache)
    expected = []
    for _ in range(4):
        expected.append(int(stage.logits(hidden[-1:])[0].argmax()))
        hidden = stage.forward(stage.embed(expected[-1:]), cache)
    assert list(got.tokens) == expected and all(g >= 0 for g in got.gaps)


@pytest.mark.parametrize(("a", "b", "leading", "equal", "gap"), [
    ((1, 2, 3, 4), (1, 2, 3, 4), 4, 4, None),
    ((1, 2, 3, 4), (1, 2, 9, 4), 2, 3, 0.25),
    ((7, 2, 3, 4), (1, 2, 3, 4), 0, 3, 0.5),
])
def test_compare(a: tuple[int, ...], b: tuple[int, ...], leading: int, equal: int,
                 gap: float | None) -> None:
    agreement = compare(Continuation(a, (0.5, 1.0, 0.25, 2.0)),
                        Continuation(b, (0.75, 1.0, 0.5, 0.1)))
    assert (agreement.leading, agreement.equal, agreement.total, agreement.gap) == \
        (leading, equal, 4, gap)


def test_logit_difference_splits_shift_from_spread() -> None:
    import numpy as np

    base = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    shifted = [Continuation((0,), (0.0,), base + 0.5), Continuation((0,), (0.0,), base - 1.0)]
    same = [Continuation((0,), (0.0,), base), Continuation((0,), (0.0,), base)]
    d = logit_difference(shifted, same)
    assert (d.mean, d.std, d.largest) == (pytest.approx(-0.25), pytest.approx(0.0), 1.0)


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompts", "9"], "choose 1 to 8"),
    (["--tokens", "0"], "at least 1 token"),
])
def test_bad_options_are_usage_errors(tiny_gguf: str, argv: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "agreement", "--model", tiny_gguf, *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_help_lists_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    assert "agreement" in capsys.readouterr().out
