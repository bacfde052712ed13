"""The dashboard's chat page (pmetal/dashboard/chat.py, static/chat.*) in
headless Chromium, against a real node daemon and a real ``pmetal serve``.

The node runs on loopback with its HTTP app on a free port and a home of
its own; ``pmetal serve`` runs the tiny GGUF model of tests/serve (random
weights, its byte-level tokenizer and ChatML template) with the same home,
so the node finds it by its record. The page's answer must grow in the
page as it streams and end equal to serve's own greedy answer to the same
conversation. Without serve the page says so and how to start it. A
scripted server (a real HTTP server of this test, recorded as a serve)
breaks its stream on purpose, or streams until the page stops it: the
page shows the error, and the stop reaches the server. One browser serves
the module's tests. Screenshots go to the artifacts folder
(tests/dashboard/browser.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import pytest
from aiohttp import web

from dashboard.browser import (
    attribute,
    open_browser,
    require_browser,
    screenshot,
    text,
    texts,
    wait_for,
)
from pmetal.node.process import read_ready_line
from pmetal.served import remove_record, write_record
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

START = 60.0        # deadline for a node or a server to start (a loaded 2-core box)
WAIT = 15.0         # deadline for the page to show something
SECRET = "chat-test-psk-0123456789-abcdefghijklmnopqrst"
MAX_TOKENS = 48


@dataclass
class Node:
    url: str          # the node's HTTP app: http://127.0.0.1:PORT
    home: Path
    env: dict[str, str]


def environment(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PMETAL_") or k == "PMETAL_LOG_LEVEL"}
    return {**env, "PMETAL_HOME": str(home), "PMETAL_PSK": SECRET, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lines_of(process: subprocess.Popen[str]) -> queue.Queue[str]:
    """``process``'s stderr lines as they come ("" once it closed it)."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in process.stderr or ():
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    return lines


def stop(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + START
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=WAIT) as response:
        return json.loads(response.read())


def post_json(url: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node daemon whose HTTP app (with the chat page) is on a free port."""
    home = tmp_path_factory.mktemp("chat-node")
    port = free_port()
    env = environment(home, PMETAL_METRICS_PORT=str(port))
    process = subprocess.Popen(
        [sys.executable, "-m", "pmetal.node", "--host", "127.0.0.1", "--port", "0",
         "--num-workers", "0", "--num-task-workers", "0", "--no-discovery"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        read_ready_line(process, START)

        def listening() -> bool:      # its HTTP app starts right after the ready line
            try:
                get_json(f"{url}/api/serve")
                return True
            except urllib.error.URLError:
                return False
        wait_until(listening, "the node's HTTP app")
        yield Node(url, home, env)
    finally:
        stop(process)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat-model") / "tiny.gguf"
    write_tiny_gguf(path, tiny_config(layers=4), seed=7)
    return path


@pytest.fixture(scope="module")
def serve(node: Node, tiny_gguf: Path) -> Iterator[str]:
    """``pmetal serve`` with the node's home (its own embedded node, without
    a dashboard); its base url."""
    env = {**node.env, "PMETAL_METRICS_ENABLED": "false"}
    process = subprocess.Popen(
        [sys.executable, "-m", "pmetal", "serve", "--model", str(tiny_gguf), "--port", "0",
         "--stages", "2"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, env=env)
    lines = lines_of(process)
    try:
        url, seen = None, []
        while url is None:
            line = lines.get(timeout=START)
            assert line, f"pmetal serve ended before it listened:\n{''.join(seen)}"
            seen.append(line)
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)/v1", line)
            url = found.group(1) if found else None
        yield url
    finally:
        stop(process)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module's tests (each opens /chat
    afresh): a browser's start is the slowest part of a test here."""
    require_browser()
    with open_browser() as driver:
        yield driver


def open_chat(driver: Any, node: Node, state: str) -> Any:
    """``driver`` on the node's /chat, once its serve status reads ``state``."""
    driver.get(f"{node.url}/chat")
    wait_for(driver, lambda d: d.find_element("id", "serve-status").get_attribute(
        "data-state") == state, WAIT, f"the serve status to be {state}")
    return driver


def set_field(driver: Any, field: str, value: str) -> None:
    element = driver.find_element("id", field)
    element.clear()
    element.send_keys(value)


# Records, at each change of the last answer's text, the text: the page is
# observed as it renders (each network read of the stream is one change).
OBSERVE = """
window.seen = [];
new MutationObserver(() => {
  const answers = document.querySelectorAll('.message.assistant .content');
  if (answers.length) window.seen.push(answers[answers.length - 1].textContent);
}).observe(document.getElementById('messages'),
           {subtree: true, childList: true, characterData: true});
"""


def ask(driver: Any, prompt: str, count: int, state: str = "done") -> Any:
    """Type ``prompt`` and press Enter; the ``count``-th answer, once it is ``state``."""
    driver.find_element("id", "prompt").send_keys(prompt + "\n")
    def started(d: Any) -> Any:
        answers = d.find_elements("css selector", ".message.assistant")
        return len(answers) >= count and answers[count - 1]
    answer = wait_for(driver, started, WAIT, "the answer to start")
    wait_for(driver, lambda d: answer.get_attribute("data-state") != "streaming", WAIT,
             "the answer to end")
    assert answer.get_attribute("data-state") == state, answer.text
    return answer


def text_of(driver: Any, answer: Any) -> str:
    return str(driver.execute_script(
        "return arguments[0].querySelector('.content').textContent", answer))


# ----------------------------------------------------------------- tests

def test_without_serve_the_page_says_how_to_start_it(node: Node,
                                                     browser: Any) -> None:
    status = get_json(f"{node.url}/api/serve")
    if status["servers"]:
        pytest.skip("a pmetal serve of this module already runs")
    assert status["running"] is False and "not running" in status["message"]
    code, body = post_json(f"{node.url}/api/chat", {"messages": [
        {"role": "user", "content": "hi"}]})
    assert code == 503 and body["error"]["code"] == "serve_not_running"
    driver = open_chat(browser, node, "not-running")
    assert "pmetal serve is not running" in text(driver, "#serve-status")
    assert "pmetal serve" in texts(driver, "#serve-status code")
    assert attribute(driver, "#send", "disabled") is not None
    assert driver.execute_script("return document.getElementById('nav-cluster').href") == \
        f"{node.url}/"
    screenshot(driver, "chat-serve-not-running")


def test_the_answer_streams_into_the_page_and_equals_serves(
        node: Node, serve: str, browser: Any) -> None:
    driver = open_chat(browser, node, "running")
    assert "tiny" in text(driver, "#serve-status")

    def greedy(messages: list[dict[str, str]], max_tokens: int) -> str:
        code, body = post_json(f"{serve}/v1/chat/completions", {
            "model": "tiny", "messages": messages, "temperature": 0,
            "max_tokens": max_tokens})
        assert code == 200, body
        return str(body["choices"][0]["message"]["content"])

    # A conversation: the second turn sends the first (short answers: the
    # tiny model's context is 128 tokens).
    set_field(driver, "temperature", "0")
    set_field(driver, "max-tokens", "6")
    conversation = [{"role": "user", "content": "what is the capital of country 1"}]
    first = text_of(driver, ask(driver, conversation[0]["content"], 1))
    assert first == greedy(conversation, 6)
    conversation += [{"role": "assistant", "content": first},
                     {"role": "user", "content": "and of country 2?"}]
    assert text_of(driver, ask(driver, conversation[-1]["content"], 2)) == greedy(
        conversation, 6)

    # A new conversation, and a longer answer watched as it renders.
    driver.find_element("id", "clear").click()
    set_field(driver, "max-tokens", str(MAX_TOKENS))
    driver.execute_script(OBSERVE)
    prompt = "what is the capital of country 3"
    answer = ask(driver, prompt, 1)
    shown = text_of(driver, answer)
    seen = [s for s in driver.execute_script("return window.seen") if s]
    # It grew in the page: several texts, each extending the one before.
    assert len(set(seen)) >= 2, f"the answer appeared at once: {seen!r}"
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen)) and seen[-1] == shown
    assert shown == greedy([{"role": "user", "content": prompt}], MAX_TOKENS)
    assert "tokens/s" in answer.find_element("class name", "note").text

    # serve's recent figures, as /api/serve reports them, reach the page.
    status = get_json(f"{node.url}/api/serve")
    [server] = [s for s in status["servers"] if s["url"] == serve]
    assert server["health"] == "ok" and server["model"] == "tiny"
    assert server["stats"]["recent"]["requests"] >= 6 and server["api_key"] is False
    assert [s["layers"] for s in server["pipeline"]["stages"]] == [[0, 2], [2, 4]]
    wait_for(driver, lambda d: "tokens/s" in text(d, "#serve-figures"), WAIT,
             "serve's figures")
    wait_for(driver, lambda d: "stage 1: layers 2-3" in (t := text(d, "#serve-pipeline"))
             and "ms/step" in t, WAIT, "the pipeline's stages")
    screenshot(driver, "chat-streamed-answer")


def test_a_model_error_is_shown(node: Node, serve: str, browser: Any) -> None:
    driver = open_chat(browser, node, "running")
    set_field(driver, "max-tokens", "1000")         # beyond the tiny model's 128 positions
    answer = ask(driver, "hello", 1, state="failed")
    error = answer.find_element("class name", "error").text
    assert "maximum context length is 128 tokens" in error
    screenshot(driver, "chat-model-error")


# ------------------------------------------------------- a scripted serve

class ScriptedServe:
    """A real HTTP server on 127.0.0.1 that answers as serve does, then
    either breaks the connection after two pieces (``gone``) or streams
    pieces until its client leaves (``endless``, which sets :attr:`left`)."""

    PIECES = ("Hello", ", wor")

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.left = threading.Event()
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._ready.wait(WAIT), "the scripted server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(WAIT)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({"live": 0})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] is True and body["model"] == "scripted"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def piece(text: str) -> None:
            chunk = {"choices": [{"index": 0, "delta": {"content": text},
                                  "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        for text in self.PIECES:
            await piece(text)
        if self.mode == "gone":
            assert request.transport is not None
            request.transport.abort()           # as a killed server's socket does
            return response
        try:
            while True:                          # a model that never ends
                await asyncio.sleep(0.02)
                await piece("ld")
        except ConnectionResetError:
            self.left.set()
        return response


@pytest.fixture
def scripted(node: Node) -> Iterator[Callable[[str], ScriptedServe]]:
    """Starts scripted servers recorded in the node's home (as serve
    records itself); each is unrecorded and stopped at the end."""
    started: list[tuple[ScriptedServe, Path]] = []

    def start(mode: str) -> ScriptedServe:
        server = ScriptedServe(mode).__enter__()
        started.append((server, write_record(server.url, "scripted", None, home=node.home)))
        return server

    try:
        yield start
    finally:
        for server, record in started:
            remove_record(record)
            server.__exit__()


def choose(driver: Any, url: str) -> None:
    """Pick the server at ``url`` in the page (the select shows when
    several run: the real serve of this module may run too)."""
    wait_for(driver, lambda d: d.execute_script(
        "return [...document.getElementById('server').options].some(o => o.value === "
        "arguments[0])", url), WAIT, "the scripted server to be listed")
    driver.execute_script("const s = document.getElementById('server'); s.value = "
                          "arguments[0]; s.dispatchEvent(new Event('change'));", url)


def test_a_server_gone_mid_answer_is_shown(node: Node, scripted: Callable[[str], ScriptedServe],
                                           browser: Any) -> None:
    server = scripted("gone")
    driver = open_chat(browser, node, "running")
    choose(driver, server.url)
    answer = ask(driver, "hi", 1, state="failed")
    assert text_of(driver, answer) == "".join(ScriptedServe.PIECES)
    error = answer.find_element("class name", "error").text
    assert "went away in the middle of the answer" in error and server.url in error
    screenshot(driver, "chat-serve-gone")


def test_stop_ends_the_answer_and_reaches_the_server(
        node: Node, scripted: Callable[[str], ScriptedServe],
        browser: Any) -> None:
    server = scripted("endless")
    driver = open_chat(browser, node, "running")
    choose(driver, server.url)
    driver.find_element("id", "prompt").send_keys("go on forever\n")
    wait_for(driver, lambda d: d.find_elements("css selector", ".message.assistant .content")
             and "Hello, world" in d.find_element("css selector",
                                                   ".message.assistant .content").text,
             WAIT, "the answer to stream")
    driver.find_element("id", "stop").click()
    answer = driver.find_element("css selector", ".message.assistant")
    wait_for(driver, lambda d: answer.get_attribute("data-state") == "stopped", WAIT,
             "the answer to stop")
    assert server.left.wait(WAIT), "the node kept the server's stream open after the stop"
    assert driver.find_element("id", "stop").get_attribute("disabled") is not None
    screenshot(driver, "chat-stopped")


def test_the_chat_call_refuses_what_it_must_not_forward(
        node: Node, scripted: Callable[[str], ScriptedServe]) -> None:
    """Only JSON, only the chat's fields, and only to a recorded server."""
    server = scripted("gone")

    def post(body: bytes, kind: str = "application/json") -> tuple[int, Any]:
        request = urllib.request.Request(f"{node.url}/api/chat", data=body, method="POST",
                                         headers={"Content-Type": kind})
        try:
            with urllib.request.urlopen(request, timeout=WAIT) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())["error"]

    messages = [{"role": "user", "content": "hi"}]
    code, error = post(json.dumps({"messages": messages}).encode(), "text/plain")
    assert code == 415 and error["code"] == "unsupported_media_type"
    code, error = post(b"{not json")
    assert code == 400 and error["code"] == "invalid_json"
    code, error = post(json.dumps({"messages": messages, "model": "x"}).encode())
    assert code == 400 and error["param"] == "model" and "unknown fields" in error["message"]
    code, error = post(json.dumps({"messages": messages,
                                   "server": "http://192.0.2.1:80"}).encode())
    assert code == 404 and error["code"] == "unknown_server" and server.url in error["message"]


def test_the_chat_is_behind_the_dashboards_guard(node: Node) -> None:
    """A browser here that reached the node under another site's name (DNS
    rebinding) gets 403 from the chat's routes as from the dashboard's
    (pmetal/dashboard/auth.py); its address and localhost work."""
    for path in ("/chat", "/api/serve", "/static/chat.js"):
        for host, status in (("evil.example:8265", 403), (node.url.removeprefix("http://"), 200),
                             ("localhost:1", 200)):
            request = urllib.request.Request(f"{node.url}{path}", headers={"Host": host})
            try:
                with urllib.request.urlopen(request, timeout=WAIT) as response:
                    code = response.status
            except urllib.error.HTTPError as exc:
                code = exc.code
            assert code == status, (path, host)


def test_a_recorded_server_that_does_not_answer(node: Node) -> None:
    """A record whose process lives but whose address answers nothing (a
    server still starting, or a pid reused): said so, and 502 to a chat."""
    url = f"http://127.0.0.1:{free_port()}"          # nothing listens there
    record = write_record(url, "silent", None, home=node.home)
    try:
        status = get_json(f"{node.url}/api/serve")
        [server] = [s for s in status["servers"] if s["url"] == url]
        assert server["health"] == "unreachable" and server["error"]
        if len(status["servers"]) == 1:
            assert status["running"] is False and "it does not answer" in status["message"]
        code, body = post_json(f"{node.url}/api/chat", {
            "messages": [{"role": "user", "content": "hi"}], "server": url})
        assert code == 502 and body["error"]["code"] == "serve_unreachable"
        assert url in body["error"]["message"]
    finally:
        remove_record(record)
