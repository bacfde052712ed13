"""``pmetal serve`` as a user runs it: a subprocess that starts its own
local node and stage workers, answers on a free port of 127.0.0.1, and
leaves nothing running after Ctrl-C; and the API key rule, checked before
anything starts."""

from __future__ import annotations

import http.client
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
from pathlib import Path

import pytest

from pmetal.errors import ConfigError
from pmetal.serve.server import check_binding, is_loopback, served_name
from pmetal.served import running_servers, serve_folder

DEADLINE = 60.0


def environment(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    env["PMETAL_HOME"] = str(home)
    env.update(extra)
    return env


def descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_binding_rule() -> None:
    for host in ("127.0.0.1", "127.8.9.10", "::1", "localhost"):
        assert is_loopback(host)
        check_binding(host, None)
    for host in ("0.0.0.0", "::", "192.0.2.1", "example.lan", ""):
        assert not is_loopback(host)
        with pytest.raises(ConfigError, match="--api-key"):
            check_binding(host, None)
        check_binding(host, "a-key")
    with pytest.raises(ConfigError, match="non-empty"):
        check_binding("127.0.0.1", "two words")
    assert served_name(None) == "smollm2-135m-instruct"
    assert served_name("/models/tiny.gguf") == "tiny"


@pytest.mark.parametrize("host", ["192.0.2.1", "0.0.0.0"])
def test_serving_beyond_loopback_without_a_key_refuses_to_start(tmp_path: Path,
                                                                host: str) -> None:
    """Refused before a node, a stage or a socket: the address is never bound."""
    done = subprocess.run([sys.executable, "-m", "pmetal", "serve", "--host", host,
                           "--model", str(tmp_path / "none.gguf")],
                          env=environment(tmp_path / "home"), capture_output=True, text=True,
                          timeout=DEADLINE, check=False)
    assert done.returncode == 2, done.stderr
    assert f"--host {host}" in done.stderr and "--api-key" in done.stderr
    assert "PMETAL_API_KEY" in done.stderr and "Traceback" not in done.stderr


def test_a_taken_port_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "pmetal", "serve", "--port", str(port),
                               "--model", str(tmp_path / "none.gguf")],
                              env=environment(tmp_path / "home"), capture_output=True,
                              text=True, timeout=DEADLINE, check=False)
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert "Traceback" not in done.stderr


def test_ctrl_c_stops_the_server_and_every_process_it_started(tiny_gguf: Path,
                                                              tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "pmetal", "serve", "--model", str(tiny_gguf), "--port", "0",
         "--stages", "2"],
        env=environment(tmp_path / "home", PMETAL_API_KEY="cli-key"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in process.stderr or ():
            lines.put(line)
        lines.put("")           # the process closed its stderr: it ended

    threading.Thread(target=read, daemon=True).start()
    try:
        url, seen = None, []
        deadline = time.monotonic() + DEADLINE
        while url is None:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line, f"pmetal serve ended before it listened:\n{''.join(seen)}"
            seen.append(line)
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)/v1", line)
            url = found.group(1) if found else None
        # Its record tells the node's dashboard where it listens (the chat page).
        [record] = running_servers(tmp_path / "home")
        assert (record.url, record.model, record.pid) == (url, "tiny", process.pid)
        assert record.api_key == "cli-key" and record.path.stat().st_mode & 0o077 == 0
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=DEADLINE)
        assert refused.value.code == 401
        request.add_header("Authorization", "Bearer cli-key")
        with urllib.request.urlopen(request, timeout=DEADLINE) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] >= 1
        started = descendants(process.pid)
        assert len(started) >= 2, "the stages' worker processes were not found"
        # Ctrl-C with a stream in flight: it ends with an error event and [DONE].
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=DEADLINE)
        connection.request("POST", "/v1/completions", json.dumps({
            "model": "tiny", "prompt": "a", "max_tokens": 120, "ignore_eos": True,
            "stream": True}), {"Authorization": "Bearer cli-key"})
        stream = connection.getresponse()
        assert stream.readline().startswith(b"data: ")
        process.send_signal(signal.SIGINT)
        rest = [line for line in stream.read().decode().splitlines() if line]
        connection.close()
        assert process.wait(timeout=DEADLINE) == 0, "".join(seen)
        assert rest[-1] == "data: [DONE]"
        assert not list(serve_folder(tmp_path / "home").iterdir()), "its record was left"
        if "error" in rest[-2]:        # (else it had just ended on its own)
            assert json.loads(rest[-2][6:])["error"]["code"] == "shutting_down"
        end = time.monotonic() + DEADLINE
        while any(alive(p) for p in started):
            assert time.monotonic() < end, f"still running: {[p for p in started if alive(p)]}"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
