"""An isolated multi-host network for tests, made of Linux network namespaces.

``NetLab(n)`` builds, inside namespaces of its own and nothing else:

- a *switch* namespace ``PREFIX-sw`` holding a Linux bridge ``br0`` and one
  port ``pI`` per host;
- *host* namespaces ``PREFIX-h1`` .. ``PREFIX-hN``, each with ``lo`` and an
  ``eth0`` that is the veth peer of its switch port, the address
  ``10.77.X.(10+I)/24`` (a range that exists only inside the lab), IPv6 off
  and the multicast route ``224.0.0.0/4`` on ``eth0`` so that mDNS works.

Both ends of every veth are created directly in their namespaces, so no
device ever appears in the root namespace and nothing is ever sent on the
machine's own interfaces. Programs run "on a host" through
:meth:`NetLab.run` (``ip netns exec``: Python 3.11 has no ``os.setns``).

Faults, all without nftables (not installed here, nor in CI):

- :meth:`NetLab.isolate` / :meth:`NetLab.rejoin`: a host's switch port down
  and up, as when a cable is pulled or a laptop leaves the Wi-Fi;
- :meth:`NetLab.partition` / :meth:`NetLab.heal`: every group's ports move
  to a bridge of its own in the switch, so frames cross no group boundary;
  healing moves them back to ``br0`` and flushes the hosts' neighbour tables
  (entries that failed during the partition would otherwise delay recovery);
- :meth:`NetLab.shape` / :meth:`NetLab.unshape`: a tbf rate limit in both
  directions of a host's link (this kernel has no netem, hence no delay).

Names: the prefix is ``pm`` + the owning process id (5 base-36 digits) + a
per-process counter, so labs of parallel pytest processes never clash, and a
lab left behind by a killed run is recognised (its owner is dead) and
deleted when the next lab is built. Labs of live processes are never touched.

Needs root and ``ip`` (iproute2); ``tc`` only for shaping. The ``netlab``
fixture and :func:`require_netlab` skip with the reason otherwise.
"""

from __future__ import annotations

import itertools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import pytest

__all__ = ["Host", "NetLab", "lab_available", "netlab", "require_netlab"]

NETNS_DIR = "/run/netns"
_NAME = re.compile(r"^pm([0-9a-z]{5})([0-9a-z]+)-(sw|h[0-9]+)$")
_counter = itertools.count(1)
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _base36(value: int, width: int = 1) -> str:
    out = ""
    while value:
        value, digit = divmod(value, 36)
        out = _DIGITS[digit] + out
    return out.rjust(width, "0")


def lab_available() -> str | None:
    """None when a lab can be built here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "the network-namespace lab needs root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the network-namespace lab needs ip(8) from iproute2"
    return None


def require_netlab(*, tc: bool = False) -> None:
    """Skip the calling test when a lab (and, with ``tc``, shaping) is impossible."""
    reason = lab_available()
    if reason is None and tc and shutil.which("tc") is None:
        reason = "shaping needs tc(8) from iproute2"
    if reason is not None:
        pytest.skip(reason)


def _ip(*args: str, stdin: str | None = None) -> None:
    """Run ``ip ARGS`` (``-batch -`` when given ``stdin``); raise with its stderr."""
    argv = ["ip", *args] + (["-batch", "-"] if stdin is not None else [])
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): "
                           f"{done.stderr.strip()}\n{stdin or ''}")


def _netns_inode(name: str) -> tuple[int, int] | None:
    try:
        st = os.stat(os.path.join(NETNS_DIR, name))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _pids_in(names: Sequence[str]) -> list[int]:
    """Processes whose network namespace is one of ``names`` (as ``ip netns pids``)."""
    wanted = {ino for ino in map(_netns_inode, names) if ino is not None}
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:  # exited meanwhile, or a kernel thread
            continue
        if (st.st_dev, st.st_ino) in wanted:
            pids.append(int(entry))
    return pids


def _wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait (on pidfds, no polling) until ``pids`` exit; return those still alive."""
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        alive = set(fds)
        while alive and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                alive.discard(fd)
                poller.unregister(fd)
        return [fds[fd] for fd in alive]
    finally:
        for fd in fds:
            os.close(fd)


def _kill_namespaces(names: Sequence[str], grace: float) -> None:
    """Stop every process living in ``names`` (TERM, then KILL), then delete them."""
    names = [n for n in names if _netns_inode(n) is not None]
    if not names:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = _pids_in(names)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        left = _wait_gone(pids, wait)
        if left and sig is signal.SIGKILL:
            raise RuntimeError(f"processes {left} in lab namespaces survived SIGKILL")
    # Hosts first: their veth ends go with them, then the switch.
    names = sorted(names, key=lambda n: n.endswith("-sw"))
    try:
        _ip(stdin="".join(f"netns del {n}\n" for n in names))
    except RuntimeError:
        # Another process cleaning the same stale lab (a second suite on this
        # machine) may have deleted one first, which stops the batch there:
        # delete what is still there, and fail only if that fails.
        left = [n for n in names if _netns_inode(n) is not None]
        if left:
            _ip(stdin="".join(f"netns del {n}\n" for n in left))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def clean_stale_labs() -> list[str]:
    """Delete the labs whose owning process is dead; return their namespaces."""
    try:
        entries = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    stale = []
    for name in entries:
        match = _NAME.match(name)
        if match is None:
            continue
        pid = int(match.group(1), 36)
        if pid == os.getpid():
            if match.group(2) in NetLab._live_counters:
                continue
        elif _alive(pid):
            continue
        stale.append(name)
    _kill_namespaces(stale, grace=0.0)
    return stale


@dataclass(frozen=True)
class Host:
    """One host of a lab: its namespace, its index (1..N) and its address."""

    name: str
    index: int
    address: str


HostRef = Host | int


class NetLab:
    """N hosts on one switch; a context manager (see the module docstring).

    ``__exit__`` (or :meth:`close`) stops every process living in the lab's
    namespaces, whether started by :meth:`run` or forked by one of them
    (a daemon), and deletes the namespaces.
    """

    _live_counters: set[str] = set()

    def __init__(self, n: int, *, grace: float = 1.0) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"a lab has 1..200 hosts, not {n}")
        seq = next(_counter)
        self.counter = _base36(seq)
        self.prefix = f"pm{_base36(os.getpid(), 5)}{self.counter}"
        # Unique per process and lab, although the ranges live in separate
        # namespaces and cannot clash anyway: it makes captures unambiguous.
        self.subnet = f"10.77.{(os.getpid() + seq) % 256}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = [Host(f"{self.prefix}-h{i}", i, f"{self.subnet}.{10 + i}")
                      for i in range(1, n + 1)]
        self.grace = grace
        self._procs: list[subprocess.Popen[Any]] = []
        self._bridges: list[str] = []
        self._up = False

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> NetLab:
        self.up()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def up(self) -> NetLab:
        reason = lab_available()
        if reason is not None:
            raise RuntimeError(reason)
        clean_stale_labs()
        NetLab._live_counters.add(self.counter)
        self._up = True
        names = [self.switch] + [h.name for h in self.hosts]
        try:
            _ip(stdin="".join(f"netns add {n}\n" for n in names))
            # IPv6 off before any device exists: no DAD, router or MLD chatter.
            script = "".join(
                f"ip netns exec {n} sysctl -qw net.ipv6.conf.all.disable_ipv6=1 "
                f"net.ipv6.conf.default.disable_ipv6=1\n" for n in names)
            done = subprocess.run(["sh", "-ec", script], capture_output=True, text=True,
                                  timeout=30)
            if done.returncode != 0:
                raise RuntimeError(f"disabling IPv6 in the lab failed: {done.stderr.strip()}")
            _ip("-n", self.switch, stdin="link set lo up\n"
                "link add br0 type bridge mcast_snooping 0\nlink set br0 up\n")
            for h in self.hosts:
                _ip("-n", h.name, stdin=(
                    "link set lo up\n"
                    f"link add eth0 type veth peer name p{h.index} netns {self.switch}\n"
                    f"addr add {h.address}/24 dev eth0\n"
                    "link set eth0 multicast on up\n"
                    "route add 224.0.0.0/4 dev eth0\n"))
            _ip("-n", self.switch, stdin="".join(
                f"link set p{h.index} master br0\nlink set p{h.index} up\n"
                for h in self.hosts))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if not self._up:
            return
        self._up = False
        try:
            _kill_namespaces([h.name for h in self.hosts] + [self.switch], self.grace)
        finally:
            for proc in self._procs:  # all dead by now: reap them, close their pipes
                proc.wait(timeout=5)
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
            NetLab._live_counters.discard(self.counter)

    # ------------------------------------------------------------- programs

    def host(self, ref: HostRef) -> Host:
        return ref if isinstance(ref, Host) else self.hosts[ref - 1]

    def argv(self, host: HostRef, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run on ``host`` (for callers that spawn themselves)."""
        return ["ip", "netns", "exec", self.host(host).name, *argv]

    def run(self, host: HostRef, argv: Sequence[str], **popen_kwargs: Any
            ) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``host``; it is killed, if still running, at close."""
        proc = subprocess.Popen(self.argv(host, argv), **popen_kwargs)
        self._procs.append(proc)
        return proc

    def python(self, host: HostRef, code: str, *args: str, **popen_kwargs: Any
               ) -> subprocess.Popen[Any]:
        """``python -c code args...`` on ``host`` (this interpreter, this environment)."""
        return self.run(host, [sys.executable, "-c", code, *args], **popen_kwargs)

    def pids(self) -> list[int]:
        """Every process living in the lab's namespaces."""
        return _pids_in([h.name for h in self.hosts] + [self.switch])

    def namespaces(self) -> list[str]:
        """The lab's namespaces that exist now."""
        return [n for n in [self.switch] + [h.name for h in self.hosts]
                if _netns_inode(n) is not None]

    # --------------------------------------------------------------- faults

    def isolate(self, host: HostRef) -> None:
        """Take ``host``'s switch port down: it reaches nobody, nobody reaches it."""
        _ip("-n", self.switch, "link", "set", f"p{self.host(host).index}", "down")

    def rejoin(self, host: HostRef) -> None:
        """Bring ``host``'s switch port back up."""
        h = self.host(host)
        _ip("-n", self.switch, "link", "set", f"p{h.index}", "up")
        # Some kernels drop the multicast route with the carrier; mDNS needs it.
        _ip("-n", h.name, "route", "replace", "224.0.0.0/4", "dev", "eth0")
        self._flush_neighbours()

    def partition(self, *groups: Sequence[int]) -> None:
        """Split the switch: hosts talk only within their group.

        Each group gets a bridge of its own; hosts in no group stay on
        ``br0`` together. A second call replaces the first partition."""
        seen = [i for g in groups for i in g]
        if len(seen) != len(set(seen)) or not set(seen) <= {h.index for h in self.hosts}:
            raise ValueError(f"groups {groups} overlap or name unknown hosts")
        self.heal()
        lines = []
        for k, group in enumerate(groups, start=1):
            bridge = f"br{k}"
            lines += [f"link add {bridge} type bridge mcast_snooping 0", f"link set {bridge} up"]
            lines += [f"link set p{i} master {bridge}" for i in group]
            self._bridges.append(bridge)
        _ip("-n", self.switch, stdin="\n".join(lines) + "\n")

    def heal(self) -> None:
        """Undo :meth:`partition`: every port back on ``br0``."""
        if not self._bridges:
            return
        lines = [f"link set p{h.index} master br0" for h in self.hosts]
        lines += [f"link del {b}" for b in self._bridges]
        self._bridges.clear()
        _ip("-n", self.switch, stdin="\n".join(lines) + "\n")
        self._flush_neighbours()

    def shape(self, host: HostRef, rate: str) -> None:
        """Limit ``host``'s link to ``rate`` (tc syntax, e.g. ``100mbit``) both ways."""
        h = self.host(host)
        tbf = ["root", "tbf", "rate", rate, "burst", "64kb", "latency", "20ms"]
        # Upload: egress of the host's eth0; download: egress of its switch port.
        for argv in (["tc", "-n", h.name, "qdisc", "replace", "dev", "eth0", *tbf],
                     ["tc", "-n", self.switch, "qdisc", "replace", "dev", f"p{h.index}", *tbf]):
            subprocess.run(argv, check=True, capture_output=True, timeout=30)

    def unshape(self, host: HostRef) -> None:
        h = self.host(host)
        for argv in (["tc", "-n", h.name, "qdisc", "del", "dev", "eth0", "root"],
                     ["tc", "-n", self.switch, "qdisc", "del", "dev", f"p{h.index}", "root"]):
            subprocess.run(argv, capture_output=True, timeout=30)  # absent qdisc: fine

    def _flush_neighbours(self) -> None:
        for h in self.hosts:
            _ip("-n", h.name, "neigh", "flush", "dev", "eth0")


@pytest.fixture
def netlab() -> Iterator[Callable[[int], NetLab]]:
    """``netlab(n)``: a running :class:`NetLab` of n hosts, torn down after the test.

    Skips the test when this machine cannot build one (not root, no ip)."""
    require_netlab()
    labs: list[NetLab] = []

    def make(n: int) -> NetLab:
        lab = NetLab(n)
        labs.append(lab)
        return lab.up()

    yield make
    for lab in reversed(labs):
        lab.close()
