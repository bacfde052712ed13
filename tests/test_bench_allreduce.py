"""``pmetal bench allreduce``: real rank processes over 127.0.0.1, tiny
sizes. Checks the tables' shape and that every result was right; no
timing assertions (the figures live in docs/performance.md)."""

from __future__ import annotations

import numpy as np
import pytest

from pmetal.bench.allreduce import (
    BenchSpec,
    _expected,
    _inputs,
    _measure,
    parse_size,
    sizes_between,
)
from pmetal.cli import main
from pmetal.errors import ConfigError

COLUMNS = ["size (B)", "count", "type", "redop", "time (us)", "min-max (us)",
           "algbw (GB/s)", "busbw (GB/s)", "#wrong"]


def _tables(out: str) -> dict[str, list[list[str]]]:
    """Each '# N ranks, strategy...' table's rows, split on runs of spaces."""
    tables: dict[str, list[list[str]]] = {}
    current: list[list[str]] | None = None
    for line in out.splitlines():
        if line.startswith("# 2 ranks, "):
            current = tables.setdefault(line[2:].split(",")[1].strip(), [])
        elif current is not None and line.strip() and not line.startswith("#"):
            current.append([c.strip() for c in line.strip().split("  ") if c.strip()])
        else:
            current = None
    return tables


def test_bench_allreduce_prints_a_checked_table_per_strategy(
        capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "allreduce", "--world", "2", "--min-bytes", "4",
                   "--max-bytes", "4K", "--iters", "2", "--warmup", "1", "--anchors", "off"])
    out = capsys.readouterr().out
    assert status == 0, out
    tables = _tables(out)
    assert sorted(tables) == ["auto", "naive", "ring", "tree"]
    for name, rows in tables.items():
        header, *body = rows
        assert header == COLUMNS + (["picks"] if name == "auto" else [])
        assert [int(r[0]) for r in body] == [4, 16, 64, 256, 1024, 4096]
        for row in body:
            assert int(row[1]) == int(row[0]) // 4 and row[2:4] == ["float", "sum"]
            assert float(row[4].replace(",", "")) > 0
            assert row[8] == "0", f"{name}: wrong results at {row[0]} bytes"
        if name == "auto":
            assert {r[9] for r in body} <= {"ring", "tree", "naive"}
    assert "First operation of a fresh group" in out
    assert "4 KiB all_reduce time (us)" in out and "anchors README" in out


class _SumComm:
    """Stands in for the other ranks so the checker itself can be tested:
    adds what they would have contributed, and spoils element 0 when asked."""

    def __init__(self, world: int, spoil: bool) -> None:
        self.world, self.spoil = world, spoil

    def wrap(self, buffer: np.ndarray) -> np.ndarray:
        return buffer

    def all_reduce(self, buffer: np.ndarray, strategy: str, sealed: bool = False) -> None:
        n = buffer.size
        for rank in range(1, self.world):
            buffer += _inputs(n, rank)
        if self.spoil:
            buffer[0] += 1

    def barrier(self) -> None:
        pass


@pytest.mark.parametrize("spoil, wrong", [(False, 0), (True, 3 * 10)])
def test_the_checker_counts_every_wrong_element(spoil: bool, wrong: int) -> None:
    spec = BenchSpec(world=3, sizes=(65536,), strategies=("ring", "auto"), iters=2,
                     warmup=1)
    got = _measure(_SumComm(3, spoil), spec, 65536, _inputs(16384, 0), _expected(16384, 3))
    for strategy in ("ring", "auto"):
        assert got[strategy]["wrong"] == wrong   # 3 repetitions x 10 operations
        assert len(got[strategy]["times"]) == 2


def test_sizes_and_their_spelling() -> None:
    assert sizes_between(4, 64 * 1024 * 1024)[-1] == 64 * 1024 * 1024
    assert len(sizes_between(4, 64 * 1024 * 1024)) == 13
    assert [parse_size(s) for s in ("4", "1K", "64M", "64MiB", "2KB")] == [
        4, 1024, 64 << 20, 64 << 20, 2048]
    with pytest.raises(ConfigError, match="multiple of 4"):
        BenchSpec(world=2, sizes=(6,))
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        BenchSpec(world=1, sizes=(4,))


def test_bad_options_are_usage_errors_before_anything_runs(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "allreduce", "--strategy", "ring,fastest"]) == 2
    assert "choose among" in capsys.readouterr().err
    assert main(["bench", "allreduce", "--world", "2,1"]) == 2
    captured = capsys.readouterr()
    assert "at least 2 ranks" in captured.err and captured.out == ""


def test_sealed_both_prints_clear_against_sealed(capsys: pytest.CaptureFixture[str]) -> None:
    """``--sealed both``: the same sizes over TCP links in clear and sealed
    (a second group with link_encryption on, in the same rank processes,
    taking turns), every result checked, then the two side by side."""
    status = main(["bench", "allreduce", "--world", "2", "--min-bytes", "1M",
                   "--max-bytes", "1M", "--strategy", "auto",
                   "--sealed", "both", "--iters", "1", "--warmup", "0", "--anchors", "off"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "# 2 ranks, auto, TCP 127.0.0.1 (TcpLinks): " in out
    assert "# 2 ranks, auto, sealed, TCP 127.0.0.1 (TcpLinks, sealed): " in out
    title = ("# 2 ranks, auto: TCP links in clear against sealed (AES-256-GCM), taking turns "
             "in one run")
    assert title in out
    header, *rows = [line.split() for line in out.split(title)[1].strip().split("\n\n")[0]
                     .splitlines()[:2]]
    assert [int(r[0]) for r in rows] == [1 << 20]
    assert all(r[3].endswith("x") for r in rows)
