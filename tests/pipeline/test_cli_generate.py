"""``pmetal generate`` as a user runs it: a subprocess that starts its own
local node, a tiny GGUF model written to a temporary folder (fast; the
default model runs in test_default_model_pipeline.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pmetal.pipeline.generation import generate_single_process
from pmetal.pipeline.llama import LlamaStage
from pmetal.pipeline.sampling import SamplingConfig
from pmetal.pipeline.tokenizer import Tokenizer

from .tinymodel import tiny_config, write_tiny_gguf

TIMEOUT = 120.0


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, LlamaStage]:
    path = tmp_path / "tiny.gguf"
    weights = write_tiny_gguf(path, tiny_config(layers=4), seed=7)
    return path, LlamaStage(weights)


def run(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    env["PMETAL_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "pmetal", "generate", *args], env=env, check=False,
                          capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.parametrize("stages", ["1", "3"])
def test_generate_streams_the_answer_and_reports(tiny: tuple[Path, LlamaStage],
                                                 tmp_path: Path, stages: str) -> None:
    path, whole = tiny
    done = run("--model", str(path), "--prompt", "what is the capital", "--max-tokens", "12",
               "--stages", stages, home=tmp_path / "home")
    assert done.returncode == 0, done.stderr
    tok = Tokenizer.from_model(path)
    prompt = tok.encode_prompt("what is the capital")
    expected = generate_single_process(
        whole, [prompt], SamplingConfig(max_tokens=12, stop_token_ids=tuple(tok.stop_token_ids)),
        max_len=128)[0]
    shown = [t for t in expected.tokens if t not in tok.stop_token_ids]
    assert done.stdout == tok.decode(shown) + "\n"
    err = done.stderr
    assert f"as {stages} stage(s)" in err and "tokens/s" in err and "first token" in err
    assert err.count("ms per step") == int(stages)
    assert "bytes per token" in err


def test_generate_says_what_is_wrong(tmp_path: Path) -> None:
    done = run("--model", str(tmp_path / "missing.gguf"), home=tmp_path / "home")
    assert done.returncode != 0
    assert "missing.gguf" in done.stderr and "Traceback" not in done.stderr
    done = run("--stages", "0", home=tmp_path / "home")
    assert done.returncode == 2 and "--stages 0" in done.stderr
    done = run("--temperature", "-1", home=tmp_path / "home")
    assert done.returncode == 2 and "temperature" in done.stderr \
        and "Traceback" not in done.stderr
    done = run("--codec", "zip", home=tmp_path / "home")
    assert done.returncode == 2 and "invalid choice" in done.stderr
