"""The page's script on its own: pipelines, collectives and links from a
snapshot, and its fallback to polling when there is no event stream.

A small HTTP server in this process serves the package's static files (as
the node does) and a snapshot in the node's format
(:mod:`pmetal.dashboard.snapshot`) whose telemetry grows by a fixed amount
at each request; ``/api/events`` answers 404, as a proxy that refuses
streams would. The real node's snapshot and stream are tested in
test_dashboard.py and test_dashboard_lab.py; this test covers what their
clusters do not run (pipelines, collectives, probed bandwidth).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from dashboard.browser import attribute, screenshot, text, texts, wait_for
from pmetal.dashboard.server import STATIC

A, B, C = "a1" * 16, "b2" * 16, "c3" * 16
GiB = 1 << 30


def machine(node_id: str, n: int, **kw: Any) -> dict[str, Any]:
    return {"node_id": node_id, "address": f"tcp://192.168.1.{n}:52416", "health": "healthy",
            "master": False, "self": False, "rtt_ms": 0.41, "silent_s": 0.1,
            "profile": {"node_id": node_id, "memory_total": 64 * GiB,
                        "memory_free": 40 * GiB, "cores": 12, "chip": "Apple M2 Max",
                        "gflops": 90.0, "gpus": 1},
            "resources": {"CPU": 12.0, "GPU": 1.0}, "incarnation": 1, **kw}


def actor(name: str, tail: str, state: str = "alive", restarts: int = 0) -> dict[str, Any]:
    return {"actor_id": "0" * 24 + tail, "name": name, "class_name": "PipelineStage",
            "state": state, "restarts": restarts, "restarts_left": 0, "last_error": "",
            "pid": 4242}


def snapshot(step: int) -> dict[str, Any]:
    """The node's snapshot after ``step`` requests: 50 tokens and 64 MiB of
    all-reduce per second of its clock."""
    at = 1_800_000_000.0 + step
    stage = {"index": 0, "steps": 40 + 50 * step, "seconds": 2.0 + 0.5 * step,
             "hop_bytes": 1_152 * (40 + 50 * step), "hop_seconds": 0.0004 * (40 + 50 * step)}
    stage["seconds_per_step"] = stage["seconds"] / stage["steps"]
    return {
        "at": at, "node_id": A, "namespace": "home", "master": B, "term": 12, "epoch": 5,
        "role": "follower", "dead_after_s": 0.8,
        "machines": [machine(A, 10, health="self", self=True, rtt_ms=None, workers=4,
                             node_rss=80 << 20, actors=1, queued=0,
                             available={"CPU": 10.0, "GPU": 0.0},
                             actor_list=[actor("stage0", "deadbeef")],
                             stages=[{"pipeline": "smollm2", **{k: stage[k] for k in (
                                 "index", "steps", "seconds_per_step", "hop_bytes")}}]),
                     machine(B, 11, master=True, actors=1,
                             actor_list=[actor("stage1", "0badf00d", restarts=2),
                                         actor("old", "00000001", state="dead")],
                             stages=[]),
                     machine(C, 12, health="suspect")],
        "links": [{"a": A, "b": B, "health": "healthy", "latency_ms": 0.21,
                   "bandwidth_bps": 1.12e9},
                  {"a": A, "b": C, "health": "suspect", "latency_ms": 0.35,
                   "bandwidth_bps": 9.4e8}],
        "actors": [actor("stage0", "deadbeef")],
        "telemetry": {
            "at": at, "calls": 10, "calls_failed": 0,
            "pipelines": [{"name": "smollm2", "stages": 3, "tokens": 40 + 50 * step,
                           "steps": 40 + 50 * step, "seconds": 2.0 + step,
                           "bytes_sent": 4096, "bytes_received": 8192,
                           "stage_rows": [stage],
                           "seconds_per_step": (2.0 + step) / (40 + 50 * step)}],
            "collectives": [{"group": "grads", "strategy": "ring", "operations": 10 * step,
                             "bytes": (64 << 20) * step, "seconds": 0.5 * step}],
            "processes": [{"role": "actor", "processes": 3, "cpu_seconds": 12.5,
                           "resident_bytes": 300 << 20}],
        },
        "events": [{"seq": 3, "kind": "refusal", "at": at - 5, "node": "",
                    "detail": "handshake refused: bad PSK proof", "count": 7},
                   {"seq": 2, "kind": "election", "at": at - 60, "node": B,
                    "detail": "master in term 12", "count": 1}],
        "metrics": {"enabled": True, "state": "on", "address": "", "reason": "",
                    "scrapes": 0},
    }


class Handler(BaseHTTPRequestHandler):
    steps = itertools.count()

    def do_GET(self) -> None:
        if self.path == "/api/cluster":
            self.reply(200, "application/json", json.dumps(snapshot(next(self.steps))).encode())
        elif self.path == "/":
            self.reply(200, "text/html", (STATIC / "index.html").read_bytes())
        elif self.path.startswith("/static/") and "/" not in self.path[8:]:
            kind = "text/css" if self.path.endswith(".css") else "text/javascript"
            self.reply(200, kind, (STATIC / self.path[8:]).read_bytes())
        else:
            self.reply(404, "text/plain", b"no such page\n")

    def reply(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_pipelines_collectives_and_links_by_polling(
        server: str, browser: Callable[..., Any]) -> None:
    driver = browser()
    driver.get(server + "/")
    # Two polls at least: the live rates need a previous snapshot.
    shown = wait_for(driver, lambda d: "tokens/s now 50.0" in (
        t := text(d, "#pipeline-list")) and t, 10.0, "the pipeline's rate")
    assert "smollm2" in shown and "3 stages" in shown
    stage = texts(driver, "#pipeline-list tr[data-stage='0'] td")
    assert stage[0] == "0" and stage[3:] == ["1.1 KiB", "0.400 ms"]   # per step: bytes, hand-over
    assert attribute(driver, "#conn", "data-mode") == "polling"
    cells = texts(driver, "#collective-table tr[data-group='grads'] td")
    assert cells[:2] == ["grads", "ring"]
    assert cells[4] == "134 MB/s" and cells[5] == "67.1 MB/s"   # average and now
    labels = texts(driver, "#topology .link-label")
    assert sorted(labels) == ["0.210 ms · 1.12 GB/s", "0.350 ms · 940 MB/s"]
    assert attribute(driver, "#topology g.machine.master", "data-node") == B
    assert text(driver, "#event-log tr[data-kind='refusal']").endswith("×7")
    card = text(driver, "#machine-cards .card.self")
    assert "3 alive, 300 MiB resident, 12.5 s CPU" in card and "smollm2: stage 0" in card
    # Another member's card lists what it answered it hosts (its dead actors left out).
    other = f"#machine-cards .card[data-node='{B}']"
    assert texts(driver, f"{other} .hosted-actors li") == ["stage1 alive restarted 2×"]
    assert "no pipeline stage has run on this machine" in text(driver, other)
    screenshot(driver, "dashboard-telemetry", full_page=True)
