"""``pmetal launch``: start one script as N ranks (SPMD), like torchrun or mpirun.

Each rank gets the environment of :mod:`pmetal.collectives.launchenv`
(``PMETAL_RANK``, ``PMETAL_WORLD_SIZE``, ``PMETAL_LOCAL_RANK``,
``PMETAL_NODES``), this Python (``sys.executable``), this working directory
and ``PYTHONPATH``, and ``PYTHONUNBUFFERED=1`` unless set, so that output
streams live.

Where ranks run:

- without ``--hosts``, on this machine, listening on ``127.0.0.1`` at ports
  the operating system reports free (bound to port 0 and closed again: a port
  can be taken by another program before the rank binds it; ``--base-port P``
  gives rank r port P+r instead);
- with ``--hosts a:2,b:2``, on those hosts: each host takes its *slots*
  (default 1) consecutive ranks in list order, and the list is used again
  while ranks are left, so ``--hosts a,b -n 4`` alternates (a b a b) and
  ``-n`` defaults to the total of the slots. A host is reached through
  ``--rsh`` (default ``ssh {host}``; ``{host}`` is replaced, or the host
  appended when the template has none), and its ranks listen at
  ``--base-port`` + local rank on the host's name, or on the address
  ``--addresses host=address,...`` gives it (network namespaces, machines
  known by another name on the cluster's network). The paths of Python and
  of the working directory must be the same there.

Every rank runs under a small keeper (:mod:`pmetal.cli._rank`) that stops it
when told to, or when the launcher disappears. Output is passed through, or
prefixed with ``[rank]`` line by line (``--tag-output``). The launcher's exit
status is the first non-zero status of a rank (128+n for a rank killed by
signal n), after which the other ranks get SIGTERM, then SIGKILL after
``--grace`` seconds (:data:`GRACE` by default); 124 when ``--timeout``
passed; 128+n when the launcher itself got signal n (SIGINT, SIGTERM, SIGHUP), which is passed on to the ranks
(a second one kills them at once); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pmetal.errors import ConfigError

GRACE = 3.0
"""Seconds between SIGTERM and SIGKILL when ranks are stopped (``--grace``)."""
DEFAULT_BASE_PORT = 52480
"""First port of the ranks of each host with ``--hosts`` (the node daemon has 52416)."""
BLAS_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
"""Thread counts of the BLAS and OpenMP libraries: 1 in every rank unless
the launcher's environment sets them."""
RSH = "ssh {host}"
"""How a host is reached by default (``--rsh``)."""
_SHELL_AGENTS = frozenset({"ssh", "rsh"})  # they hand their words to a remote shell


def _keeper_source() -> str:
    """The keeper's code without its docstring: it is on every rank's command line."""
    source = Path(__file__).with_name("_rank.py").read_text()
    first = ast.parse(source).body[1].lineno  # the statement after the docstring
    return "".join(source.splitlines(keepends=True)[first - 1:])


def _launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = ("%(prog)s [-n N] [--hosts H[:SLOTS],...] [--rsh TEMPLATE] "
                    "[--addresses HOST=ADDR,...]\n"
                    "       [--base-port P] [--tag-output] [--timeout S] [--grace S] "
                    "(script.py | -m module) [args...]")
    parser.add_argument("-n", "--np", dest="n", type=int, default=None, metavar="N",
                        help="number of ranks (default with --hosts: the total of the slots)")
    parser.add_argument("--hosts", default=None, metavar="H[:SLOTS],...",
                        help="run the ranks on these hosts, each taking SLOTS (default 1) "
                             "consecutive ranks in turn; default: N local processes")
    parser.add_argument("--rsh", default=None, metavar="TEMPLATE",
                        help="command that runs a program on {host} (default 'ssh {host}'; "
                             "e.g. 'ip netns exec {host}')")
    parser.add_argument("--addresses", default=None, metavar="HOST=ADDR,...",
                        help="the address each host's ranks listen on, in PMETAL_NODES "
                             "(default: the host's name)")
    parser.add_argument("--base-port", type=int, default=None, metavar="P",
                        help=f"ranks listen on P + local rank (default: free ports here, "
                             f"{DEFAULT_BASE_PORT} with --hosts)")
    parser.add_argument("--tag-output", action="store_true",
                        help="prefix every line of output with [rank]")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="stop every rank after S seconds and exit 124")
    parser.add_argument("--grace", type=float, default=GRACE, metavar="S",
                        help=f"seconds a stopped rank has between SIGTERM and SIGKILL "
                             f"(default {GRACE:g})")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="the program is a module, run as python -m MODULE")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="script.py [args...]",
                        help="the script (or with -m the module) and its arguments")


# ------------------------------------------------------------------ the plan

def parse_hosts(text: str) -> list[tuple[str, int]]:
    """``"a:2,b"`` as ``[("a", 2), ("b", 1)]``; ConfigError for a malformed list."""
    hosts: list[tuple[str, int]] = []
    for entry in text.split(","):
        entry = entry.strip()
        if entry.startswith("["):  # [v6] or [v6]:slots
            host, _, rest = entry[1:].partition("]")
            slots = rest[1:] if rest.startswith(":") else (rest or "1")
        else:
            host, sep, slots = entry.partition(":")
            slots = slots if sep else "1"
        if not host or any(c.isspace() for c in host):
            raise ConfigError(f"--hosts {text!r}: {entry!r} is not a host name "
                              f"(write HOST or HOST:SLOTS, separated by commas)")
        if not slots.isdecimal() or int(slots) < 1:
            raise ConfigError(f"--hosts {text!r}: the slots of {host!r} must be a whole "
                              f"number of at least 1, not {slots!r}")
        if host in (h for h, _ in hosts):
            raise ConfigError(f"--hosts {text!r}: {host!r} is listed twice; "
                              f"give it more slots instead ({host}:2)")
        hosts.append((host, int(slots)))
    return hosts


def place(hosts: Sequence[tuple[str, int]], n: int) -> list[str]:
    """The host of each of ``n`` ranks: each host takes its slots in turn, cyclically."""
    order = [host for host, slots in hosts for _ in range(slots)]
    return [order[r % len(order)] for r in range(n)]


def parse_addresses(text: str | None, hosts: Sequence[str]) -> dict[str, str]:
    """``"a=10.0.0.1,b=10.0.0.2"`` for the hosts listed; ConfigError otherwise."""
    from pmetal.collectives.launchenv import format_node, parse_node

    found: dict[str, str] = {}
    for entry in (text or "").split(","):
        if not entry.strip():
            continue
        host, sep, address = (part.strip() for part in entry.partition("="))
        if not sep or not host or not address:
            raise ConfigError(f"--addresses: {entry.strip()!r} is not HOST=ADDRESS")
        if host not in hosts:
            raise ConfigError(f"--addresses: {host!r} is not one of --hosts "
                              f"({', '.join(hosts)})")
        address = address.strip("[]")
        try:
            parse_node(format_node(address, 1))
        except ConfigError as exc:
            raise ConfigError(f"--addresses: {host}={address!r} is not an address") from exc
        found[host] = address
    return found


def _free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 now (all held at once, then let go)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass(frozen=True)
class _Rank:
    rank: int
    host: str | None  # None: this machine, without --rsh
    argv: tuple[str, ...]  # what the launcher starts: the keeper, maybe through --rsh


def _plan(args: argparse.Namespace) -> list[_Rank]:
    # Imported here: pmetal.collectives brings numpy, which other commands do not need.
    from pmetal.collectives.launchenv import LaunchEnv, format_node

    if not args.program:
        raise ConfigError("no program: give a script (pmetal launch -n 2 train.py) "
                          "or a module (pmetal launch -n 2 -m package.train)")
    if args.n is not None and args.n < 1:
        raise ConfigError(f"-n must be at least 1, not {args.n}")
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout must be positive, not {args.timeout}")
    if not args.grace > 0:
        raise ConfigError(f"--grace must be positive, not {args.grace}")
    if args.hosts is None:
        if args.n is None:
            raise ConfigError("how many ranks? give -n N (or --hosts)")
        for name in ("addresses", "rsh"):
            if getattr(args, name) is not None:
                raise ConfigError(f"--{name} applies only with --hosts")
        if not args.module and not Path(args.program[0]).is_file():
            raise ConfigError(f"no such script: {args.program[0]!r} (in {os.getcwd()}); "
                              f"give the path of a Python script, or -m MODULE")
        hosts = [None] * args.n
        addresses = ["127.0.0.1"] * args.n
    else:
        listed = parse_hosts(args.hosts)
        n = args.n if args.n is not None else sum(slots for _, slots in listed)
        mapping = parse_addresses(args.addresses, [h for h, _ in listed])
        hosts = place(listed, n)
        addresses = [mapping.get(h, h) for h in hosts]
    n = len(hosts)
    local = [hosts[:r].count(hosts[r]) for r in range(n)]
    if args.base_port is not None:
        top = args.base_port + max(local)
        if not 1 <= args.base_port or top > 65535:
            raise ConfigError(f"--base-port {args.base_port}: the ranks need ports "
                              f"{args.base_port}..{top}, which must lie in 1..65535")
        ports = [args.base_port + lr for lr in local]
    elif args.hosts is None:
        ports = _free_ports(n)
    else:
        ports = [DEFAULT_BASE_PORT + lr for lr in local]
    nodes = tuple(format_node(a, p) for a, p in zip(addresses, ports))
    program = [sys.executable, *(["-m"] if args.module else []), *args.program]
    extra = {"PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")}
    # One BLAS/OpenMP thread per rank unless the user chose (torchrun does
    # the same): N ranks of a machine each spinning a thread per core fight
    # over the cores (the training example took 15.6 s instead of 3.1 s).
    extra.update({name: os.environ.get(name, "1") for name in BLAS_THREADS})
    if "PYTHONPATH" in os.environ:  # ssh does not carry the environment
        extra["PYTHONPATH"] = os.environ["PYTHONPATH"]
    ranks = []
    keeper_source = _keeper_source()
    for r in range(n):
        env = LaunchEnv(r, n, local[r], nodes).environ()  # checks the nodes too
        spec = json.dumps({"cwd": os.getcwd(), "env": {**extra, **env}, "argv": program,
                           "grace": args.grace})
        keeper = [sys.executable, "-c", keeper_source, spec]
        ranks.append(_Rank(r, hosts[r], tuple(keeper if hosts[r] is None
                                              else _remote(RSH if args.rsh is None else args.rsh, hosts[r], keeper))))
    return ranks


def _remote(template: str, host: str, argv: list[str]) -> list[str]:
    """``argv`` run on ``host`` through the --rsh template."""
    try:
        words = shlex.split(template.replace("{host}", shlex.quote(host)))
    except ValueError as exc:
        raise ConfigError(f"--rsh {template!r}: {exc}") from exc
    if not words:
        raise ConfigError("--rsh is empty; give a command such as 'ssh {host}'")
    if "{host}" not in template:
        words.append(host)
    if os.path.basename(words[0]) in _SHELL_AGENTS:
        argv = [shlex.quote(word) for word in argv]
    return words + argv


# --------------------------------------------------------------- the run

def _run_launch(args: argparse.Namespace) -> int:
    ranks = _plan(args)
    return _Job(ranks, tag=args.tag_output, timeout=args.timeout, rsh=args.rsh or RSH,
                grace=args.grace).run()


def _describe(code: int) -> tuple[str, int]:
    """How a rank ended, and the launcher's exit status for it."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}", 128 - code
    return f"exited with code {code}", code


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _nothing(signum: int, frame: Any) -> None:
    del signum, frame  # see _Job._catch_signals


def _start_thread(target: Callable[..., None], *args: Any, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True, name=name)
    thread.start()
    return thread


def _say(text: str) -> None:
    print(f"pmetal launch: {text}", file=sys.stderr, flush=True)


class _Job:
    """The running ranks: started, watched, and stopped together."""

    def __init__(self, ranks: list[_Rank], *, tag: bool, timeout: float | None,
                 rsh: str, grace: float = GRACE) -> None:
        self.ranks = ranks
        self.tag = tag
        self.timeout = timeout
        self.grace = grace
        self.rsh = rsh
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        # Every waiting thread reports here: ("exit", rank, status), ("signal", n, 0).
        self.events: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self.pumps: list[threading.Thread] = []
        self.out_lock = threading.Lock()

    def run(self) -> int:
        restore = self._catch_signals()
        try:
            for rank in self.ranks:
                self._start(rank)
            return self._supervise()
        finally:
            self._kill_all()  # a safety net: nothing of ours outlives the launcher
            for r, proc in self.procs.items():
                try:
                    proc.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    _say(f"rank {r}'s process {proc.pid} did not exit after SIGKILL")
                if proc.stdin is not None:
                    proc.stdin.close()
            for pump in self.pumps:  # a rank's orphan could hold the pipe: bounded
                pump.join(timeout=2.0)
            restore()

    def _catch_signals(self) -> Callable[[], None]:
        """Turn SIGINT, SIGTERM and SIGHUP into events; return what undoes it.

        Not with a Python handler that puts the event: the kernel gives a
        process's signal to any thread that does not block it (numpy's BLAS
        threads too, since pmetal.collectives imports numpy), and Python runs
        the handler in the main thread only once that thread wakes, which a
        main thread asleep in events.get() would not. The C-level handler
        writes the signal's number to the wakeup fd from whichever thread took
        it, and a thread of ours reads it. The Python handler does nothing;
        it is there so that the signal neither kills nor interrupts us."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None  # signals exist only there (an embedding program's thread)
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # the C handler must never block
        saved = {signum: signal.signal(signum, _nothing) for signum in _SIGNALS}
        saved_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        _start_thread(self._relay_signals, read_end, name="launch-signals")

        def restore() -> None:
            signal.set_wakeup_fd(saved_fd)
            for signum, handler in saved.items():
                signal.signal(signum, handler)
            os.close(write_end)  # the relay thread reads end of file and closes read_end

        return restore

    def _relay_signals(self, read_end: int) -> None:
        with open(read_end, "rb", buffering=0) as wakeups:
            while numbers := wakeups.read(64):
                for signum in numbers:
                    if signum in _SIGNALS:
                        self.events.put(("signal", signum, 0))

    def _start(self, rank: _Rank) -> None:
        pipe = subprocess.PIPE if self.tag else None
        try:
            proc = subprocess.Popen(rank.argv, stdin=subprocess.PIPE, stdout=pipe, stderr=pipe,
                                    start_new_session=True)
        except OSError as exc:
            raise ConfigError(f"cannot start rank {rank.rank} ({rank.argv[0]!r}): "
                              f"{exc.strerror}; check --rsh") from exc
        self.procs[rank.rank] = proc
        _start_thread(self._wait, rank.rank, proc, name=f"launch-wait-{rank.rank}")
        if self.tag:
            assert proc.stdout is not None and proc.stderr is not None
            prefix = f"[{rank.rank}] ".encode()
            for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                self.pumps.append(_start_thread(self._pump, stream, out, prefix,
                                                name=f"launch-pump-{rank.rank}"))

    def _wait(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self.events.put(("exit", rank, proc.wait()))

    def _pump(self, stream: IO[bytes], out: IO[str], prefix: bytes) -> None:
        reader_gone = False  # 'pmetal launch ... | head': keep draining, so no rank blocks
        with stream:
            for line in iter(stream.readline, b""):
                if reader_gone:
                    continue
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self.out_lock:  # whole lines: ranks never interleave mid-line
                    try:
                        if hasattr(out, "buffer"):
                            out.buffer.write(prefix + line)
                        else:  # a replaced sys.stdout (an embedding program, pytest)
                            out.write((prefix + line).decode(errors="replace"))
                        out.flush()
                    except BrokenPipeError:
                        reader_gone = True

    def _supervise(self) -> int:
        alive = set(self.procs)
        status: int | None = None
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        kill_at: float | None = None  # set while the ranks have their grace period
        give_up_at: float | None = None  # set once they were sent SIGKILL
        while alive:
            wake = give_up_at or kill_at or deadline
            try:
                kind, who, value = self.events.get(
                    timeout=None if wake is None else max(0.0, wake - time.monotonic()))
            except queue.Empty:
                if give_up_at is not None:
                    _say(f"rank(s) {_names(alive)} did not exit after SIGKILL; giving up")
                    return 1 if status is None else status
                if kill_at is not None:
                    _say(f"rank(s) {_names(alive)} still running {self.grace:g} s after "
                         f"SIGTERM: killing them")
                    give_up_at = self._kill_all()
                else:
                    _say(f"timed out after {self.timeout:g} s: stopping every rank")
                    status = 124
                    kill_at = self._stop(alive, signal.SIGTERM)
                continue
            if kind == "exit":
                alive.discard(who)
                if value != 0 and status is None:
                    how, status = _describe(value)
                    _say(f"rank {who}{self._where(who)} {how}{self._hint(who, value)}"
                         + ("; stopping the other ranks" if alive else ""))
                    kill_at = self._stop(alive, signal.SIGTERM)
            elif kill_at is None:
                _say(f"got {signal.Signals(who).name}: passing it on to every rank")
                status = 128 + who
                kill_at = self._stop(alive, signal.Signals(who))
            elif give_up_at is None:  # a second Ctrl-C: no more patience
                _say(f"got {signal.Signals(who).name} while stopping: killing every rank")
                give_up_at = self._kill_all()
        return 0 if status is None else status

    def _where(self, rank: int) -> str:
        host = self.ranks[rank].host
        return "" if host is None else f" (on {host})"

    def _hint(self, rank: int, code: int) -> str:
        host = self.ranks[rank].host
        if host is not None and code == 255 and "ssh" in self.rsh:
            return f" (255 is also ssh's status when it cannot reach {host})"
        return ""

    def _stop(self, ranks: set[int], signum: signal.Signals) -> float:
        """Ask ``ranks``' keepers to pass ``signum`` on; return when to kill them."""
        for r in ranks:
            self._tell(r, signum.name[3:])
        return time.monotonic() + self.grace

    def _tell(self, rank: int, word: str) -> None:
        stdin = self.procs[rank].stdin
        try:
            assert stdin is not None
            stdin.write(f"{word}\n".encode())
            stdin.flush()
        except (BrokenPipeError, ValueError):  # the keeper is gone, or we closed it
            pass

    def _kill_all(self) -> float:
        """SIGKILL every rank still running, with whatever it started; return
        how long to wait for them (they cannot ignore SIGKILL)."""
        for r, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            if self.ranks[r].host is not None:
                self._tell(r, "KILL")  # the remote group; killing ssh alone leaves it
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: pid is the group
            except ProcessLookupError:
                pass
        return time.monotonic() + 10.0


def _names(ranks: set[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
