"""The server when its pipeline breaks: a stage killed mid-stream ends
the stream with an error event, /health says so, new requests get 503.
(A module of its own: it breaks its pipeline.)"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.serve.conftest import DEADLINE, Served
from tests.serve.test_server import assert_error, get, post


@pytest.fixture(scope="module")
def expected() -> dict[Any, Any]:
    """No answers to compare with here: nothing to generate first."""
    return {}


def test_a_stage_killed_mid_stream_fails_the_stream_and_later_requests(
        serve: Callable[..., Served]) -> None:
    served = serve()
    connection = http.client.HTTPConnection(served.server.host, served.server.port,
                                            timeout=DEADLINE)
    connection.request("POST", "/v1/completions", json.dumps({
        "model": "tiny", "prompt": "a", "max_tokens": 120, "stream": True,
        "ignore_eos": True}), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.readline().startswith(b"data: ")
    pid = served.pipe.statistics()["stages"][1]["pid"]
    os.kill(pid, signal.SIGKILL)
    rest = response.read().decode()
    connection.close()
    events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "generation_failed"
    assert "stage 1" in error["message"], error
    deadline = time.monotonic() + DEADLINE
    while served.server.batcher.statistics().broken is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    status, body = get(served, "/health")
    assert status == 503 and body["status"] == "broken" and "stage 1" in body["error"]
    status, body = post(served, "/v1/completions", {"model": "tiny", "prompt": "hi"})
    assert_error(status, body, 503, code="pipeline_unavailable", kind="server_error")
