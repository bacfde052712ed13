"""pmetal nodes on the hosts of a network-namespace lab (tests/netlab.py).

:class:`LabCluster` starts one node daemon per host (``python -m
pmetal.node.daemon`` on the host's address, discovering with mDNS on that
address only) and one *probe* per node: a client on the same host that
prints the node's :class:`~pmetal.wire.ClusterState` as a JSON line each
time it changes (a WatchCluster long poll, no polling). The test reads every
probe's lines as they come and waits on conditions over the latest state of
each node, with deadlines; :meth:`LabCluster.wait` returns how long the
condition took, which the tests print.

Programs run inside the lab's namespaces only, so all traffic stays on the
lab's bridge.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netlab import NetLab

ROOT = Path(__file__).resolve().parents[2]
PORT = 7100

PROBE = r"""
import json, sys, time
from pmetal.actors.client import CoreClient
from pmetal.config import load_config
from pmetal.security import NetworkNamespace
cfg = load_config(transport={"connect_timeout": 5.0, "request_timeout": 5.0})
ns = NetworkNamespace(sys.argv[2], bytes.fromhex(sys.argv[3]))
client = CoreClient(sys.argv[1], ns, cfg)
print(json.dumps({"ready": client.node_id, "t": time.time()}), flush=True)
version = -1
while True:
    if not client.watch.wait(lambda s: s.version != version, time.monotonic() + 1.0):
        if client.watch._thread.is_alive():
            continue
        break
    s = client.watch.state
    version = s.version
    print(json.dumps({"t": time.time(), "node": client.node_id, "master": s.master,
                      "term": s.term, "epoch": s.epoch, "members": list(s.members),
                      "dead": list(s.dead), "version": s.version}), flush=True)
"""

# Answers LabCluster.status: one client of the node for the node's life, one
# JSON line per request line ("0" or "1": probe), so that a test that asks
# often does not pay a process start and a handshake per question.
ASKER = r"""
import json, sys, traceback
from pmetal.actors.client import CoreClient
from pmetal.config import load_config
from pmetal.security import NetworkNamespace
ns = NetworkNamespace(sys.argv[2], bytes.fromhex(sys.argv[3]))
client = CoreClient(sys.argv[1], ns, load_config())
for line in sys.stdin:
    try:
        out = {"status": client.status(probe=line.strip() == "1")}
    except Exception:
        out = {"error": traceback.format_exc()}
    print(json.dumps(out, default=str), flush=True)
client.close()
"""


@dataclass
class Node:
    index: int
    address: str          # tcp://ip:port
    node_id: str
    proc: subprocess.Popen[Any]
    started: float        # wall clock when the process was started
    log: Path
    state: dict[str, Any] = field(default_factory=dict)   # the probe's latest line
    history: list[dict[str, Any]] = field(default_factory=list)  # every line, in order
    probe: subprocess.Popen[Any] | None = None
    asker: subprocess.Popen[bytes] | None = None   # LabCluster.status's client, on first use


class LabCluster:
    """Node daemons on lab hosts; see the module docstring."""

    def __init__(self, lab: NetLab, tmp: Path, *, psk: bytes | None = None,
                 namespace: str = "lab", env: dict[str, str] | None = None,
                 discovery: bool = True) -> None:
        self.lab = lab
        self.tmp = tmp
        self.psk = psk or secrets.token_bytes(32)
        self.namespace = namespace
        self.env = env or {}
        self.discovery = discovery
        self.nodes: dict[int, Node] = {}
        self._changed = threading.Condition()

    def _env(self, index: int, psk: bytes) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
        env.update(self.env)
        home = self.tmp / f"h{index}"
        home.mkdir(mode=0o700, exist_ok=True)
        env.update(PMETAL_HOME=str(home), PMETAL_PSK_HEX=psk.hex(),
                   PMETAL_SECURITY_NAMESPACE=self.namespace, PMETAL_LOG_LEVEL="INFO",
                   PYTHONPATH=str(ROOT))
        return env

    def start(self, index: int, *, psk: bytes | None = None, probe: bool = True,
              extra: list[str] | None = None) -> Node:
        """Start the node of host ``index`` (and its probe)."""
        return self.start_many([index], psk=psk, probe=probe, extra=extra)[0]

    def start_many(self, indexes: list[int], *, psk: bytes | None = None, probe: bool = True,
                   extra: list[str] | None = None) -> list[Node]:
        """Start the nodes of hosts ``indexes`` at once, then wait for each."""
        psk = psk or self.psk
        spawned = []
        for index in indexes:
            host = self.lab.host(index)
            log = self.tmp / f"node-h{index}-{len(list(self.tmp.glob(f'node-h{index}-*')))}.log"
            started = time.time()
            proc = self.lab.run(host, [sys.executable, "-m", "pmetal.node",
                                       "--host", host.address, "--port", str(PORT),
                                       *(["--discovery", "--interfaces", host.address]
                                         if self.discovery else
                                         ["--no-discovery", "--peers", ",".join(
                                             f"{h.address}:{PORT}" for h in self.lab.hosts
                                             if h is not host)]),
                                       "--num-workers", "2", "--num-task-workers", "1",
                                       *(extra or [])],
                                stdout=subprocess.PIPE, stderr=log.open("wb"),
                                stdin=subprocess.DEVNULL, env=self._env(index, psk), cwd=ROOT)
            spawned.append((index, proc, started, log))
        from pmetal.node.daemon import read_ready_line
        nodes = []
        for index, proc, started, log in spawned:
            _head, address, node_id = read_ready_line(proc, 30.0).split()[:3]
            node = Node(index, address, node_id, proc, started, log)
            self.nodes[index] = node
            nodes.append(node)
        for node in nodes:
            if probe:
                node.probe = self.lab.run(self.lab.host(node.index),
                                          [sys.executable, "-c", PROBE, node.address,
                                           self.namespace, psk.hex()],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          stdin=subprocess.DEVNULL,
                                          env=self._env(node.index, psk), cwd=ROOT)
                threading.Thread(target=self._read, args=(node,), daemon=True).start()
        return nodes

    def _read(self, node: Node) -> None:
        assert node.probe is not None and node.probe.stdout is not None
        for line in node.probe.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "ready" in msg:
                continue
            with self._changed:
                node.state = msg
                node.history.append(msg)
                self._changed.notify_all()

    # ----------------------------------------------------------- conditions

    def wait(self, cond: Callable[[], bool], timeout: float, what: str) -> float:
        """Seconds until ``cond()`` holds; AssertionError naming ``what`` and
        every node's state after ``timeout``."""
        start = time.monotonic()
        with self._changed:
            while not cond():
                remaining = start + timeout - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"{what}: not within {timeout:g} s; states: "
                                         f"{self.describe()}")
                self._changed.wait(min(remaining, 0.2))
        return time.monotonic() - start

    def status(self, index: int, probe: bool = False) -> dict[str, Any]:
        """``status()`` of node ``index``, asked by a client on its host: one
        client process per node, started on the first question and kept
        (each answer is asked anew of the node)."""
        node = self.nodes[index]
        if node.asker is None or node.asker.poll() is not None:
            with (self.tmp / f"asker-h{index}.log").open("ab") as log:
                node.asker = self.lab.python(index, ASKER, node.address, self.namespace,
                                             self.psk.hex(), stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=log,
                                             env=self._env(index, self.psk), cwd=ROOT)
        asker = node.asker
        assert asker.stdin is not None and asker.stdout is not None
        try:
            asker.stdin.write(b"1\n" if probe else b"0\n")
            asker.stdin.flush()
            # It prints exactly one line per question: read whole chunks.
            data = b""
            deadline = time.monotonic() + 30.0
            with selectors.DefaultSelector() as sel:
                sel.register(asker.stdout.fileno(), selectors.EVENT_READ)
                while not data.endswith(b"\n"):
                    left = deadline - time.monotonic()
                    if left <= 0 or not sel.select(left):
                        raise AssertionError(f"node {index} gave no status within 30 s")
                    chunk = os.read(asker.stdout.fileno(), 1 << 16)
                    if not chunk:
                        raise AssertionError(f"the status client of node {index} exited "
                                             f"with {asker.wait(timeout=10)}")
                    data += chunk
        except (AssertionError, OSError):
            asker.kill()    # a late answer must not be read as the next one's
            asker.wait(timeout=10)
            raise
        answer = json.loads(data)
        assert "status" in answer, answer["error"]
        return answer["status"]

    def describe(self) -> str:
        return json.dumps({i: {k: (v[:8] if isinstance(v, str) else
                                   [x[:8] for x in v] if isinstance(v, list) else v)
                               for k, v in n.state.items() if k != "node"}
                           for i, n in self.nodes.items()})

    def live(self, indexes: list[int] | None = None) -> list[Node]:
        return [n for i, n in sorted(self.nodes.items())
                if (indexes is None or i in indexes) and n.proc.poll() is None]

    def agreed(self, indexes: list[int], members: list[int] | None = None,
               exclude: str = "") -> bool:
        """The nodes ``indexes`` agree on one master (not ``exclude``), term
        and epoch, and (given ``members``) list exactly those nodes."""
        states = [self.nodes[i].state for i in indexes]
        if not all(s.get("master") for s in states):
            return False
        keys = {(s["master"], s["term"], s["epoch"]) for s in states}
        if len(keys) != 1 or next(iter(keys))[0] == exclude:
            return False
        if members is not None:
            want = sorted(self.nodes[i].node_id for i in members)
            return all(sorted(s.get("members", [])) == want for s in states)
        return True

    # --------------------------------------------------------------- faults

    def pids(self, index: int) -> list[int]:
        """Every process on host ``index`` (the node, its workers, the probe)."""
        out = subprocess.run(["ip", "netns", "pids", self.lab.host(index).name],
                             capture_output=True, text=True, timeout=10).stdout
        return [int(p) for p in out.split()]

    def kill(self, index: int) -> None:
        """The machine dies: SIGKILL to every process on the host."""
        for pid in self.pids(index):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node = self.nodes[index]
        node.proc.wait(timeout=10)
        for proc in (node.probe, node.asker):
            if proc is not None:
                proc.wait(timeout=10)
        node.state = {}

    def signal(self, index: int, sig: int, *, keep_probe: bool = False) -> None:
        node = self.nodes[index]
        probe = node.probe.pid if node.probe is not None and keep_probe else None
        for pid in self.pids(index):
            if pid != probe:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        for node in self.nodes.values():
            for proc in (node.asker, node.probe, node.proc):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
        for node in self.nodes.values():
            for proc in (node.asker, node.probe, node.proc):
                if proc is not None:
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(timeout=5)

    @contextlib.contextmanager
    def driver(self, index: int, script: str, args: Sequence[str], name: str, *,
               stdin: bool = False) -> Iterator[subprocess.Popen[bytes]]:
        """``python -c script args...`` on host ``index`` as a client of its
        node (the lab's PSK and namespace in its environment), stdout piped
        for :func:`read_line`, stderr to ``tmp/<name>.log``; killed if still
        running at the end, and the log's tail printed."""
        path = self.tmp / f"{name}.log"
        try:
            with path.open("wb") as log:
                proc = self.lab.run(self.lab.host(index), [sys.executable, "-c", script, *args],
                                    stdin=subprocess.PIPE if stdin else None,
                                    stdout=subprocess.PIPE, stderr=log,
                                    env=self._env(index, self.psk), cwd=ROOT)
                try:
                    yield proc
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait(timeout=10.0)
        finally:   # also when the test failed: the driver's traceback says why
            print(path.read_text(errors="replace")[-3000:])


@contextlib.contextmanager
def formed_cluster(hosts: list[int], tmp: Path) -> Iterator[LabCluster]:
    """A lab of ``hosts`` with a node on each (static peers, no mDNS), once
    every node agrees on the membership."""
    with NetLab(len(hosts)) as lab:
        c = LabCluster(lab, tmp, discovery=False)
        try:
            c.start_many(hosts)
            c.wait(lambda: c.agreed(hosts, members=hosts), 30.0,
                   f"{len(hosts)} members agreed")
            yield c
        finally:
            c.close()


def read_line(proc: subprocess.Popen[bytes], timeout: float, what: str) -> dict[str, Any]:
    """The next JSON line a driver prints, which must be step ``what``;
    fails after ``timeout`` seconds or when the driver exits first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ)
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise AssertionError(f"the driver printed no {what} line within {timeout} s")
            chunk = os.read(proc.stdout.fileno(), 1)   # one byte: leave the next line
            if not chunk:
                raise AssertionError(f"the driver exited with {proc.poll()} before {what}")
            data += chunk
    line = json.loads(data)
    assert line.get("step") == what, line
    return line
