"""The SPMD API over real processes and real sockets: every rank a process
running tests/collectives/spmd_worker.py with :class:`pmetal.RingBackend`.

- The matrix: world sizes 1 to 5, every operation, root, reduce operator,
  dtype (every one up to world 3, one per item size above; MLX arrays
  when MLX is installed) and strategy (forced, and
  the automatic choice), sizes 0, 1, smaller than the world, not divisible
  by it, and large enough to pipeline. Every rank checks its own results
  against numpy; the test checks that every rank's results are
  bit-identical.
- Failure: ``kill -9`` (or SIGSTOP) of one rank in the middle of
  all_reduce makes every survivor raise CollectiveError within the
  timeout; the survivors then re-form a group over themselves and it
  works. The figures (kill -> each survivor's error) are printed.
- Refusals: another PSK, another schedule, a stale epoch, malformed bytes
  on a rank's port.
- The same on the hosts of a network-namespace lab (tests/netlab.py),
  when this machine can build one (root).

Ranks listen on a loopback address of their own (127.x.y.z, random per
test) on ports the kernel picked, so parallel runs never collide.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import queue
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from netlab import NetLab, lab_available

from pmetal.links import tcphandshake, tcplinks
from pmetal.errors import AuthenticationError, CollectiveError, ProtocolError

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("spmd_worker.py"))
STRATEGIES = ("auto", "ring", "tree", "naive")
OPS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "barrier",
       "send_recv")
DTYPES = ("float16", "float32", "float64", "int32", "int64")


def loopback_host() -> str:
    """A loopback address of this test's own: nothing else binds there."""
    return f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"


def free_nodes(host: str, count: int) -> list[str]:
    """``count`` distinct ``host:port`` whose ports the kernel found free."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [f"{host}:{s.getsockname()[1]}" for s in socks]
    finally:
        for s in socks:
            s.close()


def worker_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    env.update(PYTHONPATH=str(ROOT), PMETAL_HOME=str(home), **extra)
    return env


class Rank:
    """One worker process: its JSON lines arrive on a queue (a reader
    thread), its stderr goes to a file, its stdin takes JSON lines."""

    def __init__(self, argv: list[str], env: dict[str, str], stderr: Path,
                 start: Callable[..., subprocess.Popen[Any]] = subprocess.Popen) -> None:
        self.stderr_path = stderr
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        with stderr.open("wb") as err:
            self.proc = start(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=err, env=env, cwd=ROOT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                try:
                    self.lines.put(json.loads(line))
                except ValueError:
                    self.lines.put({"unparsed": line})
        except (OSError, ValueError):
            pass  # the pipe was closed under us (a lab's teardown): the end
        self.lines.put(None)

    def wait(self, cond: Callable[[dict[str, Any]], bool], timeout: float,
             what: str) -> dict[str, Any]:
        """The first line satisfying ``cond`` within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(0.0, left))
            except queue.Empty:
                raise AssertionError(f"{what}: nothing within {timeout:g} s; last lines "
                                     f"{self.seen[-3:]}; stderr: {self.stderr()}") from None
            if line is None:
                self.lines.put(None)
                raise AssertionError(f"{what}: the process exited ({self.proc.poll()}); "
                                     f"last lines {self.seen[-3:]}; stderr: {self.stderr()}")
            self.seen.append(line)
            if cond(line):
                return line

    def tell(self, **message: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Callable[..., Rank]]:
    """``spawn(mode, spec)``: a worker process, stopped after the test."""
    started: list[Rank] = []

    def spawn(mode: str, spec: dict[str, Any], *, env: dict[str, str] | None = None,
              start: Callable[..., subprocess.Popen[Any]] = subprocess.Popen,
              name: str = "") -> Rank:
        label = name or f"{mode}-r{spec['rank']}-{len(started)}"
        rank = Rank([sys.executable, WORKER, mode, json.dumps(spec)],
                    env or worker_env(tmp_path / "home"), tmp_path / f"{label}.stderr",
                    start)
        started.append(rank)
        return rank

    yield spawn
    for rank in started:
        if rank.proc.poll() is None:
            os.kill(rank.proc.pid, signal.SIGCONT)  # a stopped rank cannot die of SIGTERM
        rank.stop()


# ------------------------------------------------------------------ matrix

def check_matrix(results: list[dict[str, Any]], world: int, dtypes: tuple[str, ...],
                 strategies: tuple[str, ...] = STRATEGIES) -> None:
    """Every rank passed its own checks, ran the whole matrix, and every
    result every rank shares is bit-identical."""
    failures = [f"rank {r['rank']}: {f}" for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} failed cases:\n" + "\n".join(failures[:40])
    cases = {r["rank"]: set(r["hashes"]) for r in results}
    assert all(c == cases[0] for c in cases.values()), "the ranks ran different cases"
    differ = [case for case in sorted(cases[0])
              if len({r["hashes"][case] for r in results}) != 1]
    assert not differ, f"results not bit-identical across ranks: {differ[:20]}"
    # Coverage: every strategy x op x dtype, every root, and every size.
    names = cases[0]
    for strategy in strategies:
        assert f"w{world}/{strategy}/asyncio" in names  # the awaitable API
        assert f"w{world}/{strategy}/layouts" in names  # 2-D, strided, read-only
        for dtype in dtypes:
            for op in ("all_reduce", "broadcast", "all_gather"):
                assert any(n.startswith(f"w{world}/{strategy}/{op}/{dtype}/") for n in names)
            for root in range(world):
                assert f"w{world}/{strategy}/broadcast/{dtype}/root{root}/n0" in names
            for n in (0, 1, max(world - 1, 0), 3 * world + 2):
                assert f"w{world}/{strategy}/all_reduce/{dtype}/PRODUCT/n{n}" in names
    counted = sum(r["cases"] for r in results)
    assert counted >= world * len(names), (counted, len(names))


def run_matrix(spawn: Callable[..., Rank], tmp: Path, groups: dict[str, list[str]],
               world: int, *, dtypes: tuple[str, ...] = DTYPES,
               start: Callable[[int], Callable[..., subprocess.Popen[Any]]] | None = None,
               env: Callable[[int], dict[str, str]] | None = None,
               timeout: float = 240.0, shared_memory: bool = False
               ) -> list[dict[str, Any]]:
    workers = []
    for r in range(world):
        spec = {"rank": r, "groups": groups, "out": str(tmp / f"matrix-w{world}-r{r}.json"),
                "dtypes": list(dtypes), "shared_memory": shared_memory}
        workers.append(spawn("matrix", spec, env=env(r) if env else None,
                             start=start(r) if start else subprocess.Popen))
    for w in workers:
        w.wait(lambda line: "done" in line, timeout, f"rank matrix of world {world}")
    results = [json.loads((tmp / f"matrix-w{world}-r{r}.json").read_text())
               for r in range(world)]
    return results


# Every dtype at worlds 1-3; from world 4 on, one dtype of each item size
# (2, 4 and 8 bytes: where chunk boundaries fall), since a dtype's reduction
# does not change with the world and the worlds' chunking does not change
# with the kind of number. Shared memory skips world 4: its rings carry
# bytes, and worlds 3 and 5 already cover an odd ring and a wide one.
WIDE_DTYPES = ("float16", "float32", "float64")
MATRIX = [(world, links) for world in (1, 2, 3, 4, 5) for links in ("tcp", "shm")
          if world < 4 or links == "tcp"]   # shared memory: worlds 1-3 (4 and 5 cost 15 s)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "links"), MATRIX)
def test_matrix_on_loopback(world: int, links: str, ranks: Callable[..., Rank],
                            tmp_path: Path) -> None:
    """Over TCP (the path a LAN uses) and over the same-machine shared
    memory links."""
    started = time.monotonic()
    nodes = free_nodes(loopback_host(), len(STRATEGIES) * world)
    groups = {s: nodes[i * world:(i + 1) * world] for i, s in enumerate(STRATEGIES)}
    dtypes = DTYPES if world <= 3 else WIDE_DTYPES
    results = run_matrix(ranks, tmp_path, groups, world, dtypes=dtypes,
                         shared_memory=links == "shm")
    check_matrix(results, world, dtypes)
    if any(r["mlx"] for r in results):
        # MLX float32 and bfloat16 come back as MLX arrays (checked by
        # each rank), bit-identical on every rank.
        assert f"w{world}/auto/mlx/all_reduce/bfloat16/n1" in results[0]["hashes"]
    print(f"world {world} over {links}: {results[0]['cases']} cases per rank, "
          f"{len(results[0]['hashes'])} compared across ranks, per strategy "
          f"{results[0]['timings']} s, {time.monotonic() - started:.1f} s in all")


# ------------------------------------------------------------- failures

STALL_TIMEOUT = 2.5
"""The operation timeout of the runs where a rank stalls (SIGSTOP, a cut
cable): the survivors can only learn of it at this deadline, so the test
lasts at least this long. A whole kill case (three processes started,
two 16 MiB all_reduces each, the kill, the re-formed group) took under
2 s at a load of 8 on two cores, so no live rank comes near 2.5 s for
one operation."""

def fail_mid_all_reduce(spawn: Callable[..., Rank], nodes: list[str], new_nodes: list[str],
                        victim: int, sig: signal.Signals | None, *, timeout: float = 5.0,
                        fault: Callable[[Rank], None] | None = None, what: str = "",
                        env: Callable[[int], dict[str, str]] | None = None,
                        start: Callable[[int], Callable[..., subprocess.Popen[Any]]] | None
                        = None, bound: float | None = None, shared_memory: bool = False
                        ) -> dict[int, float]:
    """Kill (or stop: ``sig``; or anything ``fault`` does to the victim's
    :class:`Rank`, called ``what``, a stall) ``victim`` while every rank
    loops all_reduce of 16 MiB; every survivor must raise within
    ``timeout`` (+ slack), then the survivors re-form on ``new_nodes``
    and an all_reduce works. Returns each survivor's seconds from the
    fault to its error."""
    world = len(nodes)
    workers = [spawn("loop", {"rank": r, "nodes": nodes, "mib": 16, "timeout": timeout,
                              "shared_memory": shared_memory},
                     env=env(r) if env else None,
                     start=start(r) if start else subprocess.Popen)
             for r in range(world)]
    # Mid-operation: every rank has finished two and is in the next ones.
    for w in workers:
        w.wait(lambda line: line.get("op", 0) >= 2, 60.0, "two all_reduces")
    signalled = time.time()
    if sig is not None:
        os.kill(workers[victim].proc.pid, sig)
        what = sig.name
    else:
        assert fault is not None
        fault(workers[victim])
    survivors = [r for r in range(world) if r != victim]
    bound = bound or timeout + 3.0
    elapsed, causes = {}, {}
    for r in survivors:
        line = workers[r].wait(lambda line: "error" in line or "wrong" in line, bound + 10.0,
                               f"rank {r} raising after rank {victim} got {what}")
        assert line.get("error") == "CollectiveError", line
        elapsed[r] = line["t"] - signalled
        causes[r] = line["causes"]
    print(f"world {world}, {what} of rank {victim} mid all_reduce: survivors raised after "
          + ", ".join(f"rank {r} {elapsed[r]:.2f} s ({'/'.join(causes[r])})" for r in survivors)
          + f" (timeout {timeout:g} s)")
    assert max(elapsed.values()) <= bound, elapsed
    if sig is signal.SIGKILL:
        # The ranks that exchange with the victim learn of its death at once
        # (the connection closes), not at the deadline.
        assert any("PeerError" in c for c in causes.values()), causes
    else:
        # TimeoutError, or the shared-memory links' PMetalTimeoutError (a
        # subclass of it)
        assert any(n.endswith("TimeoutError") for c in causes.values() for n in c), causes
    for new_rank, r in enumerate(survivors):
        workers[r].tell(rank=new_rank, nodes=new_nodes)
    reformed = {}
    for r in survivors:
        line = workers[r].wait(lambda line: "reformed" in line, 60.0, f"rank {r} re-forming")
        assert line == {**line, "reformed": True, "ok": True, "world": world - 1}, line
        reformed[r] = line["seconds"]
    print(f"  re-formed over {world - 1} survivors, first all_reduce right; seconds per "
          f"rank {reformed}")
    # Closing the failed group does not wait for a stalled member to read.
    assert max(reformed.values()) < timeout, reformed
    return elapsed


@pytest.mark.slow
@pytest.mark.parametrize(("world", "victim", "sig", "shared_memory"), [
    (3, 1, signal.SIGKILL, False), (4, 2, signal.SIGKILL, False),
    (4, 0, signal.SIGKILL, False), (3, 2, signal.SIGSTOP, False),
    (3, 1, signal.SIGKILL, True), (3, 2, signal.SIGSTOP, True)],
    ids=["w3-kill-r1", "w4-kill-r2", "w4-kill-r0", "w3-stop-r2", "shm-w3-kill-r1",
         "shm-w3-stop-r2"])
def test_member_dies_mid_all_reduce(world: int, victim: int, sig: signal.Signals,
                                    shared_memory: bool, ranks: Callable[..., Rank]) -> None:
    nodes = free_nodes(loopback_host(), 2 * world - 1)
    fail_mid_all_reduce(ranks, nodes[:world], nodes[world:], victim, sig,
                        shared_memory=shared_memory,
                        timeout=STALL_TIMEOUT if sig is signal.SIGSTOP else 5.0)


@pytest.mark.slow
@pytest.mark.parametrize(("n", "dtype"), [(12, "float32"), (10, "float64"), (1 << 16, "float32")],
                         ids=["size", "dtype", "much-larger"])
def test_ranks_passing_different_arrays_all_raise(n: int, dtype: str,
                                                  ranks: Callable[..., Rank]) -> None:
    """A user error (rank 2 passes another size or dtype than ranks 0 and
    1): every rank raises CollectiveError within the timeout, under every
    strategy, and at least one says what is wrong."""
    world, timeout = 3, 1.5
    nodes = free_nodes(loopback_host(), 3 * world)
    groups = {s: nodes[i * world:(i + 1) * world] for i, s in enumerate(("ring", "tree",
                                                                         "naive"))}
    workers = [ranks("mismatch", {"rank": r, "groups": groups, "timeout": timeout,
                                  "n": n if r == 2 else 10,
                                  "dtype": dtype if r == 2 else "float32"})
               for r in range(world)]
    for strategy in groups:
        lines = [w.wait(lambda line, s=strategy: line.get("strategy") == s, 30.0,
                        f"rank {r} under {strategy}") for r, w in enumerate(workers)]
        assert all(line.get("error") == "CollectiveError" for line in lines), lines
        assert all(line["elapsed"] <= timeout + 3.0 for line in lines), lines
        assert any("every rank must pass the same shape and dtype" in line["message"]
                   for line in lines), lines


# ------------------------------------------------------------- refusals

def test_a_rank_that_never_starts_is_named(ranks: Callable[..., Rank]) -> None:
    """Ranks 0 and 1 of a world of 3 whose rank 2 never starts: both give
    up at connect_timeout, naming rank 2."""
    nodes = free_nodes(loopback_host(), 3)
    workers = [ranks("connect", {"rank": r, "nodes": nodes, "connect_timeout": 2.0})
               for r in range(2)]
    for w in workers:
        line = w.wait(lambda line: True, 20.0, "a rank of an incomplete world")
        assert line["error"] == "CollectiveError", line
        assert "rank(s) [2]" in line["message"], line


def test_another_psk_is_refused(ranks: Callable[..., Rank]) -> None:
    nodes = free_nodes(loopback_host(), 2)
    spec = {"nodes": nodes, "connect_timeout": 3.0}
    a = ranks("connect", {**spec, "rank": 0, "psk": secrets.token_hex(32)})
    b = ranks("connect", {**spec, "rank": 1, "psk": secrets.token_hex(32)})
    # Rank 1 dials rank 0 and finds it cannot prove rank 1's PSK: at once.
    line = b.wait(lambda line: True, 20.0, "rank 1 of another PSK")
    assert line["error"] == "AuthenticationError", line
    assert "PSK" in line["message"], line
    # Rank 0 refuses rank 1 and keeps waiting for a rank with its PSK, until
    # its connect timeout.
    line = a.wait(lambda line: True, 20.0, "rank 0 of another PSK")
    assert line["error"] == "CollectiveError", line
    assert "rank(s) [1]" in line["message"], line
    # ... and says why: rank 1 told it so before hanging up.
    assert "different PSKs" in line["message"], line
    assert "different PSKs" in a.stderr(), a.stderr()
    print(f"another PSK: rank 1 refused after {b.seen[-1]['elapsed']} s, rank 0 gave up "
          f"after {line['elapsed']} s (connect_timeout 3 s)")


def test_another_schedule_is_refused(ranks: Callable[..., Rank]) -> None:
    nodes = free_nodes(loopback_host(), 2)
    spec = {"nodes": nodes, "connect_timeout": 3.0}
    a = ranks("connect", {**spec, "rank": 0, "strategy": "ring"})
    b = ranks("connect", {**spec, "rank": 1, "strategy": "tree"})
    line = b.wait(lambda line: True, 20.0, "rank 1 of another schedule")
    assert line["error"] == "AuthenticationError", line
    assert "rank 0 refused rank 1" in line["message"] and "another group" in line["message"]
    line = a.wait(lambda line: True, 20.0, "rank 0 of another schedule")
    assert line["error"] == "CollectiveError", line
    assert "was refused: another group" in line["message"], line
    assert "refused a collective connection" in a.stderr(), a.stderr()


def test_same_schedule_forms(ranks: Callable[..., Rank]) -> None:
    """The control of the two refusals above: the same settings connect."""
    nodes = free_nodes(loopback_host(), 2)
    spec = {"nodes": nodes, "connect_timeout": 10.0, "strategy": "ring"}
    psk = secrets.token_hex(32)
    workers = [ranks("connect", {**spec, "rank": r, "psk": psk}) for r in range(2)]
    for w in workers:
        assert w.wait(lambda line: True, 20.0, "the group forming") == {
            "ok": True, "elapsed": w.seen[-1]["elapsed"]}


def _mesh(rank: int, addresses: list[tuple[str, int]], listener: socket.socket, tag: bytes,
          epoch: int, timeout: float, out: dict[int, Any]) -> None:
    try:
        out[rank] = tcplinks.connect_mesh(rank, addresses, listener, key=b"k" * 32, tag=tag,
                                          epoch=epoch, deadline=time.monotonic() + timeout)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        out[rank] = exc
    finally:
        listener.close()


def _form(tags: list[bytes], epochs: list[int], timeout: float) -> dict[int, Any]:
    host = loopback_host()
    listeners = [tcplinks.listen(host, 0) for _ in tags]
    addresses = [s.getsockname()[:2] for s in listeners]
    out: dict[int, Any] = {}
    threads = [threading.Thread(target=_mesh, args=(r, addresses, listeners[r], tags[r],
                                                     epochs[r], timeout, out))
               for r in range(len(tags))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5.0)
    assert len(out) == len(tags), "a mesh thread hung past its deadline"
    return out


def test_a_stale_epoch_is_refused_at_connect() -> None:
    """A mesh formed for epoch 1 of a group refuses a peer still at epoch 0."""
    out = _form([tcplinks.group_tag("g", 3, 1), tcplinks.group_tag("g", 3, 0)], [1, 0], 1.5)
    assert isinstance(out[1], AuthenticationError), out
    assert "stale plan is refused" in str(out[1])
    assert isinstance(out[0], CollectiveError) and "rank(s) [1]" in str(out[0]), out
    # An older term of the master, same epoch: refused the same way.
    out = _form([tcplinks.group_tag("g", 4, 1), tcplinks.group_tag("g", 3, 1)], [1, 1], 1.5)
    assert isinstance(out[1], AuthenticationError), out


def test_data_of_a_stale_epoch_is_refused() -> None:
    """The second line: a header stamped with another epoch is a stale plan."""
    tag = tcplinks.group_tag("g", 0, 5)
    out = _form([tag, tag], [5, 4], 5.0)
    links = [out[0], out[1]]
    assert all(isinstance(x, tcplinks.TcpLinks) for x in links), out
    try:
        links[1].send(0, 1, 0, np.arange(4, dtype=np.float32))
        with pytest.raises(ProtocolError, match="stale plan"):
            links[0].recv(1, 1, time.monotonic() + 5.0)
    finally:
        for x in links:
            x.close(timeout=1.0)


def test_malformed_bytes_do_not_crash_a_rank(ranks: Callable[..., Rank]) -> None:
    nodes = free_nodes(loopback_host(), 2)
    host, port = nodes[0].rsplit(":", 1)
    spec = {"nodes": nodes, "connect_timeout": 20.0}
    a = ranks("connect", {**spec, "rank": 0})
    deadline = time.monotonic() + 15.0

    def raw() -> socket.socket:
        while True:
            try:
                return socket.create_connection((host, int(port)), timeout=2.0)
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)  # rank 0 is still starting: retry the connect
    garbage = [
        os.urandom(200),                                             # noise
        tcphandshake.HELLO.pack(tcphandshake.HELLO_MAGIC, 0, 1, 0, b"\x00" * 32,   # bad tag
                                b"n" * 16),
        b"PMCOLL1\x00\x01",                                          # cut short
        b"",                                                         # connect, close
    ]
    for data in garbage:
        s = raw()
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            s.recv(4096)  # the refusal (or EOF): rank 0 has dealt with this one
        except OSError as exc:
            # Rank 0 refused and closed before our last bytes or our
            # shutdown (its reset: ECONNRESET, EPIPE or ENOTCONN here):
            # dealt with too. Anything else is a failure.
            if exc.errno not in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN):
                raise
        s.close()
    assert a.proc.poll() is None, a.stderr()
    b = ranks("connect", {**spec, "rank": 1})
    for w in (a, b):
        line = w.wait(lambda line: True, 30.0, "the group forming after the garbage")
        assert line.get("ok") is True, line
    assert "refused a collective connection" in a.stderr(), a.stderr()
    assert "failed during its handshake" in a.stderr(), a.stderr()


# ------------------------------------------------------- namespace hosts

@pytest.mark.slow
@pytest.mark.skipif(lab_available() is not None, reason=f"across namespace hosts: "
                    f"{lab_available()}")
def test_across_namespace_hosts(ranks: Callable[..., Rank], tmp_path: Path) -> None:
    """One rank per host of a lab (tests/netlab.py), on the hosts' 10.x
    addresses with a PSK: a reduced matrix (every operation, root and
    strategy, float32, world 4: the loopback matrix has the dtypes), then
    kill -9 mid all_reduce and the re-formed group of the three survivors."""
    world, dtypes = 4, ("float32",)
    psk = secrets.token_bytes(32)
    with NetLab(world) as lab:
        def env(r: int) -> dict[str, str]:
            return worker_env(tmp_path / f"h{r}", PMETAL_PSK_HEX=psk.hex())

        def start(r: int) -> Callable[..., subprocess.Popen[Any]]:
            return functools.partial(lab.run, lab.hosts[r])

        def nodes(port: int, hosts: list[int] | None = None) -> list[str]:
            return [f"{lab.hosts[r].address}:{port}" for r in (hosts or range(world))]

        # Off loopback a PSK is required: without one a rank refuses to start.
        lonely = ranks("connect", {"rank": 0, "nodes": nodes(29400)},
                       env=worker_env(tmp_path / "h0"), start=start(0))
        line = lonely.wait(lambda line: True, 30.0, "a rank without a PSK")
        assert line["error"] == "ConfigError" and "PMETAL_PSK" in line["message"], line

        started = time.monotonic()
        groups = {s: nodes(29500 + i) for i, s in enumerate(STRATEGIES)}
        results = run_matrix(ranks, tmp_path, groups, world, dtypes=dtypes, start=start,
                             env=env)
        check_matrix(results, world, dtypes)
        print(f"namespace hosts {[h.address for h in lab.hosts]}: {results[0]['cases']} "
              f"cases per rank, per strategy {results[0]['timings']} s, "
              f"{time.monotonic() - started:.1f} s in all")
        fail_mid_all_reduce(ranks, nodes(29600), nodes(29601, [0, 2, 3]), 1, signal.SIGKILL,
                            env=env, start=start)
        # A host that drops off the network (its cable pulled) closes
        # nothing: the survivors raise at the deadline, then re-form.
        fail_mid_all_reduce(ranks, nodes(29700), nodes(29701, [0, 1, 3]), 2, None,
                            fault=lambda _rank: lab.isolate(3), what="the network cut",
                            env=env, start=start, timeout=STALL_TIMEOUT)
