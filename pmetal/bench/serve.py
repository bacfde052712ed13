"""``pmetal bench serve``: what ``pmetal serve`` gives concurrent clients on
this machine, against llama.cpp's OpenAI server on the same GGUF file.

For each client count (1, 4 and 16 by default) that many clients, each an
asyncio task with its own HTTP connection, send streamed chat requests one
after the other (``requests`` in all, spread evenly), every request asking
for ``tokens`` new tokens (greedy, ``ignore_eos`` so that every answer has
the same length). Measured per level: the aggregate decode throughput
(completion tokens of every request over the wall time of the level),
time to first token (request sent to first content chunk) as the median and
the 90th percentile, and for pmetal the most sequences one decode step
carried (the batcher's ``widest_hop``). One request before the levels warms
both servers up and is not counted.

A baseline without HTTP comes first, in the same sitting: for each client
count, that many of the same prompts through ``Pipeline.generate`` at once
(no server, no tokenizing per token, no event loop), so that what the
server costs is told apart from what the machine gives (figures taken on a
busy machine move together).

pmetal's server runs in this process over a pipeline of ``stages`` stage
actors on a local node (as ``pmetal serve`` runs it); llama.cpp's is
``python -m llama_cpp.server`` (llama-cpp-python[server]) started as a
subprocess on a free loopback port when it is installed ("not installed"
otherwise). That server answers one request at a time (a lock around its
one llama.cpp context): concurrent clients queue, which is what a user of
it gets. It may ignore ``ignore_eos`` and ``stream_options``: its tokens are
then counted as the content chunks it streamed (one per token). Every
request goes to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["Options", "Row", "llama_cpp_server_state", "measure", "parse_clients", "run"]

PROMPTS = ("What is the capital of France?",
           "Write a haiku about the sea.",
           "Explain in one sentence what a CPU cache is.",
           "List three prime numbers.")
_REQUEST_TIMEOUT = 300.0


@dataclass(frozen=True)
class Options:
    model: str
    stages: int = 2
    clients: tuple[int, ...] = (1, 4, 16)
    requests: int = 16          # per client count, at least one per client
    tokens: int = 64
    anchors: bool = True
    markdown: bool = False
    command: str = "pmetal bench serve"


@dataclass(frozen=True)
class Row:
    server: str
    clients: int
    requests: int
    tokens: int
    seconds: float
    ttft_median: float
    ttft_p90: float
    widest_hop: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


async def _one(session: Any, url: str, model: str, prompt: str, tokens: int,
               headers: dict[str, str]) -> tuple[float, int]:
    """(time to first token, completion tokens) of one streamed request."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first: float | None = None
    used = chunks = 0
    async with session.post(f"{url}/v1/chat/completions", json=body,
                            headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url} failed mid-stream: {chunk['error']}")
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - sent
            if chunk.get("usage"):
                used = int(chunk["usage"]["completion_tokens"])
    return (first if first is not None else time.perf_counter() - sent), used or chunks


async def _level(url: str, model: str, clients: int, requests: int, tokens: int,
                 headers: dict[str, str]) -> tuple[float, list[float], int]:
    import aiohttp

    per_client = max(1, math.ceil(requests / clients))
    ttfts: list[float] = []
    total = 0
    timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT)

    async def client(index: int) -> None:
        nonlocal total
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for k in range(per_client):
                prompt = PROMPTS[(index + k) % len(PROMPTS)]
                ttft, used = await _one(session, url, model, prompt, tokens, headers)
                ttfts.append(ttft)
                total += used

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for index in range(clients):
            group.create_task(client(index))
    return time.perf_counter() - started, ttfts, total


def measure(url: str, model: str, server: str, clients: int, requests: int, tokens: int, *,
            headers: dict[str, str] | None = None, batcher: Any = None) -> Row:
    """One client count against the server at ``url`` (loopback)."""
    if batcher is not None:
        batcher.loop.widest = 0     # the most sequences per step of this level alone
    seconds, ttfts, total = asyncio.run(_level(url, model, clients, requests, tokens,
                                               headers or {}))
    ttfts.sort()
    widest = None if batcher is None else batcher.loop.widest
    return Row(server, clients, len(ttfts), total, seconds, statistics.median(ttfts),
               ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)], widest)


def _direct(pipe: Any, clients: int, tokens: int) -> Row:
    """``clients`` prompts through ``Pipeline.generate`` at once."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(clients)]
    before = pipe.loop.widest
    pipe.loop.widest = 0
    started = time.perf_counter()
    results = pipe.generate(prompts, max_tokens=tokens, ignore_eos=True)
    seconds = time.perf_counter() - started
    widest, pipe.loop.widest = pipe.loop.widest, max(before, pipe.loop.widest)
    ttfts = sorted(r.time_to_first_token or 0.0 for r in results)
    return Row("Pipeline.generate", clients, len(results), sum(len(r.tokens) for r in results),
               seconds, statistics.median(ttfts),
               ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)], widest)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_cpp_server_state(model: str) -> str:
    """Why llama.cpp's server cannot run, or '' when it can."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "not installed (pip install 'llama-cpp-python[server]')"
    if importlib.util.find_spec("llama_cpp.server") is None \
            or importlib.util.find_spec("uvicorn") is None:
        return "its server is not installed (pip install 'llama-cpp-python[server]')"
    if not model.endswith(".gguf") or not os.path.isfile(model):
        return f"no GGUF model file ({model})"
    return ""


def _llama_cpp_rows(options: Options, say: Any) -> list[Row]:
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as log:    # its log: a pipe could fill up
        return _llama_cpp_server(options, say, log)


def _llama_cpp_server(options: Options, say: Any, log: Any) -> list[Row]:
    import urllib.request

    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", options.model,
         "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
         "--n_threads", str(os.cpu_count() or 1), "--model_alias", "llama.cpp"],
        stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"llama.cpp's server exited: {log.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("llama.cpp's server did not start within 120 s") \
                        from None
                time.sleep(0.2)
        asyncio.run(_level(url, "llama.cpp", 1, 1, 4, {}))     # warm-up
        rows = []
        for clients in options.clients:
            say(f"llama.cpp server, {clients} client(s)")
            rows.append(measure(url, "llama.cpp", "llama.cpp", clients,
                                max(options.requests, clients), options.tokens))
        return rows
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def run(options: Options, out: TextIO | None = None) -> list[Row]:
    """Measure pmetal's server (and llama.cpp's) and print the table."""
    import pmetal
    from pmetal.bench.report import _grid, _load
    from pmetal.pipeline.pipeline import Pipeline
    from pmetal.serve.server import OpenAIServer, ServerThread, served_name

    stream = sys.stdout if out is None else out

    def say(text: str) -> None:
        print(f"pmetal bench serve: {text} ...", file=sys.stderr, flush=True)

    anchor = llama_cpp_server_state(options.model) if options.anchors else \
        "not run (--anchors off)"
    rows: list[Row] = []
    started = not pmetal.is_initialized()
    if started:
        pmetal.init(num_workers=max(options.stages, 2))
    try:
        with Pipeline.from_pretrained(options.model, stages=options.stages) as pipe:
            pipe.generate(PROMPTS[0], max_tokens=4)     # warm-up
            for clients in options.clients:
                say(f"Pipeline.generate, {clients} sequence(s) at once")
                rows.append(_direct(pipe, clients, options.tokens))
            server = OpenAIServer(pipe, model_id=served_name(options.model),
                                  max_running=max(options.clients),
                                  max_waiting=max(options.clients))
            with ServerThread(server) as url:
                asyncio.run(_level(url, server.model_id, 1, 1, 4, {}))     # warm-up
                for clients in options.clients:
                    say(f"pmetal serve, {options.stages} stage(s), {clients} client(s)")
                    rows.append(measure(url, server.model_id, "pmetal serve", clients,
                                        max(options.requests, clients), options.tokens,
                                        batcher=server.batcher))
    finally:
        if started:
            pmetal.shutdown()
    if not anchor:
        rows += _llama_cpp_rows(options, say)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    md = options.markdown
    print("\n".join([
        (f"# pmetal bench serve, {now}: streamed chat requests, {options.tokens} tokens "
         "each (greedy, ignore_eos)"),
        f"# command: {options.command}",
        (f"# pmetal {pmetal.__version__}, Python {platform.python_version()}, "
         f"{os.cpu_count()} CPUs, load average {_load()}"),
        f"# model: {options.model}; pmetal: {options.stages} stage(s) on this machine",
        (f"# llama.cpp server: "
         f"{anchor or 'llama-cpp-python, one process, one request at a time'}"),
        "",
    ]), file=stream)
    print(_grid(["server", "clients", "requests", "tokens", "wall (s)", "tokens/s",
                 "first token median (ms)", "first token p90 (ms)", "most sequences per step"],
                [[r.server, str(r.clients), str(r.requests), str(r.tokens),
                  f"{r.seconds:.2f}", f"{r.tokens_per_second:.1f}",
                  f"{r.ttft_median * 1e3:.0f}", f"{r.ttft_p90 * 1e3:.0f}",
                  "-" if r.widest_hop is None else str(r.widest_hop)] for r in rows],
                md, left=1), file=stream, flush=True)
    return rows


def parse_clients(text: str) -> tuple[int, ...]:
    """``1,4,16`` as client counts."""
    from pmetal.errors import ConfigError

    try:
        counts = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise ConfigError(f"--clients {text!r}: client counts such as 1,4,16") from None
    if not counts or min(counts) < 1:
        raise ConfigError(f"--clients {text!r}: every count must be at least 1")
    return counts
