"""``pmetal bench seal``: the two AEADs on real buffers, then one real TCP
link on 127.0.0.1 in clear and sealed (every byte received checked). No
timing assertions: the figures live in docs/performance.md."""

from __future__ import annotations

import pytest

from pmetal.cli import main


def test_bench_seal_prints_both_tables(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "seal", "--bytes", "1M", "--message", "256K", "--repeats", "1"])
    out = capsys.readouterr().out
    assert status == 0, out
    for cipher in ("AES-256-GCM", "ChaCha20-Poly1305"):
        assert [line.split()[1] for line in out.splitlines() if line.startswith(cipher)] == [
            "2,304", "262,144", "1,048,576"]
    links = {line.split()[0]: line.split() for line in out.splitlines()
             if line.startswith(("clear ", "sealed "))}
    assert sorted(links) == ["clear", "sealed"]
    assert links["clear"][1:3] == ["1,048,576", "262,144"] and links["clear"][5] == "1.00x"


def test_bad_sizes_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "seal", "--bytes", "1K", "--message", "4K"]) == 2
    assert "at most --bytes" in capsys.readouterr().err
