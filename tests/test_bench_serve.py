"""``pmetal bench serve`` as a user runs it, on a tiny GGUF model with few
tokens (the figures themselves go to docs/performance.md, never into an
assertion)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pmetal.bench.serve import llama_cpp_server_state, parse_clients
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf


def test_bench_serve_prints_a_row_per_client_count(tmp_path: Path) -> None:
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, tiny_config(layers=4), seed=7)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    env["PMETAL_HOME"] = str(tmp_path / "home")
    done = subprocess.run(
        [sys.executable, "-m", "pmetal", "bench", "serve", "--model", str(model),
         "--clients", "1,3", "--requests", "3", "--tokens", "4", "--anchors", "off",
         "--markdown"],
        env=env, capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "# command: pmetal bench serve --model" in out and "--clients 1,3" in out
    assert "llama.cpp server: not run (--anchors off)" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    served = [r for r in rows if r[0].strip() == "pmetal serve"]
    direct = [r for r in rows if r[0].strip() == "Pipeline.generate"]
    assert [int(r[1]) for r in served] == [1, 3] and [int(r[1]) for r in direct] == [1, 3]
    assert [int(r[3]) for r in direct] == [4, 12]
    for row in served:
        requests, tokens = int(row[2]), int(row[3])
        assert requests == 3 and tokens == 3 * 4       # ignore_eos: every answer is whole
        assert float(row[5]) > 0                         # tokens/s
        assert int(row[8]) >= 1                          # most sequences per step


def test_bench_serve_checks_its_options() -> None:
    assert parse_clients("1,4,16") == (1, 4, 16)
    for bad in ("", "0,2", "a"):
        try:
            parse_clients(bad)
        except ValueError as exc:
            assert "--clients" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")
    assert llama_cpp_server_state("/nonexistent.gguf") != ""
