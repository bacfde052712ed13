"""Hostile traffic against a live SecureListener + Server on loopback.

Raw ZeroMQ DEALERs throw thousands of malformed messages at a node, some
before any handshake and some over a session they did authenticate. The
node must drop every one of them without calling its handler, count each
drop exactly once, and keep serving good peers. The traffic comes from a
seeded generator, so a failing seed replays the same run.
"""

from __future__ import annotations

import dataclasses
import random
import struct
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import zmq
from conftest import (
    WAIT,
    SecureNode,
    as_bytes,
    make_config,
    raw_dealer,
    raw_handshake,
    recv_reply,
)

from pmetal.channel import UNDECODABLE
from pmetal.endpoint import Channel
from pmetal.errors import PMetalError, ProtocolError
from pmetal.identity import NodeIdentity, node_id_for
from pmetal.security import NetworkNamespace, Session, client_finish, client_hello
from pmetal.wire import (
    PROTOCOL_VERSION,
    Accepted,
    Confirm,
    ErrorReply,
    Hello,
    Kind,
    Message,
    Pickled,
    Ping,
    Pong,
    Rejected,
    Welcome,
    decode,
    encode,
    message_types,
)

SEEDS = [7, 2024]
UNAUTHENTICATED_MESSAGES = 3000
AUTHENTICATED_MESSAGES = 1000
DEALERS = 4

Frames = list[bytes]
MakeNode = Callable[..., SecureNode]
MakeChannel = Callable[..., Channel]


# ---------------------------------------------------- unauthenticated traffic

def _default_instances() -> list[Message]:
    """One instance of every message kind that has defaults for all fields,
    plus hand-made ones for the handshake and reply kinds."""
    found: list[Message] = []
    for cls in message_types().values():
        try:
            found.append(cls())
        except TypeError:
            continue
    ident = NodeIdentity.generate()
    found += [
        Ping("hi"), Pong(np.arange(5)), Accepted(ident.node_id), Rejected("no"),
        ErrorReply("ValueError", "boom", "tb"),
        Welcome(ident.node_id, ident.public_key, bytes(32), bytes(32), bytes(32), bytes(64)),
    ]
    return found


class Fuzzer:
    """Makes one malformed message per call to :meth:`unauthenticated`."""

    def __init__(self, rng: random.Random, namespace: NetworkNamespace) -> None:
        self.rng = rng
        self.tag = namespace.tag  # public: announced over mDNS
        self.instances = _default_instances()
        self.outsider = NodeIdentity.generate()
        self.makers: list[Callable[[], Frames]] = [
            self.random_frames, self.truncated_handshake, self.flipped_handshake,
            self.wrong_kind, self.bogus_seal, self.many_frames, self.odd_envelope,
            self.hostile_hello, self.random_confirm, self.bad_arrays, self.pickled,
        ]

    def unauthenticated(self) -> Frames:
        return self.rng.choice(self.makers)()

    def _bytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def random_frames(self) -> Frames:
        sizes = [0, 1, 2, 8, 9, 16, 25, 26, 100, self.rng.randrange(3000)]
        return [self._bytes(self.rng.choice(sizes)) for _ in range(self.rng.randint(1, 4))]

    def _handshake_message(self) -> Frames:
        state = client_hello(self.outsider, NetworkNamespace("x", b"f" * 16))
        msg = self.rng.choice([
            state.hello,
            Confirm(self._bytes(32), self._bytes(64)),
            Welcome(self.outsider.node_id, self.outsider.public_key, self._bytes(32),
                    self._bytes(32), self._bytes(32), self._bytes(64)),
        ])
        return as_bytes(encode(msg, sender=self.outsider.node_id))

    def truncated_handshake(self) -> Frames:
        frame = self._handshake_message()[0]
        return [frame[:self.rng.randrange(len(frame))]]

    def flipped_handshake(self) -> Frames:
        frame = bytearray(self._handshake_message()[0])
        for _ in range(self.rng.randint(1, 3)):
            frame[self.rng.randrange(len(frame))] ^= 1 << self.rng.randrange(8)
        return [bytes(frame)]

    def wrong_kind(self) -> Frames:
        msg = self.rng.choice(self.instances)
        return as_bytes(encode(msg, corr=self.rng.randrange(5), term=self.rng.choice([None, 3]),
                               sender=self.rng.choice([None, self.outsider.node_id])))

    def bogus_seal(self) -> Frames:
        frames = as_bytes(encode(Ping(self.rng.choice(["x", np.arange(50)])), corr=1))
        seal = self._bytes(16) + struct.pack("<QB", self.rng.randrange(1, 100),
                                             self.rng.choice([1, 2, 3, 0x82, 0x41]))
        frames[0] += self.rng.choice([seal, seal[16:], self._bytes(25)])
        return frames

    def many_frames(self) -> Frames:
        head = as_bytes(encode(Ping(1)))[0]
        count = self.rng.randint(100, 1500)
        filler = self.rng.choice([b"", b"x", self._bytes(16)])
        return [head, *([filler] * count)]

    def odd_envelope(self) -> Frames:
        r = self.rng
        good = [PROTOCOL_VERSION, int(Kind.PING), 1, None, None, ["payload"]]
        index = r.randrange(6)
        weird = r.choice([None, -1, 2**64 - 1, "1", b"\x01", [], {}, 1.5, True,
                          msgpack.ExtType(99, b""), msgpack.ExtType(2, b"pickle bytes"),
                          msgpack.ExtType(1, msgpack.packb(["float64", [10], 1, 1])),
                          msgpack.ExtType(1, b"\xff\xfe"), r.randrange(1000)])
        shape = r.choice(["field", "length", "top", "deep", "huge map"])
        if shape == "field":
            good[index] = weird
            obj: Any = good
        elif shape == "length":
            obj = good[:r.randrange(6)] + [weird] * r.randrange(3)
        elif shape == "top":
            obj = weird
        elif shape == "deep":
            obj = good
            for _ in range(r.randint(100, 400)):
                obj = [obj]
        else:
            obj = {i: i for i in range(r.randint(1000, 5000))}
        return [msgpack.packb(obj, use_bin_type=True)]

    def hostile_hello(self) -> Frames:
        """Hellos an outsider can make: the tag is public, the PSK is not."""
        r = self.rng
        pk = r.choice([self.outsider.public_key, self._bytes(32), self._bytes(31)])
        node_id = r.choice([NodeIdentity.generate().node_id, "n" * r.randrange(200), "",
                            "z" * 8192])
        if r.random() < 0.4 and len(pk) == 32:
            node_id = node_id_for(pk)  # consistent: the server answers with a Welcome
        eph = r.choice([self._bytes(32), bytes(32), self._bytes(r.randrange(64))])
        nonce = r.choice([self._bytes(32), b"", self._bytes(33)])
        tag = r.choice([self.tag, self.tag, self._bytes(8), b""])
        return as_bytes(encode(Hello(node_id, pk, eph, nonce, tag)))

    def random_confirm(self) -> Frames:
        return as_bytes(encode(Confirm(self._bytes(self.rng.choice([0, 32, 100])),
                                       self._bytes(self.rng.choice([0, 64])))))

    def bad_arrays(self) -> Frames:
        frames = as_bytes(encode(Ping([np.arange(100, dtype=np.int32), np.ones(7)])))
        choice = self.rng.randrange(4)
        if choice == 0:
            frames.pop()
        elif choice == 1:
            frames.append(b"extra")
        elif choice == 2:
            frames[1] = frames[1][:-4]
        else:
            frames[1], frames[2] = frames[2], frames[1]
        return frames

    def pickled(self) -> Frames:
        return as_bytes(encode(Ping(Pickled(b"cos\nsystem\n(S'echo pwned'\ntR."))))


# ------------------------------------------------------ authenticated traffic

class SessionFuzzer:
    """Malformed traffic over a session the attacker did authenticate."""

    def __init__(self, rng: random.Random, session: Session, other: Session,
                 fuzzer: Fuzzer) -> None:
        self.rng = rng
        self.session = session
        self.other = other  # a session with the same node, on another route
        self.fuzzer = fuzzer
        self.sent_sealed: list[Frames] = []

    def malformed(self) -> Frames:
        """Unauthenticated fuzz that does not decode (some of it is a valid
        message, which an authenticated peer may legitimately send)."""
        while True:
            frames = self.fuzzer.unauthenticated()
            try:
                decode(frames, allow_pickle=True)
            except ProtocolError:
                return frames

    def message(self) -> Frames:
        r = self.rng
        kind = r.randrange(8)
        if kind == 0:
            return self.fuzzer.random_frames()
        if kind == 1:  # short frames whose last byte looks like a stream flag
            return [bytes([r.choice([0x80, 0x81, 0x82, 0x40, 0x41, 0xC2])]) * r.randint(1, 8),
                    *([r.randbytes(8)] if r.random() < 0.5 else [])]
        if kind == 2:
            return self.fuzzer.bogus_seal()
        if kind == 3:  # sealed, then flipped in one bit
            sealed = as_bytes(self.session.seal(encode(Ping("flip me"), corr=1)))
            frame = bytearray(sealed[0])
            frame[r.randrange(len(frame))] ^= 1 << r.randrange(8)
            return [bytes(frame)]
        if kind == 4:  # sealed with another session's keys
            return as_bytes(self.other.seal(encode(Ping("wrong keys"), corr=1)))
        if kind == 5 and self.sent_sealed:  # replay of a message that was accepted
            return r.choice(self.sent_sealed)
        if kind == 6:  # properly sealed garbage: authentic, but not a message
            sealed = as_bytes(self.session.seal(self.malformed()))
            self.sent_sealed.append(sealed)
            return sealed
        # properly sealed, but buffers that do not match the envelope
        frames = as_bytes(encode(Ping(np.arange(10))))
        frames[1] = frames[1][:-1]
        sealed = as_bytes(self.session.seal(frames))
        self.sent_sealed.append(sealed)
        return sealed


# ------------------------------------------------------------------- helpers

def send_all(sock: zmq.Socket, frames: Frames) -> None:
    sock.send_multipart(frames)


def drop_total(node: SecureNode) -> int:
    s = node.listener.statistics()
    return (s.dropped_malformed + s.dropped_unauthenticated + s.refused_handshakes
            + s.dropped_auth_failures)


# --------------------------------------------------------------------- tests

@pytest.mark.parametrize("seed", SEEDS)
def test_fuzzed_traffic_is_dropped_and_good_peers_are_served(
        make_node: MakeNode, make_channel: MakeChannel, zmq_context: zmq.Context,
        seed: int) -> None:
    started = time.monotonic()
    rng = random.Random(seed)
    node = make_node(make_config(handshake_timeout=2.0))
    fuzzer = Fuzzer(rng, node.namespace)

    # Before any handshake: every message earns exactly one reply (Rejected,
    # or Welcome for a well-formed Hello), so the replies tell us when the
    # node has seen them all.
    dealers = [raw_dealer(zmq_context, node.address) for _ in range(DEALERS)]
    sent = [0] * DEALERS
    for i in range(UNAUTHENTICATED_MESSAGES):
        send_all(dealers[i % DEALERS], fuzzer.unauthenticated())
        sent[i % DEALERS] += 1
    welcomes = 0
    for dealer, count in zip(dealers, sent):
        for _ in range(count):
            try:
                reply = recv_reply(dealer)
            except zmq.Again:
                pytest.fail(f"seed {seed}: the node stopped answering "
                            f"(server error: {node.server.error!r}, "
                            f"statistics: {node.listener.statistics()})")
            assert isinstance(reply, (Rejected, Welcome)), reply
            welcomes += isinstance(reply, Welcome)
    assert node.handler.count == 0
    assert drop_total(node) == UNAUTHENTICATED_MESSAGES - welcomes
    assert node.listener.statistics().sessions == 0

    # Over an authenticated session: every message is dropped; a sealed
    # request that does not decode is refused with an ErrorReply (never
    # handled); a final genuine request tells us when the node has seen all.
    insider = raw_dealer(zmq_context, node.address, SNDTIMEO=2000, RCVTIMEO=2000)
    session = raw_handshake(insider, NodeIdentity.generate(), node.namespace)
    bystander = raw_dealer(zmq_context, node.address)
    other = raw_handshake(bystander, NodeIdentity.generate(), node.namespace)
    session_fuzzer = SessionFuzzer(rng, session, other, fuzzer)
    try:
        for i in range(AUTHENTICATED_MESSAGES):
            send_all(insider, session_fuzzer.message())
            if i % 50 == 0 and node.server.error is not None:
                raise zmq.Again()
        insider.send_multipart(session.seal(encode(Ping("insider"), corr=99)))
        refusals = 0
        while (reply := decode(session.open(insider.recv_multipart()))).corr != 99:
            assert isinstance(reply.body, ErrorReply), reply
            assert reply.body.error_type == "ProtocolError", reply
            assert reply.body.message.startswith(UNDECODABLE), reply
            refusals += 1
    except zmq.Again:
        pytest.fail(f"seed {seed}: the node stopped serving its authenticated peer "
                    f"(server error: {node.server.error!r})")
    assert reply.body == Pong("insider") and reply.corr == 99
    assert node.listener.statistics().refused_requests == refusals
    assert node.handler.payloads() == ["insider"], "fuzz traffic reached the handler"
    assert drop_total(node) == UNAUTHENTICATED_MESSAGES - welcomes + AUTHENTICATED_MESSAGES

    # A good peer is served as if nothing happened.
    channel = make_channel(node.address)
    assert channel.open() == node.identity.node_id
    for i in range(20):
        assert channel.request(Ping(i)).body == Pong(i)
    assert node.handler.payloads() == ["insider", *range(20)]
    assert node.server.error is None
    stats = node.listener.statistics()
    assert stats.sessions == 3 and stats.handshakes == 3
    assert stats.dropped_malformed > 0 and stats.dropped_unauthenticated > 0
    assert stats.refused_handshakes > 0 and stats.dropped_auth_failures > 0
    assert time.monotonic() - started < 20


def test_stream_flag_bytes_from_an_authenticated_peer_are_dropped(
        make_node: MakeNode, make_channel: MakeChannel, zmq_context: zmq.Context) -> None:
    """The shortest frames whose last byte carries a stream flag: the
    session layer must refuse them like any other bad seal."""
    node = make_node()
    insider = raw_dealer(zmq_context, node.address, RCVTIMEO=2000)
    session = raw_handshake(insider, NodeIdentity.generate(), node.namespace)
    for frames in ([b"\x80"], [b"\x82" * 8], [b"\x41"], [b"\xc0" * 3, b"12345678"]):
        insider.send_multipart(frames)
    insider.send_multipart(session.seal(encode(Ping("after"), corr=1)))
    try:
        reply = decode(session.open(insider.recv_multipart())).body
    except zmq.Again:
        pytest.fail(f"node stopped serving (server error: {node.server.error!r})")
    assert reply == Pong("after")
    assert node.listener.statistics().dropped_auth_failures == 4
    assert node.server.error is None


def test_streamed_garbage_from_an_authenticated_peer_is_dropped(
        make_node: MakeNode, zmq_context: zmq.Context) -> None:
    """Streamed (multi-part) messages that are incomplete, tampered, or
    complete but malformed never reach the handler."""
    node = make_node()
    insider = raw_dealer(zmq_context, node.address)
    session = raw_handshake(insider, NodeIdentity.generate(), node.namespace)
    if not hasattr(session, "seal_parts"):
        pytest.skip("this Session has no streaming")
    session.stream_bytes = 64 << 10
    rng = random.Random(3)

    def garbage_stream() -> list[Frames]:
        envelope = msgpack.packb([PROTOCOL_VERSION, int(Kind.PING), 1, None, None,
                                  [msgpack.ExtType(1, msgpack.packb(["uint8", [5], 1, 1]))]])
        buffers = [rng.randbytes(60 << 10) for _ in range(4)]
        return [as_bytes(p) for p in session.seal_parts([envelope, *buffers])]

    expected = 0
    parts = garbage_stream()
    assert len(parts) >= 3
    for part in parts:  # complete, authentic, but the envelope lies about its buffers
        insider.send_multipart(part)
    expected += 1
    for tampered in range(1, len(parts)):
        parts = garbage_stream()
        frame = bytearray(parts[tampered][-1])
        frame[len(frame) // 2] ^= 0x10
        parts[tampered][-1] = bytes(frame)
        for part in parts:
            insider.send_multipart(part)
        expected += len(parts) - tampered  # the bad segment, then each orphan after it
    for part in garbage_stream()[1:]:  # segments without their head
        insider.send_multipart(part)
        expected += 1

    insider.send_multipart(session.seal(encode(Ping("after"), corr=2)))
    # The complete, authentic one (request 1) is refused, never handled.
    refusal = decode(session.open(insider.recv_multipart()))
    assert refusal.corr == 1 and isinstance(refusal.body, ErrorReply), refusal
    reply = decode(session.open(insider.recv_multipart())).body
    assert reply == Pong("after")
    assert node.handler.payloads() == ["after"]
    stats = node.listener.statistics()
    assert stats.dropped_malformed + stats.dropped_auth_failures == expected


def test_peer_that_never_reads_its_rejections_cannot_stop_the_node(
        make_node: MakeNode, make_channel: MakeChannel, zmq_context: zmq.Context) -> None:
    """An unauthenticated flood from a socket that never reads the replies
    fills the node's queue to it. The node must give up on those replies
    (nobody is owed them) and keep serving good peers."""
    node = make_node(make_config(send_hwm=5, recv_hwm=5, handshake_timeout=0.5))
    flooder = raw_dealer(zmq_context, node.address, RCVHWM=1, RCVBUF=4096, SNDTIMEO=1000)
    rng = random.Random(11)
    outsider = NodeIdentity.generate()
    # The node echoes the claimed node id in its rejection: large rejections
    # fill the buffers after a few dozen messages.
    big_hello = as_bytes(encode(Hello("z" * 16384, outsider.public_key, rng.randbytes(32),
                                      rng.randbytes(32), node.namespace.tag)))
    sent = 0
    try:
        for i in range(2500):
            send_all(flooder, big_hello if i < 300 else [rng.randbytes(40)])
            sent += 1
    except zmq.Again:
        pass  # the node stopped reading us: that is its right
    assert sent > 0
    # ZeroMQ queues fairly: the node takes at least one flood message between
    # two of ours, so after these requests it has worked through dozens.
    channel = make_channel(node.address, make_config(handshake_timeout=2.0))
    requests = 40
    try:
        channel.open()
        for i in range(requests):
            assert channel.request(Ping(i), timeout=2.0).body == Pong(i)
    except PMetalError as exc:
        pytest.fail(f"a good peer was not served during the flood: {exc!r} "
                    f"(server error: {node.server.error!r})")
    assert node.server.error is None
    assert node.handler.payloads() == list(range(requests))
    assert drop_total(node) >= requests


# ------------------------------------------- crafted handshakes (hypothesis)

_FIELD = st.one_of(st.binary(max_size=80), st.sampled_from([b"", bytes(32), b"\xff" * 32]))
_INT = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.sampled_from([0, 1, 2, 3, 4, -1]))


def test_crafted_handshake_fields_never_stop_the_listener(
        make_node: MakeNode, make_channel: MakeChannel, zmq_context: zmq.Context,
        namespace: NetworkNamespace) -> None:
    """Hellos and Confirms whose fields are well typed but crafted (keys of
    every length, modes out of range, host proofs of garbage, node ids that
    do not match their keys), sent by a PSK holder who passes the namespace
    tag check: each is answered with a Welcome or a Rejected, never with an
    exception in the listener's thread, and a legitimate peer is served
    between them and after."""
    node = make_node()
    good = make_channel(node.address)
    good.open()
    attacker = raw_dealer(zmq_context, node.address)
    tag = client_hello(NodeIdentity.generate(), namespace).hello.namespace_tag
    answered: list[type] = []

    def answer() -> Message:
        try:
            return recv_reply(attacker)
        except zmq.Again:
            pytest.fail(f"the listener stopped answering handshakes "
                        f"(server error: {node.server.error!r})")

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(node_id=st.one_of(st.text(max_size=40), st.just(NodeIdentity.generate().node_id)),
           public_key=_FIELD, ephemeral_key=_FIELD, nonce=_FIELD, mode=_INT,
           host=st.one_of(_FIELD, st.binary(min_size=60, max_size=200)),
           tagged=st.booleans(), proof=_FIELD, signature=_FIELD)
    def crafted(node_id: str, public_key: bytes, ephemeral_key: bytes, nonce: bytes,
                mode: int, host: bytes, tagged: bool, proof: bytes, signature: bytes) -> None:
        hello = Hello(node_id, public_key, ephemeral_key, nonce, tag if tagged else nonce,
                      mode, host)
        attacker.send_multipart(encode(hello))
        reply = answer()
        assert isinstance(reply, (Welcome, Rejected)), reply
        answered.append(type(reply))
        attacker.send_multipart(encode(Confirm(proof, signature)))
        assert isinstance(answer(), Rejected)

    # A genuine Hello with one field replaced at a time reaches furthest.
    ident = NodeIdentity.generate()
    genuine = client_hello(ident, namespace).hello
    for field, value in [("mode", 1 << 63), ("mode", -5), ("host", b"\x00" * 300),
                         ("host", b"x"), ("ephemeral_key", bytes(31)), ("nonce", b""),
                         ("public_key", b"\x01" * 33), ("node_id", "")]:
        attacker.send_multipart(encode(dataclasses.replace(genuine, **{field: value})))
        assert isinstance(answer(), (Welcome, Rejected)), field
        assert good.request(Ping(field)).body == Pong(field)
    crafted()
    for i in range(5):
        assert good.request(Ping(i), timeout=WAIT).body == Pong(i)
    assert node.server.error is None
    stats = node.listener.statistics()
    assert stats.refused_handshakes >= len(answered)
    assert stats.sessions == 1, "a crafted handshake opened a session"


@pytest.mark.parametrize("error", [ProtocolError, ValueError, OverflowError, KeyError])
def test_any_error_in_a_handshake_or_decoding_is_refused_and_served_on(
        make_node: MakeNode, make_channel: MakeChannel, zmq_context: zmq.Context,
        namespace: NetworkNamespace, monkeypatch: pytest.MonkeyPatch,
        error: type[Exception]) -> None:
    """Whatever the handshake checks or the decoder raise for one peer's
    message (injected here: no crafted field is known to do it, the test
    above hunts for one) is refused or dropped and counted; the listener's
    thread lives on and the next peer is served."""
    import pmetal.endpoint as endpoint
    real_welcome, real_finish, real_decode = (endpoint.server_welcome, endpoint.server_finish,
                                              endpoint.decode)
    cursed = NodeIdentity.generate()

    def welcome(identity: Any, ns: Any, hello: Hello, mode: int) -> Any:
        if hello.node_id == cursed.node_id and hello.nonce == b"boom" * 8:
            raise error("crafted field")
        return real_welcome(identity, ns, hello, mode)

    def finish(ns: Any, state: Any, confirm: Confirm, mode: int) -> Any:
        if state.hello.node_id == cursed.node_id:
            raise error("crafted confirm")
        return real_finish(ns, state, confirm, mode)

    def decode_(frames: Any, **kw: Any) -> Any:
        env = real_decode(frames, **kw)
        if env.body == Ping("boom"):
            raise error("crafted body")
        return env

    monkeypatch.setattr(endpoint, "server_welcome", welcome)
    monkeypatch.setattr(endpoint, "server_finish", finish)
    monkeypatch.setattr(endpoint, "decode", decode_)
    node = make_node()
    attacker = raw_dealer(zmq_context, node.address)
    hello = dataclasses.replace(client_hello(cursed, namespace).hello, nonce=b"boom" * 8)
    attacker.send_multipart(encode(hello))
    assert isinstance(recv_reply(attacker), Rejected)
    state = client_hello(cursed, namespace)   # its Confirm breaks the check
    attacker.send_multipart(encode(state.hello))
    welcome = recv_reply(attacker)
    assert isinstance(welcome, Welcome), welcome
    attacker.send_multipart(encode(client_finish(cursed, namespace, state, welcome,
                                                 state.hello.mode)[0]))
    assert isinstance(recv_reply(attacker), Rejected)
    insider = raw_dealer(zmq_context, node.address)
    session = raw_handshake(insider, NodeIdentity.generate(), namespace)
    insider.send_multipart(session.seal(encode(Ping("boom"), corr=1)))
    insider.send_multipart(session.seal(encode(Ping("fine"), corr=2)))
    refusal = decode(session.open(insider.recv_multipart()))
    assert refusal.corr == 1 and isinstance(refusal.body, ErrorReply), refusal
    assert "crafted body" in refusal.body.message
    assert decode(session.open(insider.recv_multipart())).body == Pong("fine")

    good = make_channel(node.address)
    for i in range(3):
        assert good.request(Ping(i), timeout=WAIT).body == Pong(i)
    assert node.server.error is None
    stats = node.listener.statistics()
    assert stats.refused_handshakes == 2 and stats.dropped_malformed >= 1
