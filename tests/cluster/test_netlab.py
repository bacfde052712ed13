"""The namespace lab (tests/netlab.py) does what cluster tests rely on.

Every check runs real programs inside the lab's host namespaces: a small
agent per host serves TCP on its address and, on request, probes others
over TCP or sends and receives an mDNS-style multicast datagram.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any


from netlab import NetLab, _base36, require_netlab

WAIT = 5.0
BLOCKED = 0.5
"""A connection attempt that has not succeeded within this is counted as
blocked: on the lab's bridge a reachable peer answers in well under 10 ms."""

AGENT = r"""
import json, socket, struct, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
me = sys.argv[1]
srv = socket.create_server((me, 7000))
def serve():
    while True:
        conn, _ = srv.accept()
        with conn:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            conn.sendall(str(len(data)).encode())
threading.Thread(target=serve, daemon=True).start()
def probe(addr, timeout):
    try:
        with socket.create_connection((addr, 7000), timeout=timeout, source_address=(me, 0)) as s:
            s.shutdown(socket.SHUT_WR)
            return s.recv(16) == b"0"
    except OSError:
        return False
def send(addr, size):
    t0 = time.monotonic()
    with socket.create_connection((addr, 7000), timeout=30) as s:
        s.sendall(b"x" * size); s.shutdown(socket.SHUT_WR)
        assert int(s.recv(16)) == size
    return time.monotonic() - t0
listener = None
print(json.dumps("ready"), flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "probe":
        timeout = float(args[0])
        with ThreadPoolExecutor(16) as pool:
            out = dict(zip(args[1:], pool.map(lambda a: probe(a, timeout), args[1:])))
    elif cmd == "mjoin":
        listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("224.0.0.251", 5353))
        listener.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                            socket.inet_aton("224.0.0.251") + socket.inet_aton(me))
        out = "joined"
    elif cmd == "mrecv":
        listener.settimeout(float(args[0]))
        try:
            data, src = listener.recvfrom(2048)
            out = [data.decode(), src[0]]
        except socket.timeout:
            out = None
    elif cmd == "msend":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(me))
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)
        s.sendto(args[0].encode(), ("224.0.0.251", 5353))
        out = "sent"
    elif cmd == "send":
        out = send(args[0], int(args[1]))
    print(json.dumps(out), flush=True)
"""


class Agents:
    """One agent per lab host, driven line by line over its stdin/stdout."""

    def __init__(self, lab: NetLab) -> None:
        self.lab = lab
        self.procs = {h.index: lab.python(h, AGENT, h.address, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, bufsize=1)
                      for h in lab.hosts}
        for i in self.procs:
            assert self._read(i, WAIT) == "ready"

    def _read(self, i: int, timeout: float) -> Any:
        proc = self.procs[i]
        assert proc.stdout is not None
        import select
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        assert ready, f"agent on h{i} gave no answer within {timeout} s"
        line = proc.stdout.readline()
        assert line, f"agent on h{i} exited ({proc.poll()})"
        return json.loads(line)

    def ask(self, i: int, *words: object, timeout: float = WAIT) -> Any:
        proc = self.procs[i]
        assert proc.stdin is not None
        proc.stdin.write(" ".join(map(str, words)) + "\n")
        return self._read(i, timeout)

    def reach(self, timeout: float = BLOCKED) -> set[tuple[int, int]]:
        """Every ordered pair (i, j) where host i connected to host j."""
        addr = {h.index: h.address for h in self.lab.hosts}
        pairs = set()
        for i in self.procs:  # ask everyone first: the probes run in parallel
            proc = self.procs[i]
            assert proc.stdin is not None
            others = [addr[j] for j in addr if j != i]
            proc.stdin.write(f"probe {timeout} {' '.join(others)}\n")
        back = {a: j for j, a in addr.items()}
        for i in self.procs:
            for a, ok in self._read(i, WAIT + timeout).items():
                if ok:
                    pairs.add((i, back[a]))
        return pairs


def all_pairs(hosts: list[int]) -> set[tuple[int, int]]:
    return {(i, j) for i in hosts for j in hosts if i != j}


def test_hosts_reach_each_other_and_setup_is_fast(netlab):
    t0 = time.monotonic()
    lab = netlab(4)
    took = time.monotonic() - t0
    print(f"lab of 4 hosts up in {took:.3f} s")
    assert took < WAIT
    assert [h.address for h in lab.hosts] == [f"{lab.subnet}.{10 + i}" for i in range(1, 5)]
    assert len(lab.prefix) <= 10
    agents = Agents(lab)
    assert agents.reach(timeout=WAIT) == all_pairs([1, 2, 3, 4])


def test_partition_blocks_exactly_the_cross_group_pairs_and_heal_restores(netlab):
    lab = netlab(4)
    agents = Agents(lab)
    lab.partition([1, 2, 3], [4])
    assert agents.reach() == all_pairs([1, 2, 3])
    lab.partition([1, 2], [3, 4])
    assert agents.reach() == all_pairs([1, 2]) | all_pairs([3, 4])
    lab.heal()
    assert agents.reach(timeout=WAIT) == all_pairs([1, 2, 3, 4])


def test_isolate_and_rejoin(netlab):
    lab = netlab(3)
    agents = Agents(lab)
    lab.isolate(2)
    assert agents.reach() == all_pairs([1, 3])
    lab.rejoin(2)
    assert agents.reach(timeout=WAIT) == all_pairs([1, 2, 3])


def test_multicast_datagram_reaches_other_hosts_but_not_across_a_partition(netlab):
    lab = netlab(3)
    agents = Agents(lab)
    for i in (2, 3):
        assert agents.ask(i, "mjoin") == "joined"
    assert agents.ask(1, "msend", "hello") == "sent"
    for i in (2, 3):
        assert agents.ask(i, "mrecv", WAIT, timeout=2 * WAIT) == ["hello", lab.hosts[0].address]
    lab.partition([1, 2], [3])
    assert agents.ask(1, "msend", "split") == "sent"
    assert agents.ask(2, "mrecv", WAIT, timeout=2 * WAIT) == ["split", lab.hosts[0].address]
    assert agents.ask(3, "mrecv", BLOCKED) is None


def test_shape_limits_the_rate(netlab):
    require_netlab(tc=True)
    lab = netlab(2)
    agents = Agents(lab)
    size = 400_000
    fast = agents.ask(1, "send", lab.hosts[1].address, size)
    lab.shape(1, "4mbit")  # 500 kB/s after a 64 kB burst: >= 0.6 s
    slow = agents.ask(1, "send", lab.hosts[1].address, size, timeout=30)
    lab.unshape(1)
    again = agents.ask(1, "send", lab.hosts[1].address, size)
    print(f"{size} bytes: {fast:.3f} s unshaped, {slow:.3f} s at 4mbit, {again:.3f} s unshaped")
    assert slow > 0.4 > again


def test_close_kills_every_process_and_deletes_the_namespaces():
    require_netlab()
    lab = NetLab(2).up()
    names = lab.namespaces()
    assert len(names) == 3
    # A process that forks a child and exits, as a daemon does: close() must
    # find the child by its namespace, not only what run() started.
    lab.run(1, ["sh", "-c", "sleep 600 & echo $!"], stdout=subprocess.PIPE, text=True)
    lab.python(2, "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print('up', flush=True); time.sleep(600)", stdout=subprocess.PIPE, text=True)
    proc = lab._procs[0]
    daemon = int(proc.stdout.readline())
    assert lab._procs[1].stdout.readline() == "up\n"
    assert daemon in lab.pids()
    lab.grace = 0.2  # the TERM-ignoring one is then killed
    t0 = time.monotonic()
    lab.close()
    print(f"closed in {time.monotonic() - t0:.3f} s")
    assert lab.namespaces() == []
    assert not running(daemon)
    assert all(p.returncode is not None for p in lab._procs)


def running(pid: int) -> bool:
    """Whether ``pid`` still runs (an orphan's zombie awaiting its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stale_lab_of_a_dead_process_is_cleaned_at_start():
    require_netlab()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"pm{_base36(dead.pid, 5)}1-h1"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with NetLab(1) as lab:
            assert not os.path.exists(f"/run/netns/{stale}")
            assert lab.namespaces() == [lab.switch, lab.hosts[0].name]
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
