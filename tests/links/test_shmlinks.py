"""The same-machine links (:class:`ShmLinks`) between real processes: this
process is rank 0, the other ranks are child processes running
:data:`CHILD`. Ordered delivery of mixed sizes (empty, one element, larger
than the ring), op_id filtering, zero-copy ``out``, both ranks sending
64 MiB before receiving, a peer killed with SIGKILL (PeerError at once) or
stopped with SIGSTOP (TimeoutError at the deadline), and what is left in
``/dev/shm`` afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pmetal import shm
from pmetal.links import shmrendezvous
from pmetal.links.shmlinks import ShmLinks
from pmetal.errors import HandshakeError, PeerError, PMetalValueError
from tests.actors.conftest import read_line, wait_until

pytestmark = pytest.mark.skipif(not shm.available() or not os.path.isdir("/dev/shm"),
                                reason="needs POSIX shared memory and a listable /dev/shm")

WAIT = 30.0          # no-hang bound of every wait
RING = 64 << 10      # small rings, so that "larger than the ring" stays cheap
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import sys, time
import numpy as np
from pmetal.links.shmlinks import ShmLinks

scenario, token, rank, world, ring, local = sys.argv[1:7]
rank, world, ring = int(rank), int(world), int(ring)
ranks = [int(r) for r in local.split(",")] if local else None
links = ShmLinks.connect(token, rank, world, deadline=time.monotonic() + 30, ring_bytes=ring,
                         ranks=ranks)
deadline = time.monotonic() + 30
if scenario == "echo":                 # send back every message of op 1 until a 0-chunk -1
    while True:
        chunk, data = links.recv(0, 1, deadline)
        if chunk == 999:
            break
        links.send(0, 1, chunk, data.copy())
elif scenario == "filter":
    for op, chunk, n in ((4, 0, 10), (5, 1, 10), (6, 2, 3 * ring), (5, 3, 10), (7, 4, 5)):
        links.send(0, op, chunk, np.full(n, chunk, np.int32))
    links.recv(0, 99, deadline)        # wait for rank 0 to be done
elif scenario == "swap":               # 64 MiB each way, both sending first
    x = np.full(16 << 20, 1 + rank, np.float32)
    links.send(0, 1, rank, x)
    out = np.empty_like(x)
    chunk, got = links.recv(0, 1, deadline, out)
    assert got is out and chunk == 0 and (out == 1).all(), "rank 1 got the wrong data"
    links.release(1)
    links.recv(0, 2, deadline)         # rank 0 got everything too
elif scenario == "all":                # every rank sends every other one its rank
    for peer in range(world):
        if peer != rank:
            links.send(peer, 1, rank, np.full(3 * ring // 8 + rank, rank, np.int64))
    for peer in range(world):
        if peer != rank:
            chunk, data = links.recv(peer, 1, deadline)
            assert chunk == peer and data.size == 3 * ring // 8 + peer and (data == peer).all()
    links.release(1)
    links.send(0, 2, 0, np.zeros(0, np.int64))
    links.recv(0, 3, deadline)
elif scenario == "relay":              # say what arrived, then echo it
    for op in (1, 2):
        chunk, data = links.recv(0, op, deadline)
        print(int(data.sum()), flush=True)
        links.send(0, op, chunk, data.copy())
    links.recv(0, 3, deadline)
elif scenario == "bye":                # send three rings' worth and close at once
    links.send(0, 1, 0, np.arange(3 * ring, dtype=np.int64))
    links.release(1)
elif scenario == "exit":               # one message; when told, 100 more, then exit
    links.send(0, 1, 0, np.ones(ring // 4, np.uint8))
    sys.stdin.readline()
    for i in range(100):
        links.send(0, 1, 1 + i, np.zeros(0, np.float32))
elif scenario in ("kill", "stop"):     # one message, then wait to be killed or stopped
    links.send(0, 1, 0, np.arange(10, dtype=np.float64))
    sys.stdin.read()
links.close()
"""


def child(scenario: str, token: str, rank: int, world: int, ring: int = RING,
          ranks: str = "") -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, scenario, token, str(rank), str(world), str(ring), ranks],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finished(proc: subprocess.Popen[bytes]) -> None:
    try:
        _, err = proc.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err.decode()


def leftovers(token: str, pids: tuple[int, ...]) -> list[str]:
    """What this group left in /dev/shm: ring objects of ``pids`` and the
    rendezvous folder."""
    found = shm.objects(creators=pids)
    folder = shmrendezvous._folder(token)[1]
    if os.path.exists(folder):
        found.append(folder + "/" + ",".join(os.listdir(folder)))
    return found


@pytest.fixture
def token() -> Iterator[str]:
    value = os.urandom(16).hex()
    yield value
    folder = shmrendezvous._folder(value)[1]
    if os.path.isdir(folder):   # only after a failure or the SIGKILL-in-connect test
        for entry in os.listdir(folder):
            os.unlink(os.path.join(folder, entry))
        os.rmdir(folder)


def pair(scenario: str, token: str) -> tuple[ShmLinks, subprocess.Popen[bytes]]:
    proc = child(scenario, token, 1, 2)
    try:
        links = ShmLinks.connect(token, 0, 2, deadline=time.monotonic() + WAIT, ring_bytes=RING)
    except BaseException:
        proc.kill()
        proc.wait(WAIT)
        raise
    return links, proc


def test_messages_arrive_in_order_whatever_their_size(token: str) -> None:
    links, proc = pair("echo", token)
    rng = np.random.default_rng(1)
    sizes = [0, 1, 7, 1000, RING // 4, RING // 4 + 1, 3 * RING + 5, 0, 1, 2 * RING]
    dtypes = [np.float32, np.int64, np.float16, np.int8, np.float64, np.int32, np.uint16]
    sent = [(rng.integers(-100, 100, n).astype(dtypes[i % len(dtypes)]), i)
            for i, n in enumerate(sizes * 3)]
    deadline = time.monotonic() + WAIT
    with links:
        for data, chunk in sent:   # all sent before any is read: backlog beyond the ring
            links.send(1, 1, chunk, data)
        for data, chunk in sent:
            # every other message into a matching out=, the rest as returned
            out = np.empty_like(data) if chunk % 2 else None
            got_chunk, got = links.recv(1, 1, deadline, out)
            assert got_chunk == chunk and got.dtype == data.dtype
            np.testing.assert_array_equal(got, data)
            if out is not None:
                assert got is out
        # out= of another dtype or length is not used: a fresh array comes back
        links.send(1, 1, 5, np.arange(5, dtype=np.int32))
        wrong = np.empty(5, np.float32)
        got_chunk, got = links.recv(1, 1, deadline, wrong)
        assert got is not wrong and got.dtype == np.int32 and list(got) == [0, 1, 2, 3, 4]
        links.send(1, 1, 999, np.zeros(0, np.int8))
        links.release(1)   # its end may still be queued: the flusher sends it
        finished(proc)
    assert leftovers(token, (os.getpid(), proc.pid)) == []


def test_earlier_operations_are_discarded_and_later_ones_kept(token: str) -> None:
    links, proc = pair("filter", token)
    deadline = time.monotonic() + WAIT
    with links:
        chunk, data = links.recv(1, 5, deadline)       # op 4 is skipped
        assert chunk == 1 and list(data) == [1] * 10
        chunk, data = links.recv(1, 5, deadline)       # op 6 (3 rings long) is kept
        assert chunk == 3 and list(data) == [3] * 10
        chunk, data = links.recv(1, 6, deadline)
        assert chunk == 2 and data.size == 3 * RING and (data == 2).all()
        links.release(6)
        chunk, data = links.recv(1, 7, deadline)
        assert chunk == 4 and list(data) == [4] * 5
        with pytest.raises(TimeoutError):              # op 4 was discarded, not kept
            links.recv(1, 4, time.monotonic() + 0.2)
        links.send(1, 99, 0, np.zeros(1, np.int8))
        links.release(99)   # its end may still be queued: the flusher sends it
        finished(proc)


def test_a_send_outlives_its_buffer_and_its_operation(token: str) -> None:
    """A send larger than the ring keeps a view of the caller's buffer in
    its backlog: after release (and detach) the buffer may be overwritten,
    and the rest still arrives while this rank calls nothing at all."""
    links, proc = pair("relay", token)
    with links:
        x = np.arange(3 * RING, dtype=np.int64)
        links.send(1, 1, 0, x)
        links.release(1)
        x[:] = -1
        # the peer has it all while this rank only waits for its line
        assert read_line(proc, WAIT, "rank 1's sum").strip() == str(sum(range(3 * RING)))
        _, back = links.recv(1, 1, time.monotonic() + WAIT)
        np.testing.assert_array_equal(back, np.arange(3 * RING))
        x = np.arange(3 * RING, dtype=np.int64)
        links.send(1, 2, 7, x)
        links.detach(2, 7)
        x[:] = -1
        chunk, back = links.recv(1, 2, time.monotonic() + WAIT)
        assert chunk == 7
        np.testing.assert_array_equal(back, np.arange(3 * RING))
        links.send(1, 3, 0, np.zeros(0, np.int8))
        links.release(3)   # its end may still be queued: the flusher sends it
        finished(proc)


def test_close_delivers_what_is_still_queued(token: str) -> None:
    links, proc = pair("bye", token)
    with links:
        _, data = links.recv(1, 1, time.monotonic() + WAIT)
        np.testing.assert_array_equal(data, np.arange(3 * RING))
        finished(proc)


def test_a_peer_that_exited_is_read_to_the_end(token: str) -> None:
    """Everything a peer sent before it exited is delivered, although the
    ack for its first message fails (EPIPE), then PeerError."""
    links, proc = pair("exit", token)
    with links:
        deadline = time.monotonic() + WAIT
        # a view: the ack waits for the next receive, after the peer exited
        assert links.recv(1, 1, deadline)[1].size == RING // 4
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        finished(proc)
        for i in range(100):
            assert links.recv(1, 1, deadline)[0] == 1 + i
        with pytest.raises(PeerError):
            links.recv(1, 1, deadline)


def test_both_ranks_send_64_mib_before_receiving(token: str) -> None:
    proc = child("swap", token, 1, 2, ring=8 << 20)   # the default ring, 8 times smaller
    with ShmLinks.connect(token, 0, 2, deadline=time.monotonic() + WAIT) as links:
        x = np.full(16 << 20, 1, np.float32)
        links.send(1, 1, 0, x)
        out = np.empty_like(x)
        chunk, got = links.recv(1, 1, time.monotonic() + WAIT, out)
        assert got is out and chunk == 1 and (out == 2).all()
        links.release(1)
        stats = links.statistics()   # the end of our send may still be queued
        assert stats.received_bytes == stats.sent_bytes + stats.backlog_bytes == x.nbytes
        links.send(1, 2, 0, np.zeros(1, np.int8))
        links.release(2)   # its end may still be queued: the flusher sends it
        finished(proc)


def test_three_ranks_exchange_with_each_other(token: str) -> None:
    procs = [child("all", token, r, 3) for r in (1, 2)]
    with ShmLinks.connect(token, 0, 3, deadline=time.monotonic() + WAIT,
                          ring_bytes=RING) as links:
        deadline = time.monotonic() + WAIT
        for peer in (1, 2):
            links.send(peer, 1, 0, np.full(3 * RING // 8, 0, np.int64))
        for peer in (1, 2):
            chunk, data = links.recv(peer, 1, deadline)
            assert chunk == peer and data.size == 3 * RING // 8 + peer and (data == peer).all()
        links.release(1)
        for peer in (1, 2):   # both got theirs: let them go
            links.recv(peer, 2, deadline)
            links.send(peer, 3, 0, np.zeros(0, np.int8))
        links.release(3)
        for proc in procs:
            finished(proc)
    assert leftovers(token, (os.getpid(), *(p.pid for p in procs))) == []


def test_only_the_ranks_of_this_machine_are_linked(token: str) -> None:
    """A world of 3 whose ranks 0 and 2 share this machine (rank 1 is
    elsewhere, for other links): 0 and 2 meet without waiting for 1."""
    proc = child("echo", token, 2, 3, ranks="0,2")
    with ShmLinks.connect(token, 0, 3, deadline=time.monotonic() + WAIT, ring_bytes=RING,
                          ranks=[2, 0]) as links:
        links.send(2, 1, 4, np.arange(3 * RING, dtype=np.int32))
        chunk, data = links.recv(2, 1, time.monotonic() + WAIT)
        assert chunk == 4 and (data == np.arange(3 * RING)).all()
        with pytest.raises(PMetalValueError, match="no shared-memory link to rank 1"):
            links.send(1, 1, 0, np.zeros(1, np.int8))
        links.send(2, 1, 999, np.zeros(0, np.int8))
        links.release(1)   # its end may still be queued: the flusher sends it
        finished(proc)
    assert leftovers(token, (os.getpid(), proc.pid)) == []


def test_ranks_that_disagree_on_who_is_local_refuse_each_other(token: str) -> None:
    proc = child("echo", token, 2, 3, ranks="0,2")
    with pytest.raises(HandshakeError, match="same ranks"):
        ShmLinks.connect(token, 0, 3, deadline=time.monotonic() + WAIT, ring_bytes=RING,
                         ranks=[0, 1])
    proc.communicate(timeout=WAIT)
    assert proc.returncode != 0
    assert leftovers(token, (os.getpid(), proc.pid)) == []


def test_a_killed_peer_fails_the_receive_at_once(token: str) -> None:
    links, proc = pair("kill", token)
    with links:
        _, data = links.recv(1, 1, time.monotonic() + WAIT)
        assert list(data) == list(range(10))
        proc.kill()
        proc.wait(WAIT)
        start = time.monotonic()
        with pytest.raises(PeerError):
            links.recv(1, 1, start + WAIT)
        assert time.monotonic() - start < 5.0, "the death was noticed only near the deadline"
        assert links.dead() == {1}
        with pytest.raises(PeerError):
            links.send(1, 2, 0, np.zeros(4, np.float32))
    # connected, then killed: its rings and the rendezvous are already gone
    assert leftovers(token, (os.getpid(), proc.pid)) == []


def test_a_stopped_peer_times_out_at_the_deadline(token: str) -> None:
    links, proc = pair("stop", token)
    try:
        with links:
            links.recv(1, 1, time.monotonic() + WAIT)
            os.kill(proc.pid, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                links.recv(1, 1, start + 1.0)
            assert 1.0 <= time.monotonic() - start < 5.0
            assert links.dead() == set()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(WAIT)


def test_a_peer_killed_while_connecting_leaves_only_what_sweep_and_the_folder_hold(
        token: str) -> None:
    proc = child("echo", token, 1, 2)     # rank 0 never comes
    folder = shmrendezvous._folder(token)[1]
    wait_until(lambda: (os.path.exists(os.path.join(folder, "1.sock"))
                        and shm.objects(creators=(proc.pid,))), WAIT, what="rank 1 waiting")
    proc.kill()
    proc.wait(WAIT)
    (name,) = shm.objects(creators=(proc.pid,))
    # What shm.sweep() unlinks: no reader recorded, and the creator is dead.
    # (Not swept here: a sweep would also take other suites' objects.)
    match = shm._NAME.fullmatch(name)
    assert match is not None and match.group(3) == "0" and not shm.pid_alive(proc.pid)
    shm.unlink(name)
    assert os.listdir(folder) == ["1.sock"]   # removed by the fixture


def test_connect_times_out_without_peers(token: str) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        ShmLinks.connect(token, 1, 2, deadline=start + 0.3, ring_bytes=RING)
    assert time.monotonic() - start < 5.0
    assert leftovers(token, (os.getpid(),)) == []


def test_ranks_with_different_rings_refuse_each_other(token: str) -> None:
    proc = child("echo", token, 1, 2)
    with pytest.raises(HandshakeError, match="ring_bytes"):
        ShmLinks.connect(token, 0, 2, deadline=time.monotonic() + WAIT, ring_bytes=2 * RING)
    proc.communicate(timeout=WAIT)
    assert proc.returncode != 0
    assert leftovers(token, (os.getpid(), proc.pid)) == []


def test_a_world_of_one_needs_nothing(token: str) -> None:
    with ShmLinks.connect(token, 0, 1, deadline=time.monotonic() + 1) as links:
        assert links.dead() == set() and links.world == 1
