"""``pmetal launch`` with real processes, and the environment contract it writes.

The ranks run a small script (written to ``tmp_path``) that binds its own
``PMETAL_NODES`` entry (so a wrong address fails), then reports its rank,
pid and environment to a socket of the test on loopback, and waits for an
order on that connection (``exit N``). The test therefore knows every rank
runs, and what it saw, before it makes one fail or stops the launcher; and
it checks by pid that the ranks themselves are gone afterwards. The
namespace test reports on stdout instead, since its ranks cannot reach the
test's loopback.
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from netlab import NetLab

import pmetal
from pmetal.cli import main
from pmetal.cli.launch import BLAS_THREADS, parse_hosts, place
from pmetal.collectives.launchenv import (
    LAUNCH_VARIABLES,
    LaunchEnv,
    format_node,
    from_env,
    parse_node,
)
from pmetal.config import PMetalConfig, load_config
from pmetal.errors import ConfigError

DEADLINE = 30.0
"""Generous bound of anything that should take about a second (a loaded 2-core machine)."""
SHORT_GRACE = 1.0
"""``--grace`` of the tests whose rank ignores SIGTERM: they wait it out."""

RANK_SCRIPT = r"""
import json, os, signal, socket, sys

rank = int(os.environ["PMETAL_RANK"])
host, _, port = os.environ["PMETAL_NODES"].split(",")[rank].rpartition(":")
with socket.socket() as own:  # rank r listens on entry r: it must be bindable here
    own.bind((host.strip("[]"), int(port)))
if rank in json.loads(sys.argv[2]):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
report = {"rank": rank, "pid": os.getpid(), "cwd": os.getcwd(), "args": sys.argv[3:],
          "netns": os.stat("/proc/self/ns/net").st_ino,
          "env": {k: v for k, v in os.environ.items() if k.startswith("PMETAL_")},
          "threads": {k: v for k, v in os.environ.items() if k.endswith("_THREADS")}}
line = (json.dumps(report) + "\n").encode()
if sys.argv[1] == "-":  # no reporter to reach: print the report and stop
    os.write(1, line)
    sys.exit(0)
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=30)
conn.sendall(line)
conn.settimeout(None)
order = conn.makefile().readline().split()
sys.exit(int(order[1]) if order else 0)
"""


# --------------------------------------------------------------- helpers

def _env() -> dict[str, str]:
    """The test's environment (PYTHONPATH included: this worktree's code) without PMETAL_*."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}


def _gone(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait on pidfds (no polling) until ``pids`` exit; return those still running."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        alive = set(fds)
        deadline = time.monotonic() + timeout
        while alive and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                alive.discard(fd)
                poller.unregister(fd)
        return [fds[fd] for fd in alive]
    finally:
        for fd in fds:
            os.close(fd)


def _free_run(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 a moment
    ago, below the kernel's ephemeral range: a port from that range (what
    binding port 0 gives) can be handed to any outgoing connection of the
    machine between this check and the ranks' own bind, and was (EADDRINUSE
    in rank 2, once in CI)."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(10000, max(10001, low - count))
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                held.append(socket.create_server(("127.0.0.1", port)))
            return base
        except OSError:  # taken: another try
            continue
        finally:
            for s in held:
                s.close()
    raise AssertionError(f"no {count} consecutive free ports on 127.0.0.1")


class Job:
    """``pmetal launch`` started in the background, with the ranks' reports."""

    def __init__(self, folder: Path, launch_args: Sequence[str], *, n: int,
                 ignore_term: Sequence[int] = (), script_args: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        script = folder / "rank.py"
        script.write_text(RANK_SCRIPT)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(DEADLINE)
        port = self.listener.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pmetal", "launch", *launch_args, "rank.py", str(port),
             json.dumps(list(ignore_term)), *script_args],
            cwd=folder, env={**_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.conns: dict[int, socket.socket] = {}
        self.reports: dict[int, dict[str, Any]] = {}
        # Wait for the next report or for the launcher's exit, whichever comes first:
        # a launch that fails early shows its stderr instead of a 30 s accept timeout.
        exited = os.pidfd_open(self.proc.pid)
        try:
            poller = select.poll()
            poller.register(self.listener, select.POLLIN)
            poller.register(exited, select.POLLIN)
            deadline = time.monotonic() + DEADLINE
            while len(self.reports) < n:
                events = dict(poller.poll(max(0.0, deadline - time.monotonic()) * 1000))
                if exited in events or not events:
                    self.proc.kill()
                    _, err = self.proc.communicate(timeout=DEADLINE)
                    raise AssertionError(f"{len(self.reports)} of {n} ranks reported; "
                                         f"launcher status {self.proc.returncode}:\n{err}")
                conn, _ = self.listener.accept()
                report = json.loads(conn.makefile().readline())
                self.conns[report["rank"]] = conn
                self.reports[report["rank"]] = report
        finally:
            os.close(exited)

    @property
    def pids(self) -> list[int]:
        return [r["pid"] for r in self.reports.values()]

    def order(self, rank: int, code: int) -> None:
        self.conns[rank].sendall(f"exit {code}\n".encode())

    def finish(self, timeout: float = DEADLINE) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=DEADLINE)
        for conn in self.conns.values():
            conn.close()
        self.listener.close()
        _gone(self.pids, DEADLINE)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def start(launch_args: Sequence[str], **kwargs: Any) -> Job:
        jobs.append(Job(tmp_path, launch_args, **kwargs))
        return jobs[-1]

    yield start
    for started in jobs:
        started.close()


# ------------------------------------------------------------ local ranks

def test_every_rank_gets_its_own_rank_and_the_same_nodes(job: Callable[..., Job],
                                                         tmp_path: Path) -> None:
    run = job(["-n", "4"], n=4, script_args=["--lr", "0.1"])
    for rank in range(4):
        run.order(rank, 0)
    code, _, err = run.finish()
    assert code == 0, err
    assert sorted(run.reports) == [0, 1, 2, 3]
    nodes = run.reports[0]["env"]["PMETAL_NODES"]
    entries = nodes.split(",")
    assert len(entries) == len(set(entries)) == 4
    for rank, report in run.reports.items():
        assert report["env"]["PMETAL_RANK"] == str(rank)
        assert report["env"]["PMETAL_LOCAL_RANK"] == str(rank)
        assert report["env"]["PMETAL_WORLD_SIZE"] == "4"
        assert report["env"]["PMETAL_NODES"] == nodes
        assert report["cwd"] == str(tmp_path)
        assert report["args"] == ["--lr", "0.1"]
        assert from_env(report["env"]) == LaunchEnv(rank, 4, rank, tuple(entries))
        assert parse_node(entries[rank])[0] == "127.0.0.1"
        # pmetal.init() in a launched script reads the config: it must take these
        assert load_config(env=report["env"]) == PMetalConfig()


def test_every_rank_gets_one_blas_and_openmp_thread_unless_the_user_chose(
        job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in BLAS_THREADS:   # whatever the developer's shell set
        monkeypatch.delenv(name, raising=False)
    run = job(["-n", "2"], n=2, env={"OPENBLAS_NUM_THREADS": "3"})
    for rank in range(2):
        run.order(rank, 0)
    code, _, err = run.finish()
    assert code == 0, err
    # As torchrun does: N ranks on one machine each with a thread per core
    # would fight over the cores (the training example ran 5x slower).
    want = {name: "1" for name in BLAS_THREADS} | {"OPENBLAS_NUM_THREADS": "3"}
    for report in run.reports.values():
        assert {k: report["threads"].get(k) for k in BLAS_THREADS} == want


def test_base_port_gives_rank_r_port_p_plus_r(job: Callable[..., Job]) -> None:
    base = _free_run(3)
    run = job(["-n", "3", "--base-port", str(base)], n=3)
    for rank in range(3):
        run.order(rank, 0)
    code, _, err = run.finish()
    assert code == 0, err
    assert run.reports[2]["env"]["PMETAL_NODES"] == ",".join(
        f"127.0.0.1:{base + r}" for r in range(3))


def test_a_failing_rank_sets_the_exit_code_and_stops_the_others(
        job: Callable[..., Job]) -> None:
    # Rank 2 ignores SIGTERM: it must be killed after the grace period
    # (--grace: the default's 3 s would only make the test wait longer).
    run = job(["-n", "4", "--grace", str(SHORT_GRACE)], n=4, ignore_term=[2])
    started = time.monotonic()
    run.order(1, 7)
    code, _, err = run.finish()
    assert code == 7
    assert "rank 1 exited with code 7" in err
    # rank 2 was killed, and said so
    assert f"rank(s) 2 still running {SHORT_GRACE:g} s after SIGTERM" in err
    assert _gone(run.pids, DEADLINE) == []
    assert time.monotonic() - started < SHORT_GRACE + DEADLINE


def test_a_rank_killed_by_a_signal_is_named(job: Callable[..., Job]) -> None:
    run = job(["-n", "2"], n=2)
    os.kill(run.reports[0]["pid"], signal.SIGKILL)
    code, _, err = run.finish()
    assert code == 128 + signal.SIGKILL, err
    assert "rank 0 was killed by SIGKILL" in err
    assert _gone(run.pids, DEADLINE) == []


def test_timeout_stops_every_rank(job: Callable[..., Job]) -> None:
    # Long enough for the three ranks to start and report on a loaded machine.
    run = job(["-n", "3", "--timeout", "4"], n=3)
    code, _, err = run.finish()
    assert code == 124
    assert "timed out after 4 s" in err
    assert _gone(run.pids, DEADLINE) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_reaches_every_rank(job: Callable[..., Job],
                                                     signum: signal.Signals) -> None:
    run = job(["-n", "3"], n=3)
    run.proc.send_signal(signum)
    code, _, err = run.finish()
    assert code == 128 + signum
    assert f"got {signum.name}" in err
    assert _gone(run.pids, DEADLINE) == []


def test_a_second_signal_kills_at_once(job: Callable[..., Job]) -> None:
    """Rank 1 ignores SIGTERM; the second signal does not wait out its grace period.
    (Two different signals: two of one kind sent at once may arrive as one.)"""
    run = job(["-n", "2"], n=2, ignore_term=[1])
    run.proc.send_signal(signal.SIGTERM)
    run.proc.send_signal(signal.SIGINT)
    code, _, err = run.finish()
    # Pending together, they may be handled in either order (Linux: lowest number first).
    assert code in (128 + signal.SIGTERM, 128 + signal.SIGINT)
    assert "while stopping: killing every rank" in err
    assert "still running" not in err
    assert _gone(run.pids, DEADLINE) == []


def test_ranks_die_with_a_killed_launcher(job: Callable[..., Job]) -> None:
    """kill -9 of the launcher: each rank's keeper sees its stdin close,
    and kills a rank that ignores SIGTERM after the grace period."""
    run = job(["-n", "2", "--grace", str(SHORT_GRACE)], n=2, ignore_term=[1])
    run.proc.kill()
    run.finish()
    assert _gone(run.pids, SHORT_GRACE + DEADLINE) == []


def test_tag_output_prefixes_every_line_with_its_rank(tmp_path: Path) -> None:
    (tmp_path / "two_lines.py").write_text(
        "import os, sys\n"
        "r = os.environ['PMETAL_RANK']\n"
        "print(f'out {r}'); print(f'more {r}')\n"
        "print(f'err {r}', file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-m", "pmetal", "launch", "-n", "3",
                           "--tag-output", "two_lines.py"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=DEADLINE, check=False)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == sorted(
        f"[{r}] {word} {r}" for r in range(3) for word in ("out", "more"))
    assert sorted(done.stderr.splitlines()) == [f"[{r}] err {r}" for r in range(3)]


def test_module_mode_runs_python_dash_m(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "hello.py").write_text(
        "import os, sys\nprint('hello', os.environ['PMETAL_RANK'], sys.argv[1:])\n")
    done = subprocess.run([sys.executable, "-m", "pmetal", "launch", "-n", "2",
                           "--tag-output", "-m", "pkg.hello", "--flag"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=DEADLINE, check=False)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        "[0] hello 0 ['--flag']", "[1] hello 1 ['--flag']"]


# ---------------------------------------------------------------- usage

@pytest.mark.parametrize("args, message", [
    (["-n", "0", "x.py"], "-n must be at least 1, not 0"),
    (["x.py"], "give -n N"),
    (["-n", "2"], "no program"),
    (["-n", "2", "missing.py"], "no such script: 'missing.py'"),
    (["-n", "2", "--timeout", "0", "x.py"], "--timeout must be positive"),
    (["-n", "2", "--grace", "-1", "x.py"], "--grace must be positive, not -1"),
    (["-n", "2", "--base-port", "65535", "x.py"], "65535..65536"),
    (["-n", "2", "--addresses", "a=1.2.3.4", "x.py"], "--addresses applies only with --hosts"),
    (["--hosts", "a,,b", "x.py"], "'' is not a host name"),
    (["--hosts", "a:0", "x.py"], "the slots of 'a' must be a whole number of at least 1"),
    (["--hosts", "a:two", "x.py"], "not 'two'"),
    (["--hosts", "a,a", "x.py"], "'a' is listed twice"),
    (["--hosts", "a,b", "--addresses", "c=10.0.0.1", "x.py"], "'c' is not one of --hosts"),
    (["--hosts", "a,b", "--addresses", "a", "x.py"], "'a' is not HOST=ADDRESS"),
    (["--hosts", "a,b", "--addresses", "a=1.2.3.4:5", "x.py"], "a='1.2.3.4:5' is not an address"),
    (["-n", "2", "--rsh", "ssh {host}", "x.py"], "--rsh applies only with --hosts"),
    (["--hosts", "a", "--rsh", "", "x.py"], "--rsh is empty"),
    (["--hosts", "a", "--rsh", "ssh 'x", "x.py"], "--rsh"),
])
def test_usage_errors_say_what_is_wrong(args: list[str], message: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert main(["launch", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pmetal launch: configuration error: ")
    assert message in err


@pytest.mark.parametrize("hosts, n, placed", [
    ("a", 3, ["a", "a", "a"]),
    ("a,b", 4, ["a", "b", "a", "b"]),
    ("a:2,b:2", 4, ["a", "a", "b", "b"]),
    ("a:2,b", 5, ["a", "a", "b", "a", "a"]),
    ("a:3,b:1", 2, ["a", "a"]),
    ("[fd00::1]:2,b", 3, ["fd00::1", "fd00::1", "b"]),
])
def test_ranks_fill_each_hosts_slots_in_turn(hosts: str, n: int, placed: list[str]) -> None:
    assert place(parse_hosts(hosts), n) == placed


# ------------------------------------------------------ the env contract

GOOD = {"PMETAL_RANK": "1", "PMETAL_WORLD_SIZE": "3", "PMETAL_LOCAL_RANK": "0",
        "PMETAL_NODES": "10.0.0.1:5000, 10.0.0.2:5000,[fd00::3]:5001"}


def test_from_env_reads_the_contract() -> None:
    env = from_env(GOOD)
    assert env == LaunchEnv(1, 3, 0, ("10.0.0.1:5000", "10.0.0.2:5000", "[fd00::3]:5001"))
    assert env.address == "10.0.0.2:5000"
    assert from_env(env.environ()) == env
    assert set(env.environ()) == set(LAUNCH_VARIABLES)
    assert parse_node("[fd00::3]:5001") == ("fd00::3", 5001)
    assert LaunchEnv.is_set(GOOD) and not LaunchEnv.is_set({"PATH": "/bin"})


def test_local_rank_defaults_to_the_index_among_the_same_hosts_ranks() -> None:
    nodes = "a:1,b:1,a:2,a:3"
    local = [from_env({"PMETAL_RANK": str(r), "PMETAL_WORLD_SIZE": "4",
                       "PMETAL_NODES": nodes}).local_rank for r in range(4)]
    assert local == [0, 0, 1, 2]


@given(host=st.one_of(st.ip_addresses().map(str),
                      st.from_regex(r"[a-z][a-z0-9.-]{0,30}", fullmatch=True)),
       port=st.integers(1, 65535))
def test_an_entry_reads_back_as_written(host: str, port: int) -> None:
    assert parse_node(format_node(host, port)) == (host, port)


@pytest.mark.parametrize("change, message", [
    ({"PMETAL_RANK": None}, "PMETAL_RANK is not set"),
    ({"PMETAL_WORLD_SIZE": None}, "PMETAL_WORLD_SIZE is not set"),
    ({"PMETAL_NODES": None}, "PMETAL_NODES is not set"),
    ({"PMETAL_NODES": " "}, "PMETAL_NODES is empty"),
    ({"PMETAL_RANK": "one"}, "PMETAL_RANK='one' is not a whole number"),
    ({"PMETAL_LOCAL_RANK": "x"}, "PMETAL_LOCAL_RANK='x'"),
    ({"PMETAL_RANK": "3"}, "PMETAL_RANK=3 is out of range for PMETAL_WORLD_SIZE=3"),
    ({"PMETAL_RANK": "-1"}, "PMETAL_RANK=-1 is out of range"),
    ({"PMETAL_LOCAL_RANK": "5"}, "PMETAL_LOCAL_RANK=5 is out of range"),
    ({"PMETAL_WORLD_SIZE": "2"}, "PMETAL_NODES lists 3 address(es) but PMETAL_WORLD_SIZE=2"),
    ({"PMETAL_WORLD_SIZE": "0"}, "PMETAL_WORLD_SIZE=0: a job has at least one rank"),
    ({"PMETAL_NODES": "a:1,b:2,c"}, "entry 2 (rank 2): 'c' is not host:port"),
    ({"PMETAL_NODES": "a:1,b:0,c:3"}, "'b:0': the port must be a number from 1 to 65535"),
    ({"PMETAL_NODES": "a:1,b:70000,c:3"}, "not '70000'"),
    ({"PMETAL_NODES": "a:1,:2,c:3"}, "':2' is not host:port"),
    ({"PMETAL_NODES": "a:1,fd00::1:2,c:3"}, "write an IPv6 host in brackets"),
    ({"PMETAL_NODES": "a:1,b:2,a:1"}, "ranks 0 and 2 both have 'a:1'"),
    ({"PMETAL_NODES": "a:1,[b]:2,c:3"}, "'b' in brackets is not an IPv6 address"),
    ({"PMETAL_NODES": "a:1,b:2,,"}, "PMETAL_NODES lists 4 address(es)"),
])
def test_from_env_errors_name_the_variable_the_value_and_the_fix(
        change: dict[str, str | None], message: str) -> None:
    env = {**GOOD, **change}
    with pytest.raises(ConfigError) as info:
        from_env({k: v for k, v in env.items() if v is not None})
    assert message in str(info.value)
    if "is not set" in message or "out of range" in message:
        assert "pmetal launch -n N script.py" in str(info.value)


# ------------------------------------------- several hosts: network namespaces

def test_hosts_across_two_namespaces(netlab: Callable[[int], NetLab], tmp_path: Path) -> None:
    lab = netlab(2)
    h1, h2 = lab.hosts
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "pmetal", "launch", "--hosts", f"{h1.name}:2,{h2.name}:2",
         "--rsh", "ip netns exec {host}", "--base-port", "6000",
         "--addresses", f"{h1.name}={h1.address},{h2.name}={h2.address}",
         "--tag-output", "rank.py", "-", "[]"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=DEADLINE, check=False)
    assert done.returncode == 0, done.stderr
    reports = {}
    for line in done.stdout.splitlines():
        tag, _, text = line.partition(" ")
        report = json.loads(text)
        assert tag == f"[{report['rank']}]"
        reports[report["rank"]] = report
    assert sorted(reports) == [0, 1, 2, 3]
    nodes = f"{h1.address}:6000,{h1.address}:6001,{h2.address}:6000,{h2.address}:6001"
    for rank, report in reports.items():
        assert report["env"] == {"PMETAL_RANK": str(rank), "PMETAL_WORLD_SIZE": "4",
                                 "PMETAL_LOCAL_RANK": str(rank % 2), "PMETAL_NODES": nodes}
        host = h1 if rank < 2 else h2  # each rank bound its entry: it ran on that host
        assert report["netns"] == os.stat(f"/run/netns/{host.name}").st_ino


def test_an_unreachable_host_fails_the_launch_with_the_rsh_status(tmp_path: Path) -> None:
    if shutil.which("ip") is None:
        pytest.skip("needs ip(8) from iproute2 as the --rsh command")
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "pmetal", "launch", "--hosts", "pm-no-such-namespace",
         "--rsh", "ip netns exec {host}", "rank.py", "-", "[]"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=DEADLINE, check=False)
    assert done.returncode != 0
    assert f"rank 0 (on pm-no-such-namespace) exited with code {done.returncode}" \
        in done.stderr


def test_an_ssh_style_agent_gets_one_shell_quoted_command(tmp_path: Path) -> None:
    """ssh joins its words into one line for the remote shell: the launcher's words
    (the keeper's source, with quotes and new lines, and its JSON) must survive that.
    The agent here does what ssh does, on this machine: drop the host, join the
    words with spaces and run the line with sh -c, in a bare environment (ssh
    carries none), so PYTHONPATH must arrive in the keeper's spec."""
    agent = tmp_path / "bin" / "ssh"
    agent.parent.mkdir()
    agent.write_text('#!/bin/sh\nshift\nexec env -i PATH="$PATH" HOME="$HOME" sh -c "$*"\n')
    agent.chmod(0o755)
    (tmp_path / "it's here.py").write_text(
        "import json, os, sys\n"
        "import pmetal\n"  # found through the PYTHONPATH the spec carried
        "print(json.dumps([os.environ['PMETAL_RANK'], os.environ['PMETAL_NODES'],"
        " sys.argv[1:], os.path.dirname(pmetal.__file__)]))\n")
    done = subprocess.run(
        [sys.executable, "-m", "pmetal", "launch", "--hosts", "alpha,beta",
         "--rsh", f"{agent} {{host}}", "--addresses", "alpha=127.0.0.1,beta=127.0.0.2",
         "--tag-output", "it's here.py", "a b", '"$HOME"'],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=DEADLINE,
        check=False)
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.splitlines())
    package = os.path.dirname(pmetal.__file__)  # the one this test imported, not another
    nodes = "127.0.0.1:52480,127.0.0.2:52480"
    assert [json.loads(line.partition(" ")[2]) for line in lines] == [
        [str(r), nodes, ["a b", '"$HOME"'], package] for r in range(2)]


# ------------------------------------- with the collectives runtime (after the merge)

ALL_REDUCE_SCRIPT = """
import numpy as np, pmetal
config = pmetal.DistributedConfig.from_env()
ctx = pmetal.DistributedContext(pmetal.RingBackend(config))
x = np.full(1000, config.rank + 1, np.int64)
ctx.all_reduce_blocking(x, pmetal.ReduceOp.SUM)
print(config.rank, int(x.min()), int(x.max()), flush=True)
ctx.close()
"""


def _all_reduce(folder: Path, launch_args: Sequence[str], n: int, **env: str) -> None:
    if not hasattr(pmetal, "DistributedConfig"):
        pytest.skip("needs the collectives' SPMD API (pmetal.DistributedConfig)")
    (folder / "all_reduce.py").write_text(ALL_REDUCE_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "pmetal", "launch", *launch_args, "--tag-output",
         "--timeout", str(DEADLINE), "all_reduce.py"],
        cwd=folder, env={**_env(), **env}, capture_output=True, text=True,
        timeout=2 * DEADLINE, check=False)
    assert done.returncode == 0, done.stderr
    total = n * (n + 1) // 2
    assert sorted(done.stdout.splitlines()) == [f"[{r}] {r} {total} {total}" for r in range(n)]


def test_launched_ranks_all_reduce_on_loopback(tmp_path: Path) -> None:
    _all_reduce(tmp_path, ["-n", "3"], 3)


def test_launched_ranks_all_reduce_across_namespaces(netlab: Callable[[int], NetLab],
                                                     tmp_path: Path) -> None:
    lab = netlab(2)
    h1, h2 = lab.hosts
    _all_reduce(tmp_path, ["--hosts", f"{h1.name}:2,{h2.name}:2",
                           "--rsh", "ip netns exec {host}",
                           "--addresses", f"{h1.name}={h1.address},{h2.name}={h2.address}"],
                4, PMETAL_PSK="a-psk-for-the-launch-lab-test")
