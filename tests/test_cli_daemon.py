"""``pmetal start``, ``status`` and ``stop``: real daemons on 127.0.0.1.

Every command runs as a real process (``python -m pmetal``) with a private
PMETAL_HOME, every wait has a deadline, and a fixture kills any node a
failing test left behind (by the pid its node.json recorded).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pmetal import shm
from pmetal.cli import main

COMMAND_TIMEOUT = 40.0
"""Deadline of one ``pmetal`` command (start waits for the node's ready line)."""
EXIT_TIMEOUT = 10.0
"""How long a stopped node's (or worker's) process may take to disappear."""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private PMETAL_HOME; any node still recorded there is killed at teardown."""
    for key in list(os.environ):
        if key.startswith("PMETAL_"):
            monkeypatch.delenv(key)
    folder = tmp_path / "home"
    monkeypatch.setenv("PMETAL_HOME", str(folder))
    yield folder
    _kill_recorded_node(folder)


def _kill_recorded_node(folder: Path) -> None:
    """Kill the node a test left running in ``folder`` (by its recorded pid)."""
    record = folder / "node.json"
    if record.exists():
        pid = json.loads(record.read_text())["pid"]
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    env["PMETAL_HOME"] = str(home)
    env.update(extra)
    return env


def pmetal(home: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pmetal", *args], env=_env(home, **extra_env),
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat_file = Path(f"/proc/{pid}/stat")
    try:  # a zombie waiting for its parent to reap it has exited
        return stat_file.read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return not stat_file.parent.exists()  # no /proc (macOS): trust kill(0)


def _wait_gone(pid: int, timeout: float = EXIT_TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _status(home: Path, **extra_env: str) -> dict[str, Any]:
    done = pmetal(home, "status", "--json", **extra_env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


DRIVER = """
import pmetal
info = pmetal.init(address="auto")

@pmetal.remote
class Counter:
    def __init__(self):
        self.n = 0
    def add(self, k):
        self.n += k
        return self.n

# Detached: it outlives this driver (an actor a driver owns dies with it).
c = Counter.options(name="shared_counter", lifetime="detached").remote()
print("node", info["node_id"])
print("sum", pmetal.get([c.add.remote(k) for k in range(1, 5)])[-1])
"""


# ---------------------------------------------------------------- lifecycle

def test_start_status_auto_init_stop(home: Path) -> None:
    port = free_port()
    started = pmetal(home, "start", "--port", str(port))
    assert started.returncode == 0, started.stderr
    assert "started pmetal node" in started.stdout
    assert f"tcp://127.0.0.1:{port}" in started.stdout

    record_file = home / "node.json"
    assert stat.S_IMODE(record_file.stat().st_mode) == 0o600
    record = json.loads(record_file.read_text())
    assert record["address"] == f"tcp://127.0.0.1:{port}"
    assert record["namespace"] == "default"
    psk = Path(record["psk_file"])
    assert psk == home / "psk" and stat.S_IMODE(psk.stat().st_mode) == 0o600
    assert len(psk.read_text().strip()) == 64
    assert _alive(record["pid"])

    again = pmetal(home, "start", "--port", str(free_port()))
    assert again.returncode == 1 and "already running" in again.stderr

    status = _status(home)
    assert status["node_id"] == record["node_id"]
    assert status["address"] == record["address"]
    assert status["pid"] == record["pid"]
    assert status["members"] == [] and status["actors"] == []

    driver = subprocess.run([sys.executable, "-c", DRIVER], env=_env(home), text=True,
                            capture_output=True, timeout=COMMAND_TIMEOUT, check=False)
    assert driver.returncode == 0, driver.stderr
    assert f"node {record['node_id']}" in driver.stdout
    assert "sum 10" in driver.stdout

    status = _status(home)
    [actor] = status["actors"]
    assert (actor["name"], actor["class_name"], actor["state"], actor["incarnation"]) == \
        ("shared_counter", "Counter", "alive", 0)
    assert status["statistics"]["actors_created"] == 1
    worker_pids = [w["pid"] for w in status["workers"]]
    assert worker_pids

    text = pmetal(home, "status")
    assert text.returncode == 0, text.stderr
    for expected in (record["node_id"], "NODES (1)", "WORKERS", "ACTORS (1)",
                     "shared_counter", "alive"):
        assert expected in text.stdout
    assert "CAPACITY" not in text.stdout       # measured only when asked
    # What pipeline placement sees: the compute rate and free memory, measured now.
    measured = pmetal(home, "status", "--measure")
    assert measured.returncode == 0, measured.stderr
    assert "CAPACITY (1)" in measured.stdout and "COMPUTE GFLOP/S" in measured.stdout

    stopped = pmetal(home, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert f"stopped pmetal node {record['node_id']}" in stopped.stdout
    assert _wait_gone(record["pid"])
    assert all(_wait_gone(pid) for pid in worker_pids)  # workers follow their node
    assert not record_file.exists()

    assert "no pmetal node is running" in pmetal(home, "stop").stdout
    after = pmetal(home, "status")
    assert after.returncode == 1 and "no pmetal node is running" in after.stderr


def test_namespace_and_psk_file_reach_the_node_and_auto_init(home: Path,
                                                             tmp_path: Path) -> None:
    key = tmp_path / "lab.psk"
    assert main(["keygen", "--out", str(key)]) == 0
    started = pmetal(home, "start", "--port", "0", "--namespace", "lab",
                     "--psk-file", str(key), "--no-discovery")
    assert started.returncode == 0, started.stderr
    assert not (home / "psk").exists()  # no default key when one was given
    record = json.loads((home / "node.json").read_text())
    assert (record["namespace"], record["psk_file"]) == ("lab", str(key))
    # A PMETAL_PSK meant for something else does not override the recorded file.
    assert _status(home, PMETAL_PSK="some-other-psk-of-enough-length")["namespace"] == "lab"

    driver = subprocess.run([sys.executable, "-c", DRIVER], env=_env(home), text=True,
                            capture_output=True, timeout=COMMAND_TIMEOUT, check=False)
    assert driver.returncode == 0, driver.stderr
    assert "sum 10" in driver.stdout

    assert pmetal(home, "stop").returncode == 0
    assert _wait_gone(record["pid"])


def _ignoring_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_block_stays_in_the_foreground_until_stopped(home: Path) -> None:
    # Started as a shell starts a command with '&' in a script: SIGINT
    # ignored. The promised Ctrl-C must stop it all the same.
    proc = subprocess.Popen([sys.executable, "-m", "pmetal", "start", "--port", "0", "--block"],
                            env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_ignoring_sigint)
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while not any("Ctrl-C stops it" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            lines.append(proc.stdout.readline())
        record = json.loads((home / "node.json").read_text())
        assert _status(home)["node_id"] == record["node_id"]

        proc.send_signal(signal.SIGINT)  # Ctrl-C, delivered to the command only
        assert proc.wait(COMMAND_TIMEOUT) == 0, proc.stderr.read() if proc.stderr else ""
        assert _wait_gone(record["pid"])
        assert not (home / "node.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


# ------------------------------------------------------------------- errors

def test_node_that_cannot_bind_reports_why(home: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = pmetal(home, "start", "--port", str(port))
    assert started.returncode == 1
    assert "the node exited at start" in started.stderr
    assert not (home / "node.json").exists()


def test_stale_record_is_reported_then_cleared(home: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=True)
    pid = int(gone.stdout)
    home.mkdir(parents=True)
    (home / "node.json").write_text(json.dumps({"address": "tcp://127.0.0.1:9", "pid": pid,
                                                "node_id": "x", "namespace": "default",
                                                "psk_file": ""}))
    status = pmetal(home, "status")
    assert status.returncode == 1 and "is not running" in status.stderr
    stopped = pmetal(home, "stop")
    assert stopped.returncode == 0 and "was not running" in stopped.stdout
    assert not (home / "node.json").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--peers", "no-port-here"], "--peers"),
    (["--port", "70000"], "transport.port"),
    (["--namespace", ""], "security.namespace"),
])
def test_bad_start_options_are_configuration_errors(home: Path, args: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["start", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (home / "node.json").exists()


def test_short_psk_is_refused_before_starting(home: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "short.psk"
    key.write_text("too-short\n")
    key.chmod(0o600)
    assert main(["start", "--psk-file", str(key)]) == 2
    assert "PSK" in capsys.readouterr().err
    assert not (home / "node.json").exists()


TWO_NODES = """
import os
import pmetal
pmetal.init(address="auto")
here, there = (n["NodeID"] for n in pmetal.nodes())

@pmetal.remote
class Where:
    def home(self):
        return os.environ["PMETAL_HOME"]

print("placed in", pmetal.get(Where.options(node=there).remote().home.remote()))
print("cpus", pmetal.cluster_resources()["CPU"])
"""


def test_second_node_joins_with_peers_and_hosts_actors(home: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-home"
    key = tmp_path / "shared.psk"
    assert main(["keygen", "--out", str(key)]) == 0
    first = pmetal(home, "start", "--port", "0", "--psk-file", str(key))
    assert first.returncode == 0, first.stderr
    address = json.loads((home / "node.json").read_text())["address"]
    second = pmetal(other, "start", "--port", "0", "--psk-file", str(key),
                    "--peers", address.removeprefix("tcp://"))
    try:
        assert second.returncode == 0, second.stderr
        deadline = time.monotonic() + EXIT_TIMEOUT  # the join is retried in the background
        while not _status(home)["members"]:
            assert time.monotonic() < deadline, "the second node never joined"
            time.sleep(0.1)
        driver = subprocess.run([sys.executable, "-c", TWO_NODES], env=_env(home), text=True,
                                capture_output=True, timeout=COMMAND_TIMEOUT, check=False)
        assert driver.returncode == 0, driver.stderr
        assert f"placed in {other}" in driver.stdout
        assert f"cpus {float(2 * (os.cpu_count() or 1))}" in driver.stdout
        assert pmetal(other, "stop").returncode == 0
        assert pmetal(home, "stop").returncode == 0
    finally:
        _kill_recorded_node(other)


# ------------------------------------------------------------ node death

def test_stale_record_makes_auto_init_fail_at_once(home: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=True)
    home.mkdir(parents=True)
    (home / "node.json").write_text(json.dumps({"address": "tcp://127.0.0.1:9",
                                                "pid": int(gone.stdout), "node_id": "x",
                                                "namespace": "default", "psk_file": ""}))
    script = ("import time, pmetal\nt = time.monotonic()\ntry:\n"
              "    pmetal.init(address='auto')\nexcept pmetal.PeerError as e:\n"
              "    print(round(time.monotonic() - t, 2), e)\n")
    done = subprocess.run([sys.executable, "-c", script], env=_env(home), text=True,
                          capture_output=True, timeout=COMMAND_TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr
    took, _, message = done.stdout.partition(" ")
    assert float(took) < 2.0, done.stdout   # the old client waited 10 s for a Welcome
    assert "not running" in message and "pmetal start" in message


KILLED_NODE_DRIVER = """
import sys, time, pmetal
pmetal.init(address="auto")

@pmetal.remote
class Slow:
    def __init__(self, flag):
        open(flag, "w").close()
        time.sleep(60)

@pmetal.remote
class Quick:
    def ping(self):
        return "pong"

quick = Quick.remote()
print(pmetal.get(quick.ping.remote(), timeout=20), flush=True)
for what, step in (("create", lambda: Slow.remote(sys.argv[1])),
                   ("call", lambda: pmetal.get(quick.ping.remote(), timeout=30))):
    t = time.monotonic()
    try:
        step()
        print(what, "ok", flush=True)
    except pmetal.PMetalError as e:
        print(what, type(e).__name__, round(time.monotonic() - t, 2), e, flush=True)
"""


def test_kill_9_of_the_node_fails_a_creation_and_the_next_call_at_once(home: Path,
                                                                       tmp_path: Path) -> None:
    started = pmetal(home, "start", "--port", "0")
    assert started.returncode == 0, started.stderr
    node_pid = json.loads((home / "node.json").read_text())["pid"]
    flag = tmp_path / "constructing"
    driver = subprocess.Popen([sys.executable, "-c", KILLED_NODE_DRIVER, str(flag)],
                              env=_env(home), text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        assert driver.stdout is not None
        assert driver.stdout.readline().strip() == "pong"
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while not flag.exists():   # the creation is in flight: its constructor runs
            assert time.monotonic() < deadline and driver.poll() is None, driver.stderr.read()
            time.sleep(0.05)
        os.kill(node_pid, signal.SIGKILL)
        out, err = driver.communicate(timeout=COMMAND_TIMEOUT)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    for what in ("create", "call"):
        assert lines.get(what, "").count(" ") >= 2, (what, out, err)   # it failed, and how
        kind, took, message = lines[what].split(" ", 2)
        # The old client waited 29 s (creation) and 40 s (call); "at once" is
        # told from those waits with room for a loaded machine (3 s failed at
        # load 13).
        assert kind in ("PeerError", "ActorDiedError"), (what, lines[what], err)
        assert float(took) < 10.0, (what, lines[what])
        assert "node" in message and "died" in message, (what, message)


# --------------------------------------------------------------- lifetime

OWNER_DRIVER = """
import json, os, sys, pmetal
pmetal.init(address="auto")

@pmetal.remote
class Box:
    def pid(self):
        return os.getpid()
    def make_child(self):
        self.child = Box.remote()        # owned by this actor's worker
        return pmetal.get(self.child.pid.remote(), timeout=20)
    def ones(self, n):
        import numpy
        return numpy.ones(n)


owned = Box.options(name="owned", num_cpus=1).remote()
parent = Box.options(name="parent").remote()
kept = Box.options(name="kept", lifetime="detached").remote()
pids = {"owned": pmetal.get(owned.pid.remote(), timeout=20),
        "parent": pmetal.get(parent.pid.remote(), timeout=20),
        "child": pmetal.get(parent.make_child.remote(), timeout=20),
        "kept": pmetal.get(kept.pid.remote(), timeout=20)}
# Replies this driver never reads: 8 MiB arrays come back through shared
# memory, named for this process as their reader.
unread = [owned.ones.remote(1 << 20) for _ in range(3)]
print(json.dumps(pids), flush=True)
sys.stdin.read()                         # the test kills this process
"""


def test_actors_die_with_their_killed_driver_unless_detached(home: Path) -> None:
    started = pmetal(home, "start", "--port", "0")
    assert started.returncode == 0, started.stderr
    free_cpus = _status(home)["available"]["CPU"]
    driver = subprocess.Popen([sys.executable, "-c", OWNER_DRIVER], env=_env(home), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert driver.stdout is not None
        pids = json.loads(driver.stdout.readline())
        assert _status(home)["available"]["CPU"] == free_cpus - 1
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while len(shm.objects(readers=(driver.pid,))) < 3:   # the unread replies
            assert time.monotonic() < deadline, shm.objects()
            time.sleep(0.05)
        driver.kill()   # kill -9: no atexit, no shutdown
        driver.wait(EXIT_TIMEOUT)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    # Its actors go (the child with the parent that owned it), their workers
    # exit and the CPU they held is free again; the detached one stays.
    for name in ("owned", "parent", "child"):
        assert _wait_gone(pids[name]), f"the worker of {name} outlived the driver"
    deadline = time.monotonic() + EXIT_TIMEOUT
    while True:
        status = _status(home)
        states = {a["name"] or "child": a["state"] for a in status["actors"]}
        if states == {"owned": "dead", "parent": "dead", "child": "dead", "kept": "alive"} \
                and status["available"]["CPU"] == free_cpus:
            break
        assert time.monotonic() < deadline, (states, status["available"])
        time.sleep(0.1)
    assert _alive(pids["kept"])
    # Its node swept the replies it never read out of /dev/shm.
    assert not shm.objects(readers=(driver.pid,)) and not shm.objects(creators=(driver.pid,))
    owned = next(a for a in status["actors"] if a["name"] == "owned")
    assert "owner" in owned["reason"] and owned["resources"] == {"CPU": 1.0}
    text = pmetal(home, "status")
    assert "OWNER" in text.stdout and "detached" in text.stdout
    # The detached actor is reachable by name from a new driver, and
    # 'pmetal kill NAME' ends it.
    use = subprocess.run([sys.executable, "-c",
                          "import pmetal; pmetal.init(address='auto'); "
                          "print(pmetal.get(pmetal.get_actor('kept').pid.remote(), timeout=20))"],
                         env=_env(home), text=True, capture_output=True,
                         timeout=COMMAND_TIMEOUT, check=False)
    assert use.returncode == 0 and int(use.stdout) == pids["kept"], use.stderr
    killed = pmetal(home, "kill", "kept")
    assert killed.returncode == 0 and "killed actor 'kept'" in killed.stdout, killed.stderr
    assert _wait_gone(pids["kept"])
    again = pmetal(home, "kill", "kept")
    assert again.returncode == 1 and "dead" in again.stderr
    missing = pmetal(home, "kill", "no-such-actor")
    assert missing.returncode == 1 and "no-such-actor" in missing.stderr
    assert pmetal(home, "stop").returncode == 0


LEAVING_DRIVER = """
import json, os, sys, pmetal
if sys.argv[1] == "remote":
    # As a driver on another machine: this process cannot prove that it
    # shares the node's machine (no shared-memory token), so the node
    # cannot watch its pid and gives it a lease instead.
    from pmetal import shm
    shm._posixshmem = None
pmetal.init(address="auto")

@pmetal.remote
class Box:
    def pid(self):
        return os.getpid()


owned = Box.options(name="owned").remote()
kept = Box.options(name="kept", lifetime="detached").remote()
print(json.dumps({"owned": pmetal.get(owned.pid.remote(), timeout=20),
                  "kept": pmetal.get(kept.pid.remote(), timeout=20)}), flush=True)
if sys.stdin.readline().strip() == "shutdown":
    pmetal.shutdown()
    print("shut down", flush=True)
sys.stdin.read()                         # the test ends this process
"""


def _states(home: Path) -> dict[str, tuple[str, str, str]]:
    return {a["name"]: (a["state"], a["owner"], a["reason"])
            for a in _status(home)["actors"]}


def _wait_states(home: Path, want: dict[str, str], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        states = _states(home)
        if {name: s[0] for name, s in states.items()} == want:
            return states
        assert time.monotonic() < deadline, states
        time.sleep(0.1)


@pytest.mark.parametrize("where", ["local", "remote"])
def test_shutdown_ends_the_drivers_actors_while_its_process_lives(home: Path,
                                                                   where: str) -> None:
    # As Ray does when a driver disconnects: pmetal.shutdown() on a driver
    # joined to a daemon ends its non-detached actors at once, on this
    # machine (pid watched) and from another one (lease).
    started = pmetal(home, "start", "--port", "0")
    assert started.returncode == 0, started.stderr
    driver = subprocess.Popen([sys.executable, "-c", LEAVING_DRIVER, where], env=_env(home),
                              text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert driver.stdin is not None and driver.stdout is not None
        pids = json.loads(driver.stdout.readline())
        owner = _states(home)["owned"][1]
        assert owner.startswith("pid" if where == "local" else "client"), owner
        text = pmetal(home, "status").stdout
        assert "owned (Box)" in text and "kept (Box)" in text, text
        driver.stdin.write("shutdown\n")
        driver.stdin.flush()
        assert driver.stdout.readline().strip() == "shut down"
        # Ended by the time shutdown() returned, not when the process exits.
        states = _states(home)
        assert states["owned"][0] == "dead" and "shut down" in states["owned"][2], states
        assert states["kept"][0] == "alive", states
        assert driver.poll() is None
        assert _wait_gone(pids["owned"]) and _alive(pids["kept"])
    finally:
        driver.kill()
        driver.wait()
    assert pmetal(home, "stop").returncode == 0


def test_actors_of_a_remote_driver_live_while_it_renews_its_lease_and_die_after(
        home: Path) -> None:
    # A driver on another machine cannot be watched by pid: its node gives
    # it a lease (here 1 s), which an idle driver renews; killed with kill -9
    # it stops renewing, and its non-detached actors end within the lease.
    lease = {"PMETAL_ACTORS_OWNER_LEASE": "1.0"}
    started = pmetal(home, "start", "--port", "0", **lease)
    assert started.returncode == 0, started.stderr
    driver = subprocess.Popen([sys.executable, "-c", LEAVING_DRIVER, "remote"],
                              env=_env(home), text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        assert driver.stdout is not None
        pids = json.loads(driver.stdout.readline())
        first = _status(home)["leases"]
        assert first["held"] == 1, first
        # Idle, it renews every quarter lease: wait for two leases' worth of
        # renewals (unrenewed, the actor would have died after one), and its
        # actor is still alive.
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while (status := _status(home))["leases"]["renewed"] < first["renewed"] + 8:
            assert time.monotonic() < deadline, status["leases"]
            time.sleep(0.2)
        assert status["leases"]["expired"] == 0
        assert {a["name"]: a["state"] for a in status["actors"]} == \
            {"owned": "alive", "kept": "alive"}
        driver.kill()   # kill -9: no shutdown, no Detach; nothing the node can watch
        driver.wait(EXIT_TIMEOUT)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    states = _wait_states(home, {"owned": "dead", "kept": "alive"}, EXIT_TIMEOUT)
    assert "lease" in states["owned"][2], states
    assert _wait_gone(pids["owned"]) and _alive(pids["kept"])
    leases = _status(home)["leases"]
    assert leases["held"] == 0 and leases["expired"] == 1, leases
    assert pmetal(home, "stop").returncode == 0


# ---------------------------------------------------------- refused peers

@pytest.mark.parametrize("differs", ["psk", "namespace"])
def test_peer_of_another_namespace_is_a_warning_and_listed_in_status(
        home: Path, tmp_path: Path, differs: str) -> None:
    other = tmp_path / "other-home"
    keys = [tmp_path / "a.psk", tmp_path / "b.psk"]
    for key in keys:
        assert main(["keygen", "--out", str(key)]) == 0
    first = pmetal(home, "start", "--port", "0", "--psk-file", str(keys[0]))
    assert first.returncode == 0, first.stderr
    address = json.loads((home / "node.json").read_text())["address"].removeprefix("tcp://")
    mismatch = (["--psk-file", str(keys[1])] if differs == "psk"
                else ["--psk-file", str(keys[0]), "--namespace", "elsewhere"])
    second = pmetal(other, "start", "--port", "0", "--peers", address, *mismatch,
                    PMETAL_TRANSPORT_HANDSHAKE_TIMEOUT="1.0")
    try:
        assert second.returncode == 0, second.stderr
        deadline = time.monotonic() + EXIT_TIMEOUT
        while not (refused := _status(other).get("refused_peers")):
            assert time.monotonic() < deadline, "the refusal never showed in pmetal status"
            time.sleep(0.1)
        assert refused[0]["address"] == f"tcp://{address}"
        reason = refused[0]["reason"]
        assert "PSK or namespace" in reason, reason
        log = (other / "node.log").read_text()
        assert "WARNING" in log and address in log and "PSK or namespace" in log, log
        text = pmetal(other, "status")
        assert "REFUSED PEERS (1)" in text.stdout and address in text.stdout
        assert _status(other)["members"] == [] and _status(home)["members"] == []
    finally:
        _kill_recorded_node(other)


def test_start_for_wifi_uses_the_wifi_timeouts_and_discovery_on_loopback(home: Path) -> None:
    started = pmetal(home, "start", "--port", "0", "--wifi")
    try:
        assert started.returncode == 0, started.stderr
        cluster = _status(home)["cluster"]
        # A peer is dead after 5 s of silence, not 0.8 s; the election waits 3 s.
        assert cluster["timeouts"] == {"dead_after": 5.0, "interval": 0.5, "election": 3.0}
        # pmetal start discovers by default, on the address it listens on
        # (127.0.0.1 here: nothing leaves this machine).
        assert cluster["discovery"] == ["127.0.0.1"]
        text = pmetal(home, "status")
        assert "master" in text.stdout and "NODES (1)" in text.stdout, text.stdout
        assert pmetal(home, "stop").returncode == 0
    finally:
        _kill_recorded_node(home)


def test_generate_with_address_finds_the_key_of_the_node_running_here(
        home: Path, tmp_path: Path) -> None:
    from pipeline.tinymodel import tiny_config, write_tiny_gguf
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, tiny_config(layers=2), seed=3)
    key = tmp_path / "lab.psk"
    assert main(["keygen", "--out", str(key)]) == 0
    port = free_port()
    started = pmetal(home, "start", "--port", str(port), "--namespace", "lab",
                     "--psk-file", str(key), "--no-discovery")
    assert started.returncode == 0, started.stderr
    record = json.loads((home / "node.json").read_text())
    ask = ("generate", "--model", str(model), "--prompt", "hi", "--raw", "--max-tokens", "3",
           "--stages", "1")
    try:
        # As documented: no PMETAL_PSK, the node of this machine knows the key.
        for address in (f"tcp://127.0.0.1:{port}", f"127.0.0.1:{port}", "auto"):
            done = pmetal(home, *ask, "--address", address)
            assert done.returncode == 0, (address, done.stderr)
            assert f"on node {record['node_id'][:8]}" in done.stderr, done.stderr
        # Without a node here nor a key, one line says where the key comes from.
        elsewhere = tmp_path / "elsewhere"
        done = pmetal(elsewhere, *ask, "--address", f"tcp://127.0.0.1:{port}")
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert f"--address tcp://127.0.0.1:{port}: no PSK" in done.stderr
        assert "PMETAL_PSK" in done.stderr and "pmetal start" in done.stderr
    finally:
        assert pmetal(home, "stop").returncode == 0
        assert _wait_gone(record["pid"])
