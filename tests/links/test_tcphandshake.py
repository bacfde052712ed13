"""The collective links' handshake (pmetal.links.tcphandshake): a
listener runs its handshakes side by side, so strangers that connect and
say nothing, or half a hello, cannot stall a formation; each is dropped
after its own timeout."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from pmetal.errors import AuthenticationError
from pmetal.links import tcphandshake, tcplinks

KEY = b"k" * 32


def _form(world: int, listeners: list[socket.socket], deadline: float, tag: bytes,
          between: Any = None) -> dict[int, Any]:
    """Every rank's connect_mesh in a thread of its own (rank 0 first, then
    ``between()``, then the others); rank -> its links or the exception it
    raised."""
    addresses = [("127.0.0.1", s.getsockname()[1]) for s in listeners]
    out: dict[int, Any] = {}

    def form(rank: int) -> None:
        try:
            out[rank] = tcplinks.connect_mesh(rank, addresses, listeners[rank], key=KEY,
                                              tag=tag, epoch=1, deadline=deadline)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[rank] = exc

    threads = [threading.Thread(target=form, args=(r,)) for r in range(world)]
    threads[0].start()
    if between is not None:
        between()
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(deadline - time.monotonic() + 5.0)
    return out


def _close(out: dict[int, Any], listeners: list[socket.socket]) -> None:
    for s in listeners:
        s.close()
    for links in out.values():
        if isinstance(links, tcplinks.TcpLinks):
            links.close(timeout=1.0)


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass  # a refusal, then the close
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_silent_strangers_cannot_stall_a_formation() -> None:
    """80 connections that never speak and 10 that send half a hello reach
    rank 0's listener while it forms, before ranks 1 and 2 dial. With one handshake at a
    time (2 s each) that was 180 s of stall against a 6 s formation
    deadline; now the ranks form beside them, the strangers are dropped
    after HANDSHAKE_TIMEOUT, and beyond MAX_PENDING at once the oldest go
    first."""
    assert 80 > tcphandshake.MAX_PENDING
    listeners = [tcplinks.listen("127.0.0.1", 0) for _ in range(3)]
    address = listeners[0].getsockname()
    tag = tcplinks.group_tag("stall", 0, 1)
    strangers: list[socket.socket] = []

    def attack() -> None:  # while rank 0 forms, before ranks 1 and 2 dial
        for i in range(90):
            sock = socket.create_connection(address, timeout=5.0)
            if i >= 80:
                sock.sendall(tcphandshake.HELLO_MAGIC + b"\x01\x00")
            strangers.append(sock)

    out: dict[int, Any] = {}
    try:
        out = _form(3, listeners, time.monotonic() + 6.0, tag, between=attack)
        assert all(isinstance(out[r], tcplinks.TcpLinks) for r in range(3)), out
        out[2].send(0, 1, 0, np.arange(3, dtype=np.float32))
        _chunk, got = out[0].recv(2, 1, time.monotonic() + 5.0)
        assert np.array_equal(got, np.arange(3, dtype=np.float32))
        # Every stranger was dropped by now or is within its own timeout.
        assert all(_closed_by_peer(s, tcphandshake.HANDSHAKE_TIMEOUT + 3.0) for s in strangers)
    finally:
        for s in strangers:
            s.close()
        _close(out, listeners)


def test_a_wrong_key_is_refused_while_the_formation_goes_on() -> None:
    """A dialler with another key, claiming rank 1 while rank 0 waits for
    it, is refused with the reason; then the real rank 1 forms."""
    listeners = [tcplinks.listen("127.0.0.1", 0) for _ in range(2)]
    address = listeners[0].getsockname()
    tag = tcplinks.group_tag("keys", 0, 1)
    seen: list[BaseException] = []

    def impostor() -> None:
        try:
            tcphandshake.dial(address, 1, 0, os.urandom(32), tag, time.monotonic() + 5.0)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            seen.append(exc)

    out = _form(2, listeners, time.monotonic() + 8.0, tag, between=impostor)
    try:
        assert len(seen) == 1 and isinstance(seen[0], AuthenticationError), seen
        assert "could not prove the namespace's PSK" in str(seen[0])
        assert all(isinstance(out[r], tcplinks.TcpLinks) for r in range(2)), out
    finally:
        _close(out, listeners)


# Seeded, not os.urandom: the test's id holds the bytes, and parallel
# pytest workers must collect the same ids.
@pytest.mark.parametrize("junk", [random.Random(127).randbytes(tcphandshake.HELLO.size), b""],
                         ids=["random-hello", "empty"])
def test_junk_is_refused_or_dropped_and_the_listener_goes_on(junk: bytes) -> None:
    listeners = [tcplinks.listen("127.0.0.1", 0) for _ in range(2)]
    address = listeners[0].getsockname()
    tag = tcplinks.group_tag("junk", 0, 1)
    stranger = socket.create_connection(address, timeout=5.0)
    stranger.sendall(junk)
    stranger.shutdown(socket.SHUT_WR)
    out = _form(2, listeners, time.monotonic() + 6.0, tag)
    try:
        assert all(isinstance(out[r], tcplinks.TcpLinks) for r in range(2)), out
        assert _closed_by_peer(stranger, 5.0)
    finally:
        stranger.close()
        _close(out, listeners)
