"""Shared memory: the same-machine proof of the handshake, and the sweep of
objects left behind by processes killed with SIGKILL.

Real processes throughout: a child that is killed with SIGKILL, a driver
process that leaves replies unread, a child in its own network namespace
(when this runs as root with ``unshare``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import WAIT, SecureNode, make_config

from actors.conftest import read_line, wait_until
from pmetal import shm
from pmetal.identity import NodeIdentity
from pmetal.security import (NetworkNamespace, client_finish, client_hello, server_finish,
                             server_welcome)
from pmetal.wire import Pong

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm") or not shm.available(),
                                reason="needs a listable /dev/shm (Linux)")

NS = NetworkNamespace("test", b"0123456789abcdef-test-psk")


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(WAIT)


def spawn(children: list[subprocess.Popen[bytes]], script: str,
          *prefix: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([*prefix, sys.executable, "-c", textwrap.dedent(script)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    children.append(proc)
    return proc


def kill9(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(WAIT)


# ------------------------------------------------------ same-machine proof

def handshake(client_ns: NetworkNamespace = NS, hello_host: bytes | None = None) -> tuple:
    client, server = NodeIdentity.generate(), NodeIdentity.generate()
    state = client_hello(client, client_ns, prove_host=True)
    if hello_host is not None:
        state.discard()
        state.hello = dataclasses.replace(state.hello, host=hello_host)
    welcome, pending = server_welcome(server, NS, state.hello)
    confirm, client_session = client_finish(client, client_ns, state, welcome, 2)
    return client_session, server_finish(NS, pending, confirm, 2), state


def test_handshake_proves_the_same_machine_and_exchanges_pids() -> None:
    before = set(shm.objects(creators=(os.getpid(),)))
    client_session, server_session, state = handshake()
    assert client_session.local and server_session.local
    assert client_session.peer_pid == server_session.peer_pid == os.getpid()
    assert set(shm.objects(creators=(os.getpid(),))) == before, "the token was left behind"
    assert not shm.exists(state.hello.host[shm._OFFER.size:].decode())


@pytest.mark.parametrize("forged", [b"another machine!", b"", bytes(200)],
                         ids=["garbage", "empty", "zeros"])
def test_a_claim_without_the_shared_memory_proof_is_not_local(forged: bytes) -> None:
    client_session, server_session, _ = handshake(hello_host=forged)
    assert not client_session.local and not server_session.local
    assert client_session.peer_pid == server_session.peer_pid == 0


def test_a_token_whose_secret_does_not_match_is_not_local() -> None:
    """Naming somebody else's object is not enough: its secret must hash to
    the commitment in the Hello."""
    blob, token = shm.offer()
    other_blob, other = shm.offer()
    forged = blob[:shm._OFFER.size] + other_blob[shm._OFFER.size:]   # other's object
    try:
        reply, peer = shm.answer(forged)
        assert not peer.local and reply == b""
        assert shm.exists(other.name), "a Hello made the server unlink another object"
    finally:
        token.discard()
        other.discard()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="making a network namespace needs root and unshare(1); the "
                           "same-machine proof across namespaces is not exercised here")
def test_same_machine_is_proven_across_network_namespaces(
        children: list[subprocess.Popen[bytes]]) -> None:
    """A client in its own network namespace (where the MAC address that
    uuid.getnode() reads is not the host's) still proves the shared machine,
    both ways."""
    proc = spawn(children, """
        import os, sys
        from pmetal import shm
        blob, token = shm.offer()
        print(os.readlink("/proc/self/ns/net"), blob.hex(), flush=True)
        peer = shm.confirm(token, bytes.fromhex(sys.stdin.readline()))
        print(peer.local, peer.pid, flush=True)
    """, "unshare", "-n")
    netns, blob = read_line(proc, WAIT, "client in a network namespace").split()
    assert netns != os.readlink("/proc/self/ns/net"), "the child shares our network namespace"
    reply, peer = shm.answer(bytes.fromhex(blob))
    assert peer.local and peer.pid == proc.pid
    assert proc.stdin is not None
    proc.stdin.write(reply.hex().encode() + b"\n")
    proc.stdin.flush()
    local, pid = read_line(proc, WAIT, "client confirming").split()
    assert local == "True" and int(pid) == os.getpid()


# ------------------------------------------------------------------ sweep

def test_sweep_unlinks_what_killed_processes_left(children: list[subprocess.Popen[bytes]]
                                                  ) -> None:
    """A child killed with SIGKILL leaves objects it made for nobody in
    particular and objects made for it that it never read; the sweep unlinks
    both, and keeps what a live process has still to read."""
    child = spawn(children, """
        import os, sys
        from pmetal import shm
        mine = [shm.export(memoryview(bytes(4096))) for _ in range(3)]
        for_parent = [shm.export(memoryview(bytes(4096)), os.getppid()) for _ in range(2)]
        print(" ".join(mine + for_parent), flush=True)
        sys.stdin.read()
    """)
    names = read_line(child, WAIT, "child exporting").split()
    made_for_nobody, made_for_us = names[:3], names[3:]
    unread = [shm.export(memoryview(bytes(4096)), child.pid) for _ in range(4)]
    kill9(child)
    try:
        removed = shm.sweep()
        assert set(made_for_nobody + unread) <= set(removed)
        assert not [n for n in made_for_nobody + unread if shm.exists(n)]
        assert all(shm.exists(n) for n in made_for_us), "a live reader's object was swept"
        assert not shm.objects(readers=(child.pid,)) and not [
            n for n in shm.objects(creators=(child.pid,)) if n not in made_for_us]
    finally:
        for name in names + unread:
            shm.unlink(name)


def test_replies_for_a_driver_killed_with_sigkill_are_swept(
        make_node: Callable[..., SecureNode], children: list[subprocess.Popen[bytes]]) -> None:
    """A driver process asks for arrays (they come back through shared
    memory) and is killed before reading them: the listener named the
    driver's pid, learnt in the handshake, as their reader, so the sweep
    finds them."""
    cfg = make_config(shm_min_bytes=1024)
    node = make_node(cfg)
    node.handler.answer = lambda incoming: Pong(np.ones(4096, np.float64))
    driver = spawn(children, f"""
        import sys
        from pmetal.config import load_config
        from pmetal.endpoint import Channel
        from pmetal.identity import NodeIdentity
        from pmetal.security import NetworkNamespace
        from pmetal.transport import ZmqTransport
        from pmetal.wire import Ping
        cfg = load_config(env={{}}, transport={{"shm_min_bytes": 1024}})
        ns = NetworkNamespace("test", {NS.psk!r})
        channel = Channel(ZmqTransport(cfg.transport, curve=ns.curve_keys()).dial(
            {node.address!r}), NodeIdentity.generate(), ns, cfg)
        channel.open(timeout=10)
        print(channel.session.local, [channel.submit(Ping(i)) for i in range(5)], flush=True)
        sys.stdin.read()
    """)
    local = read_line(driver, WAIT, "driver").split()[0]
    assert local == "True"
    assert node.handler.wait_count(5)
    # The replies are exported once the handler has returned: wait for them.
    wait_until(lambda: len(shm.objects(readers=(driver.pid,))) == 5, WAIT,
               what="the five replies in shared memory")
    kill9(driver)
    shm.sweep()
    assert not shm.objects(readers=(driver.pid,))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_zombie_is_dead_to_the_sweep() -> None:
    # A killed process its parent has not reaped yet will never read an
    # object; the sweep (and the node's owner watch) must not wait for the
    # reaping, which is the parent's business.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        assert shm.pid_alive(child.pid)
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)   # exited, not reaped
        assert not shm.pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not shm.pid_alive(child.pid)
    assert shm.pid_alive(os.getpid())
