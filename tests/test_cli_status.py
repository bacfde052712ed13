"""``pmetal status`` for a person, and ``pmetal status --watch``: real nodes
on 127.0.0.1, each command a real process with a private PMETAL_HOME.

The picture must name every member and the master, list every member's
actors, fit 80 columns, and keep saying what it sees when nodes die: a
frame never waits longer than the status deadline, and a watch bounded by
``--count`` prints exactly that many frames.
"""

from __future__ import annotations

import json
import os
import pty
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pmetal.cli import main
from pmetal.cli.picture import picture
from test_cli_daemon import (COMMAND_TIMEOUT, _env, _kill_recorded_node, _status, _wait_gone,
                             home, pmetal)

__all__ = ["home"]   # the fixture, imported for the tests below

WAIT = 15.0
"""Deadline of one wait on the cluster (a join, a death seen)."""
QUIET = {"PMETAL_METRICS_ENABLED": "false"}
"""Nodes of these tests serve no metrics (no port to share between them)."""


def _start(folder: Path, *args: str) -> dict[str, Any]:
    started = pmetal(folder, "start", "--port", "0", "--no-discovery", *args, **QUIET)
    assert started.returncode == 0, started.stderr
    return json.loads((folder / "node.json").read_text())


def _two_nodes(home: Path, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """Two nodes that know each other (the second names the first), once
    the first lists the second as a member."""
    other = tmp_path / "other-home"
    key = tmp_path / "shared.psk"
    assert main(["keygen", "--out", str(key)]) == 0
    first = _start(home, "--psk-file", str(key))
    second = _start(other, "--psk-file", str(key), "--peers",
                    first["address"].removeprefix("tcp://"))
    deadline = time.monotonic() + WAIT
    while len(_status(home)["cluster"]["members"]) < 2 or not _status(home)["cluster"]["master"]:
        assert time.monotonic() < deadline, "the second node never joined"
        time.sleep(0.1)
    return first, second, other


def _frames(text: str) -> list[str]:
    return [f for f in text.split("pmetal status   every ")[1:]]


# ------------------------------------------------------------- the picture

ACTOR = """
import pmetal
pmetal.init(address="auto")

@pmetal.remote
class Keeper:
    def where(self):
        return pmetal.get_runtime_context().get_node_id()

k = Keeper.options(name="keeper_of_the_second_node", lifetime="detached").remote()
print(pmetal.get(k.where.remote(), timeout=20))
"""


def test_picture_names_every_member_the_master_and_every_members_actors(
        home: Path, tmp_path: Path) -> None:
    first, second, other = _two_nodes(home, tmp_path)
    try:
        driver = subprocess.run([sys.executable, "-c", ACTOR], env=_env(other, **QUIET),
                                text=True, capture_output=True, timeout=COMMAND_TIMEOUT,
                                check=False)
        assert driver.returncode == 0, driver.stderr
        runs_on = driver.stdout.split()[-1]
        status = _status(home)
        master = status["cluster"]["master"]
        assert master in (first["node_id"], second["node_id"])
        # Every member's actors, asked of them: the first node lists the
        # actor wherever the master placed it.
        [listed] = [a for a in status["cluster_actors"]
                    if a["name"] == "keeper_of_the_second_node"]
        assert listed["node_id"] == runs_on and listed["state"] == "alive"

        text = pmetal(home, "status")
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        assert all(len(line) <= 80 for line in lines), \
            [line for line in lines if len(line) > 80]
        assert f"master     {master}" in text.stdout
        nodes = lines.index(next(line for line in lines if line.startswith("NODES (2)")))
        rows = lines[nodes + 2:nodes + 4]
        for node in (first, second):
            [row] = [r for r in rows if r.split()[0].rstrip("*") == node["node_id"][:8]]
            assert row.split()[0].endswith("*") == (node["node_id"] == master), row
            assert node["address"].removeprefix("tcp://") in row
            assert ("self" if node is first else "healthy") in row.split()
        [actor] = [line for line in lines if "keeper_of_the_second_node" in line
                   and "Keeper" in line]
        assert actor.split()[2:6] == [runs_on[:8], "alive", "0", "detached"], actor
    finally:
        _kill_recorded_node(other)


def test_picture_fits_80_columns_with_long_values() -> None:
    long_reason = "the constructor raised ValueError: " + "a very long explanation " * 8
    member = {"node_id": "a" * 32, "address": "tcp://[fd00:1234:5678::abcd]:52416",
              "health": "degraded", "rtt_ms": 12.5, "state": "alive",
              "resources": {"CPU": 128.0, "GPU": 8.0, "memory": 512 * 2.0 ** 30},
              "available": {"CPU": 100.5, "GPU": 0.0, "memory": 100 * 2.0 ** 30},
              "actors": 1234}
    status = {"node_id": "a" * 32, "address": member["address"], "namespace": "lab",
              "resources": member["resources"], "available": member["available"],
              "cluster": {"master": "", "term": 12, "epoch": 3, "role": "candidate",
                          "members": [member, {**member, "node_id": "b" * 32,
                                               "unanswered": long_reason}]},
              "workers": [], "actors": [],
              "cluster_actors": [{"actor_id": "c" * 32, "name": "n" * 20,
                                  "class_name": "SomeQuiteLongClassName", "node_id": "a" * 32,
                                  "state": "restarting", "incarnation": 3,
                                  "owner": "client 12345678 via abcdefgh",
                                  "reason": long_reason}],
              "refused_peers": [{"address": "tcp://192.168.100.200:52416",
                                 "reason": long_reason}]}
    lines = picture(status)
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    text = "\n".join(lines)
    assert "none yet" in text and "did not answer" in text and "192.168.100.200:52416" in text
    assert "a very long explanation" in text      # reasons wrap, they are not cut
    assert "n" * 20 in text and "SomeQuite.." in text   # the first column stays, others give way
    assert "aaaaaaaa " in text and "restarting" in text   # node ids and states are never cut


# --------------------------------------------------------------- --watch

def test_watch_with_count_prints_that_many_frames(home: Path) -> None:
    record = _start(home)
    done = pmetal(home, "status", "--watch", "0.1", "--count", "3")
    assert done.returncode == 0, done.stderr
    frames = _frames(done.stdout)
    assert len(frames) == 3, done.stdout
    assert [f.split("\n")[0].split()[-1] for f in frames] == ["1/3", "2/3", "3/3"]
    for frame in frames:
        assert record["node_id"] in frame and "NODES (1)" in frame
    assert "\x1b[" not in done.stdout     # not a terminal: plain blocks, no ANSI
    # --json: one JSON document a line, a frame each.
    done = pmetal(home, "status", "--json", "--count", "2", "--watch", "0.1")
    assert done.returncode == 0, done.stderr
    documents = [json.loads(line) for line in done.stdout.splitlines()]
    assert [d["node_id"] for d in documents] == [record["node_id"]] * 2


def test_watch_on_a_terminal_redraws_over_the_last_frame(home: Path) -> None:
    record = _start(home)
    controller, terminal = pty.openpty()
    try:
        watch = subprocess.Popen([sys.executable, "-m", "pmetal", "status", "--watch", "0.1",
                                  "--count", "2"], env=_env(home, COLUMNS="80"),
                                 stdout=terminal, stderr=subprocess.PIPE, text=True)
        os.close(terminal)
        terminal = -1
        out = b""
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while True:   # until the watch exits and its terminal closes
            assert time.monotonic() < deadline, out
            ready, _, _ = select.select([controller], [], [], 0.5)
            if not ready:
                continue
            try:
                chunk = os.read(controller, 1 << 16)
            except OSError:   # EIO: every writer of the terminal is gone
                break
            if not chunk:
                break
            out += chunk
        assert watch.wait(timeout=COMMAND_TIMEOUT) == 0, watch.stderr.read() if watch.stderr \
            else ""
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)
    text = out.decode()
    assert text.count("\x1b[H\x1b[2J") == 2 and text.count(record["node_id"]) >= 2, text


def _reader(process: subprocess.Popen[str]) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
    threading.Thread(target=read, daemon=True).start()
    return lines


def _frame_until(lines: queue.Queue[str], done: Any, what: str) -> str:
    """Read frames until one satisfies ``done`` (within WAIT)."""
    deadline = time.monotonic() + WAIT
    frame = ""
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no frame showed {what} within {WAIT} s; last:\n"
                                 f"{frame}") from None
        if line.startswith("pmetal status   every") and frame:
            if done(frame):
                return frame
            frame = ""
        frame += line


def test_watch_says_when_a_member_dies_and_when_its_own_node_does(
        home: Path, tmp_path: Path) -> None:
    first, second, other = _two_nodes(home, tmp_path)
    watch = subprocess.Popen([sys.executable, "-m", "pmetal", "status", "--watch", "0.2",
                              "--count", "500"], env=_env(home), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        lines = _reader(watch)
        short = second["node_id"][:8]

        def row(frame: str) -> list[str]:
            return next((r.split() for r in frame.splitlines()
                         if r.startswith(f"  {short}")), [])

        _frame_until(lines, lambda f: "healthy" in row(f), "the second node healthy")
        os.kill(second["pid"], signal.SIGKILL)
        assert _wait_gone(second["pid"])
        # Dead in the NODES table, or listed as gone once the master drops it.
        frame = _frame_until(lines, lambda f: "dead" in row(f) or "GONE (1)" in f,
                             "the second node dead")
        assert "(not listed: the actors of" in frame or "GONE (1)" in frame, frame
        os.kill(first["pid"], signal.SIGKILL)
        assert _wait_gone(first["pid"])
        frame = _frame_until(lines, lambda f: "no status:" in f, "its own node gone")
        # Why, as the client knows it (the connection dropped, or the
        # record names a process that is gone), and when it last answered.
        assert any(why in frame for why in ("died", "is not running", "no answer")), frame
        assert "(last answer at " in frame
    finally:
        watch.kill()
        watch.wait(timeout=COMMAND_TIMEOUT)
        _kill_recorded_node(other)


def test_watch_of_a_stopped_node_exits_1_after_its_frames(home: Path) -> None:
    record = _start(home)
    os.kill(record["pid"], signal.SIGKILL)
    assert _wait_gone(record["pid"])
    done = pmetal(home, "status", "--watch", "0.1", "--count", "2")
    assert done.returncode == 1, done.stdout
    frames = _frames(done.stdout)
    assert len(frames) == 2 and all("is not running" in f for f in frames), done.stdout


@pytest.mark.parametrize(("argv", "message"), [
    (["status", "--watch", "0"], "out of range: give 0.1 to 3600 seconds"),
    (["status", "--watch", "nan"], "out of range"),
    (["status", "--watch", "soon"], "'soon' is not a number of seconds"),
    (["status", "--count", "0"], "0 frames: give 1 or more"),
    (["status", "--watch", "1", "--count", "x"], "'x' is not a whole number of frames"),
])
def test_bad_watch_arguments_say_what_to_give(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err
