"""Fixtures of the server tests: a pipeline of real stage actors over a
tiny GGUF model (random weights, the tiny byte-level tokenizer and ChatML
template of tests/pipeline/tinymodel.py), the greedy answers
``Pipeline.generate`` gives for the prompts the tests send, and a fresh
:class:`~pmetal.serve.OpenAIServer` on a free port of 127.0.0.1 per test."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import pmetal
from pmetal.config import load_config
from pmetal.pipeline.batching import ContinuousBatcher
from pmetal.pipeline.pipeline import Pipeline
from pmetal.pipeline.sampling import SamplingConfig
from pmetal.serve.server import OpenAIServer, ServerThread
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

MAX_TOKENS = 12
PROMPTS = [f"what is the capital of country {i}" for i in range(16)]
DEADLINE = 30.0


@dataclass
class Served:
    url: str
    server: OpenAIServer
    pipe: Pipeline

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serve-model") / "tiny.gguf"
    write_tiny_gguf(path, tiny_config(layers=4), seed=7)
    return path


@pytest.fixture(scope="module")
def pipe(tiny_gguf: Path) -> Iterator[Pipeline]:
    if pmetal.is_initialized():
        pmetal.shutdown(timeout=3.0)
    pmetal.init(num_workers=2, config=load_config(
        transport={"handshake_timeout": 2.0, "request_timeout": 10.0}))
    try:
        with Pipeline.from_pretrained(str(tiny_gguf), stages=2, max_len=128,
                                      threads=1) as pipeline:
            yield pipeline
    finally:
        pmetal.shutdown(timeout=3.0)


@pytest.fixture(scope="module")
def expected(pipe: Pipeline) -> dict[tuple[str, bool], Any]:
    """Each prompt's lone greedy answer from Pipeline.generate, as chat
    and as plain text (before any server holds the pipeline's loop)."""
    out = {}
    for i, prompt in enumerate(PROMPTS):
        for chat in (True, False) if i < 3 else (True,):
            out[prompt, chat] = pipe.generate(prompt, max_tokens=MAX_TOKENS, chat=chat)[0]
    return out


@pytest.fixture
def serve(pipe: Pipeline, expected: Any) -> Iterator[Callable[..., Served]]:
    """Starts a server over the pipeline (options as OpenAIServer's); at
    most one at a time holds the pipeline's loop, each closed at the end."""
    running: list[ServerThread] = []

    def start(**options: Any) -> Served:
        for thread in running:
            thread.close()
        server = OpenAIServer(pipe, **options)
        thread = ServerThread(server)
        running.append(thread)
        return Served(thread.__enter__(), server, pipe)

    try:
        yield start
    finally:
        for thread in running:
            thread.close()


class Gate:
    """A sequence of the server's batcher whose token callback holds the
    batcher's thread until :meth:`open`: requests sent meanwhile queue up
    and are admitted together, deterministically."""

    def __init__(self, batcher: ContinuousBatcher) -> None:
        self.batcher = batcher
        self.held = threading.Event()
        self._release = threading.Event()
        self.sid = batcher.submit([5, 6, 7], SamplingConfig(max_tokens=100), max_len=110,
                                  on_token=self._hold)
        assert self.held.wait(DEADLINE), "the gate sequence got no token"

    def _hold(self, _sid: int, _token: int) -> None:
        self.held.set()
        self._release.wait(DEADLINE)

    def open(self) -> None:
        self.batcher.cancel(self.sid)
        self._release.set()
