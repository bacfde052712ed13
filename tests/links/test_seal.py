"""Sealed links (pmetal.links.seal): real TCP meshes on loopback, some
through a relay (tests/links/relay.py) that plays the machine in the
middle: it reads, rewrites, replays, reorders and cuts frames, and strips
the seal flag from the handshake. Every attack ends in an error naming the
peer on the rank that received it, and a closed link (not a hang) on the
other; no altered byte is ever handed to a caller."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pmetal.collectives.group import Group, Schedule
from pmetal.config import load_config
from pmetal.errors import AuthenticationError, CollectiveError, ConfigError, PeerError
from pmetal.links import seal, tcplinks
from pmetal.links.seal import SEGMENT, Direction, LinkSeal, derive, requires_seal
from pmetal.links.tcplinks import P2P_BASE
from tests.links.relay import HELLO_FLAG, REPLY_FLAG, Relay, clear_flag

KEY = b"k" * 32
WAIT = 5.0


class Mesh:
    """Two ranks formed by threads of this process; rank 1 dials rank 0
    through ``relay`` when one is given (its kwargs)."""

    def __init__(self, seals: tuple[bool, bool] = (True, True), *, keys: tuple[bytes, bytes]
                 = (KEY, KEY), relay: dict[str, Any] | None = None, wait: float = WAIT) -> None:
        self.listeners = [tcplinks.listen("127.0.0.1", 0) for _ in range(2)]
        real = [("127.0.0.1", s.getsockname()[1]) for s in self.listeners]
        self.relay = Relay(real[0], **relay) if relay is not None else None
        views = [real, [self.relay.address, real[1]] if self.relay else real]
        tag = tcplinks.group_tag("seal-test", 0, 1)
        self.out: dict[int, Any] = {}
        deadline = time.monotonic() + wait

        def form(rank: int) -> None:
            try:
                self.out[rank] = tcplinks.connect_mesh(
                    rank, views[rank], self.listeners[rank], key=keys[rank], tag=tag,
                    epoch=1, deadline=deadline, seal=seals[rank])
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                self.out[rank] = exc

        threads = [threading.Thread(target=form, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(wait + 5.0)
        for s in self.listeners:
            s.close()

    @property
    def links(self) -> tuple[tcplinks.TcpLinks, tcplinks.TcpLinks]:
        a, b = self.out[0], self.out[1]
        assert isinstance(a, tcplinks.TcpLinks) and isinstance(b, tcplinks.TcpLinks), self.out
        return a, b

    def close(self) -> None:
        for links in self.out.values():
            if isinstance(links, tcplinks.TcpLinks):
                links.close(timeout=1.0)
        if self.relay is not None:
            self.relay.close()


@pytest.fixture
def meshes() -> Iterator[list[Mesh]]:
    made: list[Mesh] = []
    yield made
    for mesh in made:
        mesh.close()


def _mesh(meshes: list[Mesh], *args: Any, **kwargs: Any) -> Mesh:
    mesh = Mesh(*args, **kwargs)
    meshes.append(mesh)
    return mesh


def _pattern(n: int, salt: int = 0) -> np.ndarray:
    """A known, distinctive plaintext: what an eavesdropper looks for."""
    return ((np.arange(n, dtype=np.int64) * 7 + 13 + salt) % 251).astype(np.uint8)


# ------------------------------------------------------------ the cipher

def test_a_frame_opens_once_in_its_place_and_nowhere_else() -> None:
    key_a, key_b = derive(KEY, b"t" * 32, 0, 1, b"n" * 31, b"\x01\x00")
    tx, rx = Direction(key_a), Direction(key_a)
    frames = []
    for i in range(3):
        out = bytearray(10 + seal.OVERHEAD)
        tx.seal_into(bytes([i]) * 10, out)
        frames.append(bytes(out))
    plain = bytearray(10)
    assert rx.open_into(frames[0], plain) and plain == b"\x00" * 10
    assert not rx.open_into(frames[0], plain)                 # replayed
    rx = Direction(key_a)
    assert not rx.open_into(frames[1], plain)                 # out of order
    rx = Direction(key_a)
    bent = bytearray(frames[0])
    bent[3] ^= 0x80
    assert not rx.open_into(bent, plain)                      # one bit flipped
    assert not Direction(key_b).open_into(frames[0], plain)   # the other direction's key
    # Any difference in the handshake's transcript gives other keys.
    for other in (derive(KEY, b"t" * 32, 0, 1, b"m" * 31, b"\x01\x00"),
                  derive(KEY, b"u" * 32, 0, 1, b"n" * 31, b"\x01\x00"),
                  derive(KEY, b"t" * 32, 0, 2, b"n" * 31, b"\x01\x00"),
                  derive(KEY, b"t" * 32, 0, 1, b"n" * 31, b"\x01\x01"),
                  derive(b"x" * 32, b"t" * 32, 0, 1, b"n" * 31, b"\x01\x00")):
        assert key_a not in other and key_b not in other
    error = LinkSeal(4, key_a, key_b).refused("a message header")
    assert isinstance(error, AuthenticationError) and "from rank 4" in str(error)


# ------------------------------------------------------- sealed meshes

@pytest.mark.parametrize("seals", [(True, True), (True, False), (False, True)])
def test_either_side_requiring_it_seals_the_link_and_every_size_crosses_intact(
        meshes: list[Mesh], seals: tuple[bool, bool]) -> None:
    a, b = _mesh(meshes, seals).links
    assert a.sealed == {1: True} and b.sealed == {0: True}
    sizes = [0, 1, 1000, 64 << 10, (64 << 10) + 1, 3 * SEGMENT + 7]
    for n, size in enumerate(sizes, 1):
        data = _pattern(size, n)
        a.send(1, P2P_BASE + n, 0, data)
        b.send(0, P2P_BASE + n, 0, data.view(np.uint8)[: size - size % 4].view(np.float32))
    for n, size in enumerate(sizes, 1):
        _chunk, got = b.recv(0, P2P_BASE + n, time.monotonic() + WAIT)
        assert np.array_equal(got, _pattern(size, n))
        out = np.empty((size - size % 4) // 4, np.float32)
        _chunk, back = a.recv(1, P2P_BASE + n, time.monotonic() + WAIT, out)
        assert back is out
        assert np.array_equal(back.view(np.uint8), _pattern(size, n)[: size - size % 4])


def test_an_eavesdropper_reads_a_sealed_link_only_as_noise(meshes: list[Mesh]) -> None:
    known = _pattern(4096).tobytes()
    for seals, visible in (((False, False), True), ((True, True), False)):
        mesh = _mesh(meshes, seals, relay={})
        a, b = mesh.links
        assert b.sealed == {0: not visible}
        b.send(0, P2P_BASE + 1, 0, _pattern(4096))
        a.send(1, P2P_BASE + 1, 0, _pattern(4096))
        assert np.array_equal(a.recv(1, P2P_BASE + 1, time.monotonic() + WAIT)[1],
                              _pattern(4096))
        assert np.array_equal(b.recv(0, P2P_BASE + 1, time.monotonic() + WAIT)[1],
                              _pattern(4096))
        assert mesh.relay is not None
        seen = bytes(mesh.relay.seen)
        assert len(seen) >= 2 * 4096
        assert (known[:64] in seen) is visible      # either way, both directions


RECORD = 44 + 1000 + 16        # one sealed message of 1000 bytes: header, then payload


def _tamper(i: int, data: bytes, held: list[bytes]) -> list[bytes]:
    return [data[:600] + bytes([data[600] ^ 1]) + data[601:]] if i == 1 else [data]


def _replay(i: int, data: bytes, held: list[bytes]) -> list[bytes]:
    if i == 0:
        held.append(data)
        return [data]
    return [held[0], data] if i == 1 else [data]


def _reorder(i: int, data: bytes, held: list[bytes]) -> list[bytes]:
    if i == 0:
        held.append(data)
        return []
    return [data, held[0]] if i == 1 else [data]


def _truncate(i: int, data: bytes, held: list[bytes]) -> list[bytes]:
    return [data[:-3]] if i == 0 else [data]


@pytest.mark.parametrize("script, good", [(_tamper, 1), (_replay, 1), (_reorder, 0),
                                          (_truncate, 0)],
                         ids=["tampered", "replayed", "reordered", "truncated"])
def test_an_altered_frame_breaks_the_link_on_both_sides(meshes: list[Mesh], script: Any,
                                                        good: int) -> None:
    held: list[bytes] = []
    mesh = _mesh(meshes, relay={"record": RECORD,
                                "script": lambda i, data: script(i, data, held)})
    a, b = mesh.links
    for n in range(1, 4):
        b.send(0, P2P_BASE + n, 0, _pattern(1000, n))
    for n in range(1, good + 1):
        assert np.array_equal(a.recv(1, P2P_BASE + n, time.monotonic() + WAIT)[1],
                              _pattern(1000, n))
    with pytest.raises(AuthenticationError, match="from rank 1 failed authentication"):
        a.recv(1, P2P_BASE + good + 1, time.monotonic() + WAIT)
    # The link is gone for good here, and the sender learns it at once.
    with pytest.raises(PeerError, match="failed authentication"):
        a.recv(1, P2P_BASE + good + 2, time.monotonic() + WAIT)
    assert a.dead() == {1}
    with pytest.raises(PeerError):
        b.recv(0, P2P_BASE + 1, time.monotonic() + WAIT)


def test_a_link_cut_in_the_middle_of_a_frame_is_a_lost_peer(meshes: list[Mesh]) -> None:
    mesh = _mesh(meshes, relay={"record": RECORD,
                                "script": lambda i, data: [data[:500]] if i == 1 else
                                ([data] if i == 0 else None)})    # then closes
    a, b = mesh.links
    for n in range(1, 4):
        b.send(0, P2P_BASE + n, 0, _pattern(1000, n))
    assert np.array_equal(a.recv(1, P2P_BASE + 1, time.monotonic() + WAIT)[1],
                          _pattern(1000, 1))
    with pytest.raises(PeerError, match="closed its connection"):
        a.recv(1, P2P_BASE + 2, time.monotonic() + WAIT)


def test_another_psk_cannot_form_a_sealed_link(meshes: list[Mesh]) -> None:
    mesh = _mesh(meshes, keys=(KEY, os.urandom(32)), wait=1.5)
    assert isinstance(mesh.out[1], AuthenticationError)
    assert "could not prove the namespace's PSK" in str(mesh.out[1])
    assert isinstance(mesh.out[0], CollectiveError)


@pytest.mark.parametrize("seals, where", [((False, True), "hello"),
                                          ((True, False), "reply"),
                                          ((True, True), "hello")])
def test_a_relay_that_strips_the_seal_flag_is_caught(meshes: list[Mesh],
                                                     seals: tuple[bool, bool],
                                                     where: str) -> None:
    """The flag of the side that requires sealing is cleared on the way, so
    that the other would agree to clear text: the proofs cover both flags,
    the dialler sees it, says so, and tells the listener."""
    rewrite = ({"hello": lambda b: clear_flag(b, HELLO_FLAG)} if where == "hello"
               else {"reply": lambda b: clear_flag(b, REPLY_FLAG)})
    mesh = _mesh(meshes, seals, relay=rewrite, wait=1.5)
    assert isinstance(mesh.out[1], AuthenticationError), mesh.out
    assert "altered in transit" in str(mesh.out[1])
    assert isinstance(mesh.out[0], CollectiveError), mesh.out
    assert "altered in transit" in str(mesh.out[0])


def test_a_byte_flipped_in_the_middle_of_an_all_reduce_fails_every_rank(
        meshes: list[Mesh]) -> None:
    """A real all_reduce (ring, 2 ranks, 1 MiB) whose data crosses a relay
    that flips one bit: the rank that receives it raises CollectiveError
    naming the peer and the authentication failure; the other loses its
    peer. Nobody waits for the operation's deadline, nobody gets a sum."""
    mesh = _mesh(meshes, relay={"flip_at": 100_000})
    groups = [Group(Schedule(name="sealed", world=2, strategy="ring"), r, links,
                    timeout=WAIT) for r, links in enumerate(mesh.links)]
    got: dict[int, Any] = {}

    def run(rank: int) -> None:
        try:
            got[rank] = groups[rank].all_reduce(np.full(1 << 18, rank + 1, np.float32))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            got[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT + 5.0)
    assert isinstance(got[0], CollectiveError), got
    assert "refused what rank 1 sent" in str(got[0]) and "failed authentication" in str(got[0])
    assert isinstance(got[1], CollectiveError), got
    assert "lost rank 0" in str(got[1])


@pytest.mark.parametrize("strategy", ["ring", "tree", "naive"])
def test_every_strategy_is_exact_over_sealed_links(strategy: str) -> None:
    """Three ranks, sealed links, a buffer of several segments per chunk
    and an odd tail: every rank gets the exact sum."""
    world = 3
    listeners = [tcplinks.listen("127.0.0.1", 0) for _ in range(world)]
    addresses = [("127.0.0.1", s.getsockname()[1]) for s in listeners]
    tag = tcplinks.group_tag("sealed-world", 0, 1)
    links: dict[int, Any] = {}
    got: dict[int, Any] = {}
    n = 3 * SEGMENT // 4 * world + 5            # float32 elements

    def run(rank: int) -> None:
        try:
            links[rank] = tcplinks.connect_mesh(rank, addresses, listeners[rank], key=KEY,
                                                tag=tag, epoch=1,
                                                deadline=time.monotonic() + WAIT)
            group = Group(Schedule(name="sealed", world=world, strategy=strategy), rank,
                          links[rank], timeout=WAIT)
            got[rank] = group.all_reduce(np.arange(n, dtype=np.float32) % 251 + rank)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            got[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * WAIT + 5.0)
    for s in listeners:
        s.close()
    try:
        expected = (np.arange(n, dtype=np.float32) % 251) * world + sum(range(world))
        for rank in range(world):
            assert isinstance(got.get(rank), np.ndarray), got
            assert all(links[rank].sealed.values())
            assert np.array_equal(got[rank], expected)
    finally:
        for one in links.values():
            one.close(timeout=1.0)


# ----------------------------------------------------------- the policy

def test_the_policy_seals_off_loopback_unless_turned_off() -> None:
    assert not requires_seal("auto", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
    assert requires_seal("auto", ["127.0.0.1", "10.0.0.2"])
    assert requires_seal("on", ["127.0.0.1"])
    assert not requires_seal("off", ["10.0.0.1", "10.0.0.2"])
    assert load_config(collectives={"link_encryption": "off"}).collectives.link_encryption \
        == "off"
    with pytest.raises(ConfigError, match="collectives.link_encryption: is 'of'; use auto, "
                                          "on, off"):
        load_config(collectives={"link_encryption": "of"})
    with pytest.raises(ConfigError, match="link_encryption"):
        load_config({"PMETAL_COLLECTIVES_LINK_ENCRYPTION": "none"})
