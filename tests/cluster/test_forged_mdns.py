"""mDNS is only a hint: a stranger's records cannot move, refuse or fence a
member, nor make the nodes dial a victim for ever, nor cost them memory and
log lines without bound.

Three node daemons (hosts 1-3 of a lab, tests/netlab.py) form a cluster with
mDNS; host 4 is a stranger without the PSK (tests/cluster/stranger.py) that
reads the nodes' public records and announces forged ones with
python-zeroconf on its own address, and runs a victim: a TCP port that
counts who connects to it. The tests share the lab and run in order; each
starts from an agreed cluster and withdraws its records at the end.

The nodes run with short candidate settings (backoff 0.2 s up to 1 s, given
up after 3 s) so that "the dials stop" is seen in seconds; the defaults
(0.5 s up to 30 s, 60 s) are the same mechanism, slower.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from netlab import NetLab, lab_available

from .lab import PORT, ROOT, LabCluster

pytestmark = pytest.mark.skipif(lab_available() is not None, reason=lab_available() or "")

HOSTS = [1, 2, 3]
STRANGER = 4
BOUND = 20.0
GIVE_UP = 3.0
SETTINGS = {"PMETAL_DISCOVERY_BACKOFF": "0.2", "PMETAL_DISCOVERY_BACKOFF_MAX": "1.0",
            "PMETAL_DISCOVERY_GIVE_UP": str(GIVE_UP)}
# What a member's trouble logs: none of it may follow from a record.
TROUBLE = re.compile(r"fencing this node|fenced by master|is dead|refused node|cloned identity"
                     r"|no master|refused our Beat|handshake refused")

VICTIM = r"""
import json, select, socket, sys, threading, time
host, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
lock = threading.Lock()
dials = {}   # (port, peer ip) -> [times]
def serve(port):
    srv = socket.create_server((host, port), backlog=512)
    held = []
    while True:
        conn, (ip, _) = srv.accept()
        with lock:
            dials.setdefault(f"{port} {ip}", []).append(time.time())
        held.append(conn)   # silent: a dial costs one connection until its owner gives up
        held = [c for c in held if select.select([c], [], [], 0)[0] == [] or c.recv(1024)]
for port in ports:
    threading.Thread(target=serve, args=(port,), daemon=True).start()
print(json.dumps({"ready": ports}), flush=True)
for line in sys.stdin:
    with lock:
        print(json.dumps({k: v[:] for k, v in dials.items()}), flush=True)
"""


class Process:
    """A helper process on a lab host that answers one JSON line per command."""

    def __init__(self, proc: subprocess.Popen[str], what: str) -> None:
        self.proc = proc
        self.what = what
        self.ready = self._line(BOUND)

    def _line(self, timeout: float) -> dict[str, Any]:
        import selectors
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise AssertionError(f"the {self.what} answered nothing within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the {self.what} exited ({self.proc.poll()})")
        return json.loads(line)

    def ask(self, command: str, timeout: float = BOUND) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line(timeout)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabCluster, Process, Process]]:
    with NetLab(4) as net:
        tmp = tmp_path_factory.mktemp("forged")
        c = LabCluster(net, tmp, env=SETTINGS)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
        env["PYTHONPATH"] = str(ROOT)
        host = net.host(STRANGER)
        try:
            c.start_many(HOSTS)
            stranger = Process(net.python(STRANGER, Path(ROOT / "tests/cluster/stranger.py")
                                          .read_text(), host.address, text=True, env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE),
                               "stranger")
            victim = Process(net.python(STRANGER, VICTIM, host.address, "7300", "7301", "7302",
                                        text=True, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE), "victim")
            c.wait(lambda: c.agreed(HOSTS, HOSTS), BOUND, "three nodes agree")
            yield c, stranger, victim
        finally:
            c.close()


def _status(c: LabCluster, index: int) -> dict[str, Any]:
    return c.status(index)["cluster"]


def _until(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll ``cond`` until it returns something true; its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(every)


def _log_lines(c: LabCluster) -> dict[int, list[str]]:
    return {i: c.nodes[i].log.read_text(errors="replace").splitlines() for i in HOSTS}


def _proc_stat(pid: int) -> tuple[int, int]:
    """(open fds, resident KiB) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
               .splitlines() if line.startswith("VmRSS:"))
    return fds, rss


def _cluster_template(stranger: Process) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """What the stranger copies: a live record's TXT (the public ns tag)."""
    records = stranger.ask(f"copy {len(HOSTS)} 10", timeout=30)["records"]
    live = [r for r in records if r["ns"]]
    assert len(live) >= len(HOSTS), f"the stranger saw {records}"
    return dict(live[0]["txt"]), live


def _dials(victim: Process, port: int) -> dict[str, list[float]]:
    """Times of the dials to ``port`` of the victim, by the dialling node's IP."""
    return {k.split()[1]: v for k, v in victim.ask("count").items()
            if int(k.split()[0]) == port}


def _quiet_since(victim: Process, port: int, quiet: float) -> float | None:
    """The time of the last dial to ``port`` once none came for ``quiet`` s."""
    times = [t for v in _dials(victim, port).values() for t in v]
    last = max(times, default=0.0)
    return last if time.time() - last >= quiet else None


# ----------------------------------------------------------------- tests

def test_a_forged_record_of_a_live_id_moves_refuses_and_fences_nobody(lab) -> None:
    c, stranger, _victim = lab
    c.wait(lambda: c.agreed(HOSTS, HOSTS), BOUND, "agreement")
    txt, live = _cluster_template(stranger)
    master = c.nodes[HOSTS[0]].state["master"]
    term = c.nodes[HOSTS[0]].state["term"]
    assert master in {r["id"] for r in live}   # the id is public: copied from its record
    addresses = {n.node_id: n.address for n in c.live(HOSTS)}
    before = _log_lines(c)
    marks = {i: len(c.nodes[i].history) for i in HOSTS}
    # The attack of the issue: seven records of the master's id over the
    # attack, at the stranger's address (the node port, where nothing
    # listens) and at another member's address (a pmetal node that proves
    # another id there).
    other = next(n for n in c.live(HOSTS) if n.node_id != master)
    stranger.ask(f"forge 1 {PORT} {master} - {json.dumps(txt)}")
    start = time.monotonic()
    for k in range(6):
        target = other.address.rpartition(":")[2] if k % 2 else str(PORT)
        stranger.ask(f"forge 1 {target} {master} - {json.dumps(txt)}")
        # Every other node must have dialled the forged address and failed
        # there; the master must have read the record of its own id.
        if k == 0:
            for i in HOSTS:
                if c.nodes[i].node_id == master:
                    _until(lambda i=i: any(r["kind"] == "duplicate"
                                           for r in _status(c, i)["ignored"]),
                           BOUND, "the master flagged a record of its own id")
                else:
                    _until(lambda i=i: _status(c, i)["statistics"]["candidate_failures"] >= 1,
                           BOUND, f"node {i} dialled the forged address and failed")
    # Hold the forgery for well past dead_after (0.8 s) several times over,
    # or until a node sees a death or another master.
    c.wait(lambda: any(n.state.get("dead") or n.state.get("master") != master
                       for n in c.live(HOSTS)) or time.monotonic() - start > 6.0,
           BOUND, "the attack's end")
    print(f"\n[forged] 7 records of the master's id stood for "
          f"{time.monotonic() - start:.1f} s")
    for i in HOSTS:
        states = c.nodes[i].history[marks[i]:]
        assert states == [] or all(s["master"] == master and s["term"] == term
                                   and s["dead"] == [] and len(s["members"]) == len(HOSTS)
                                   for s in states), (i, states)
        assert c.nodes[i].state["master"] == master and not c.nodes[i].state["dead"]
        status = _status(c, i)
        stats = status["statistics"]
        assert stats["fenced"] == 0 and stats["clones_refused"] == 0, stats
        listed = {m["node_id"]: m["address"] for m in status["members"]}
        assert listed == addresses, (listed, addresses)
        assert {m["health"] for m in status["members"]} <= {"self", "healthy", "degraded"}
        assert stats["candidate_failures"] >= (c.nodes[i].node_id != master), stats
    after = _log_lines(c)
    for i in HOSTS:
        new = after[i][len(before[i]):]
        trouble = [line for line in new if TROUBLE.search(line)]
        assert trouble == [], (i, trouble)
    assert stranger.ask("withdraw")["withdrawn"] == 7


def test_five_hundred_records_at_a_victim_port_dial_it_little_and_stop(lab) -> None:
    c, stranger, victim = lab
    c.wait(lambda: c.agreed(HOSTS, HOSTS), BOUND, "agreement")
    txt, _ = _cluster_template(stranger)
    pids = {i: c.nodes[i].proc.pid for i in HOSTS}
    base = {i: _proc_stat(pid) for i, pid in pids.items()}
    ips = {c.lab.host(i).address for i in HOSTS}
    stranger.ask(f"forge 500 7300 random - {json.dumps(txt)}", timeout=30)
    sent = time.time()
    _until(lambda: set(_dials(victim, 7300)) >= ips or None, BOUND,
           "every node dialled the victim")
    # During the attack: fds and memory stay near where they were.
    peak = dict(base)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        for i, pid in pids.items():
            fds, rss = _proc_stat(pid)
            peak[i] = (max(peak[i][0], fds), max(peak[i][1], rss))
        time.sleep(0.1)
    withdrawn = time.time()
    assert stranger.ask("withdraw", timeout=30)["withdrawn"] == 500
    last = _until(lambda: _quiet_since(victim, 7300, 3.0), 30.0 + 3.0,
                  "no dial to the victim for 3 s")
    dials = _dials(victim, 7300)
    counts = {ip: len(v) for ip, v in dials.items()}
    print(f"\n[forged] 500 records at a victim port: dials per node {counts} in "
          f"{withdrawn - sent:.1f} s of attack; the last {last - withdrawn:+.2f} s after "
          f"the withdrawal; fds {base} -> peak {peak}")
    assert last - withdrawn < 30.0
    for i in HOSTS:
        assert peak[i][0] - base[i][0] <= 16, (i, base[i], peak[i])
        assert peak[i][1] - base[i][1] <= 16 * 1024, (i, base[i], peak[i])
    # One address, one candidate: a handful of dials, not one per record.
    assert max(counts.values()) <= 20, counts
    for i in HOSTS:
        stats = _status(c, i)["statistics"]
        assert stats["candidates"] == 0 and stats["fenced"] == 0, stats
    assert c.agreed(HOSTS, HOSTS) and not any(n.state["dead"] for n in c.live(HOSTS))


def test_records_never_withdrawn_are_given_up(lab) -> None:
    """The stranger's records stay (as after a crash: caches keep them for an
    hour); the dials stop after ``give_up`` anyway, and stay stopped."""
    c, stranger, victim = lab
    txt, _ = _cluster_template(stranger)
    ips = {c.lab.host(i).address for i in HOSTS}
    stranger.ask(f"forge 50 7301 random - {json.dumps(txt)}")
    _until(lambda: set(_dials(victim, 7301)) >= ips or None, BOUND,
           "every node dialled the victim")
    # Quiet for twice give_up: the rest outlasts it while the records stay.
    last = _until(lambda: _quiet_since(victim, 7301, 2 * GIVE_UP), BOUND + 2 * GIVE_UP,
                  f"no dial for {2 * GIVE_UP:g} s")
    dials = _dials(victim, 7301)
    first = min(t for v in dials.values() for t in v)
    print(f"\n[forged] records kept: dials per node {[len(v) for v in dials.values()]}, "
          f"stopped {last - first:.2f} s after the first (give_up {GIVE_UP:g} s)")
    # The first failure comes a handshake timeout (0.8 s) after the first
    # dial, the last dial at most backoff_max (1 s) after give_up: 4.8 s.
    assert last - first < GIVE_UP + 5.0
    for i in HOSTS:
        stats = _status(c, i)["statistics"]
        assert stats["candidates_given_up"] >= 1, stats
    assert stranger.ask("withdraw")["withdrawn"] == 50


def test_other_namespace_records_cost_little_memory_and_few_log_lines(lab) -> None:
    c, stranger, _victim = lab
    c.wait(lambda: c.agreed(HOSTS, HOSTS), BOUND, "agreement")
    txt, _ = _cluster_template(stranger)
    txt["ns"] = secrets.token_hex(8)
    pids = {i: c.nodes[i].proc.pid for i in HOSTS}
    seen0 = {i: _status(c, i)["discovery_statistics"]["records"] for i in HOSTS}
    base = {i: _proc_stat(pid) for i, pid in pids.items()}
    before = _log_lines(c)
    stranger.ask(f"forge 2500 7302 random - {json.dumps(txt)}", timeout=60)
    # mDNS is UDP: a few records of a flood may be lost (more on a busy machine).
    for i in HOSTS:
        _until(lambda i=i: _status(c, i)["discovery_statistics"]["records"] - seen0[i] >= 2250,
               30.0, f"node {i} read 2,250 of the 2,500 records", every=1.0)
    after = {i: _proc_stat(pid) for i, pid in pids.items()}
    lines = _log_lines(c)
    new = {i: lines[i][len(before[i]):] for i in HOSTS}
    print(f"\n[forged] 2,500 other-namespace records: resident KiB {base} -> {after}; "
          f"new log lines {[len(v) for v in new.values()]}")
    for i in HOSTS:
        assert after[i][1] - base[i][1] < 5 * 1024, (i, base[i], after[i])
        assert len(new[i]) <= 10, new[i]
        assert after[i][0] - base[i][0] <= 8, (i, base[i], after[i])
    stranger.ask("withdraw", timeout=60)


def test_a_member_that_moves_is_followed_once_it_proves_its_id(lab) -> None:
    """The other side of the rule: a node that restarts at another port,
    with its identity, is a member at the new address once a handshake
    there proved its id (its old record lingers, and is given up)."""
    c, _stranger, _victim = lab
    c.wait(lambda: c.agreed(HOSTS, HOSTS), BOUND, "agreement")
    moving = HOSTS[-1]
    node_id = c.nodes[moving].node_id
    c.kill(moving)
    node = c.start(moving, extra=["--port", str(PORT + 10)])
    assert node.node_id == node_id and node.address.endswith(f":{PORT + 10}")
    took = c.wait(lambda: c.agreed(HOSTS, HOSTS), 2 * BOUND, "agreement after the move")

    def moved() -> bool:
        return all({m["node_id"]: m["address"] for m in _status(c, i)["members"]}
                   .get(node_id) == node.address for i in HOSTS)

    _until(moved, BOUND, "every node lists the moved node at its new address", every=1.0)
    print(f"\n[forged] a node restarted at another port is a member there after {took:.2f} s")


def test_nodes_that_start_among_forged_records_form_their_cluster(lab) -> None:
    """A node founds its cluster among the nodes it found when bootstrap
    ends: forged records there would be members no one can outvote, and no
    master could ever be elected. Only proven nodes count."""
    c, stranger, _victim = lab
    txt, _ = _cluster_template(stranger)
    for i in HOSTS:
        c.kill(i)
    # Registered: the stranger answers the new nodes' first queries with them.
    assert stranger.ask(f"register 20 {PORT} random {json.dumps(txt)}",
                        timeout=60)["registered"] == 20
    c.start_many(HOSTS)
    took = c.wait(lambda: c.agreed(HOSTS, HOSTS), 2 * BOUND,
                  "three nodes started among 20 forged records agree on the three")
    print(f"\n[forged] three nodes started among 20 forged records agreed in {took:.2f} s")
    for i in HOSTS:
        status = _status(c, i)
        assert len(status["members"]) == len(HOSTS), status["members"]
        assert status["discovery_statistics"]["peers"] >= 20, status["discovery_statistics"]
        assert status["statistics"]["candidate_dials"] >= 1, status["statistics"]
    assert stranger.ask("withdraw")["withdrawn"] == 20
