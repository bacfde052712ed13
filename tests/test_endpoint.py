"""SecureListener + Server + Channel over real ZeroMQ on loopback.

Attackers are raw ZeroMQ DEALER sockets that use no pmetal code beyond the
wire codec (and, where a test needs a peer that knows the PSK, the public
handshake functions)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import (
    WAIT,
    Recorder,
    SecureNode,
    as_bytes,
    error_text,
    listen_again,
    make_config,
    port_of,
    raw_dealer,
    raw_handshake,
    recv_reply,
    shm_objects,
)

from pmetal import shm
from pmetal.channel import MAX_EXPORTED
from pmetal.config import PMetalConfig
from pmetal.endpoint import Channel, Incoming, SecureListener
from pmetal.errors import (
    AuthenticationError,
    ClosedError,
    HandshakeError,
    PeerError,
    PMetalTimeoutError,
    ProtocolError,
    RequestTimeoutError,
)
from pmetal.identity import NodeIdentity
from pmetal.security import Mode, NetworkNamespace, client_hello
from pmetal.transport import ZmqTransport
from pmetal.wire import (
    Call,
    ErrorReply,
    Hello,
    Pickled,
    Ping,
    Pong,
    Rejected,
    Welcome,
    WireLimits,
    decode,
    encode,
)

MakeNode = Callable[..., SecureNode]
MakeChannel = Callable[..., Channel]


class RecordingDialer:
    """A real dialer that keeps a copy of every message sent through it, so
    a test can replay exactly what went over the wire."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent: list[list[bytes]] = []

    @property
    def address(self) -> str:
        return self.inner.address

    def send(self, frames: Any, timeout: float | None = None) -> None:
        self.sent.append(as_bytes(frames))
        self.inner.send(frames, timeout)

    def recv(self, timeout: float | None = None) -> Any:
        return self.inner.recv(timeout)

    async def asend(self, frames: Any, timeout: float | None = None) -> None:
        self.sent.append(as_bytes(frames))
        await self.inner.asend(frames, timeout)

    async def arecv(self, timeout: float | None = None) -> Any:
        return await self.inner.arecv(timeout)

    def close(self) -> None:
        self.inner.close()


def recv_body(frames: list[Any]) -> Any:
    return decode(frames).body


def recording_channel(ctx: zmq.Context, address: str, ns: NetworkNamespace,
                      cfg: PMetalConfig | None = None) -> tuple[Channel, RecordingDialer]:
    cfg = cfg or make_config()
    dialer = RecordingDialer(ZmqTransport(cfg.transport, ctx, curve=ns.curve_keys()).dial(address))
    return Channel(dialer, NodeIdentity.generate(), ns, cfg), dialer


# ------------------------------------------------------------ request, reply

def test_request_reply(make_node: MakeNode, make_channel: MakeChannel) -> None:
    node = make_node()
    channel = make_channel(node.address)
    assert channel.open() == node.identity.node_id
    assert channel.peer == node.identity.node_id
    reply = channel.request(Ping({"x": [1, 2, 3]}))
    assert reply.body == Pong({"x": [1, 2, 3]})
    assert reply.sender == node.identity.node_id
    assert node.handler.count == 1
    incoming = node.handler.calls[0]
    assert incoming.peer == channel.identity.node_id
    stats = node.listener.statistics()
    assert (stats.received, stats.sent, stats.sessions, stats.handshakes) == (1, 1, 1, 1)
    assert channel.statistics().replies == 1


def test_first_request_opens_the_channel_by_itself(make_node: MakeNode,
                                                   make_channel: MakeChannel) -> None:
    node = make_node()
    channel = make_channel(node.address)
    assert channel.request(Ping("no explicit open")).body == Pong("no explicit open")
    assert channel.statistics().handshakes == 1


def test_term_and_arrays_reach_the_handler(make_node: MakeNode,
                                           make_channel: MakeChannel) -> None:
    node = make_node()
    channel = make_channel(node.address)
    data = np.random.default_rng(0).standard_normal((64, 100)).astype(np.float32)
    reply = channel.request(Ping({"a": data}), term=9)
    assert node.handler.calls[0].envelope.term == 9
    np.testing.assert_array_equal(reply.body.payload["a"], data)


@pytest.mark.parametrize("path", ["socket", "shared memory"])
@pytest.mark.parametrize("security", [{"bulk_auth": False}, {}, {"encrypt": True}],
                         ids=["control", "full", "encrypted"])
def test_large_array_round_trip(make_node: MakeNode, make_channel: MakeChannel,
                                security: dict[str, Any], path: str) -> None:
    """20 MB each way: through the socket (chunked frames, streamed seals)
    or, between processes of one host, through shared memory."""
    transport: dict[str, Any] = {"request_timeout": 10.0}
    if path == "socket":
        transport["shm_min_bytes"] = 1 << 40
    cfg = make_config(security=security, **transport)
    node = make_node(cfg)
    channel = make_channel(node.address, cfg)
    before = shm_objects()
    data = np.arange(2_500_000, dtype=np.float64)
    reply = channel.request(Ping(data), timeout=10)
    np.testing.assert_array_equal(reply.body.payload, data)
    np.testing.assert_array_equal(node.handler.calls[0].body.payload, data)
    assert node.listener.statistics().dropped_auth_failures == 0
    # A channel keeps its request slots for reuse until it closes.
    channel.close()
    assert shm_objects() <= before, "shared-memory objects outlived the channel"


def test_one_way_send_reaches_the_handler(make_node: MakeNode, make_channel: MakeChannel
                                          ) -> None:
    node = make_node()
    channel = make_channel(node.address)
    channel.send(Ping("fire and forget"))
    assert node.handler.called.wait(WAIT)
    assert node.handler.payloads() == ["fire and forget"]
    assert node.handler.calls[0].envelope.corr == 0


def test_pipelined_requests_then_results_in_any_order(make_node: MakeNode,
                                                      make_channel: MakeChannel) -> None:
    node = make_node()
    channel = make_channel(node.address)
    channel.open()
    corrs = {channel.submit(Ping(i)): i for i in range(1000)}
    assert len(corrs) == 1000
    order = list(corrs)
    random.Random(7).shuffle(order)
    for corr in order:
        reply = channel.result(corr, timeout=WAIT)
        assert reply.corr == corr
        assert reply.body == Pong(corrs[corr])
    assert node.handler.payloads() == list(range(1000))  # served in order sent
    assert channel.statistics().pending == 0


def test_no_reply_means_request_timeout(make_node: MakeNode, make_channel: MakeChannel) -> None:
    node = make_node()
    node.handler.answer = lambda incoming: None
    channel = make_channel(node.address)
    channel.open()
    start = time.monotonic()
    with pytest.raises(RequestTimeoutError) as info:
        channel.request(Ping("unanswered"), timeout=0.3)
    assert isinstance(info.value, TimeoutError)
    assert 0.25 <= time.monotonic() - start < 2.0


def test_unsolicited_messages_are_kept_apart(make_node: MakeNode, make_channel: MakeChannel
                                             ) -> None:
    node = make_node()

    def push_then_answer(incoming: Incoming) -> Pong:
        node.listener.send(incoming.route, Pong("pushed"))
        return Pong("answer")

    node.handler.answer = push_then_answer
    channel = make_channel(node.address)
    assert channel.request(Ping("x")).body == Pong("answer")
    assert [env.body for env in channel.unsolicited] == [Pong("pushed")]


# --------------------------------------------------------------------- async

def test_async_open_and_requests(make_node: MakeNode, make_channel: MakeChannel) -> None:
    node = make_node()
    channel = make_channel(node.address)

    async def scenario() -> None:
        assert await channel.aopen() == node.identity.node_id
        reply = await channel.arequest(Ping("async"))
        assert reply.body == Pong("async")
        corrs = [await channel.asubmit(Ping(i)) for i in range(100)]
        for i, corr in reversed(list(enumerate(corrs))):
            assert (await channel.aresult(corr, timeout=WAIT)).body == Pong(i)
        await channel.asend(Ping("one way"))

    asyncio.run(asyncio.wait_for(scenario(), 20))
    assert node.handler.wait_count(102)
    assert node.handler.payloads()[-1] == "one way"


def test_coroutines_opening_one_channel_at_once_share_one_handshake(
        make_node: MakeNode, make_channel: MakeChannel) -> None:
    """Two handshakes on one connection would overwrite each other's state at
    the listener (one is then refused with "Confirm without a Hello"): the
    node daemon's status and actor construction both open worker channels."""
    node = make_node()
    channel = make_channel(node.address)

    async def scenario() -> list[Any]:
        opened = await asyncio.gather(channel.aopen(), channel.aopen(),
                                      channel.arequest(Ping("opens lazily")))
        return [*opened[:2], opened[2].body]

    peers_and_reply = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert peers_and_reply == [node.identity.node_id, node.identity.node_id,
                               Pong("opens lazily")]
    assert channel.statistics().handshakes == 1
    stats = node.listener.statistics()
    assert (stats.handshakes, stats.refused_handshakes) == (1, 0)


def test_concurrent_awaits_on_one_channel(make_node: MakeNode, make_channel: MakeChannel
                                          ) -> None:
    """Several coroutines waiting on one channel at once (as awaiting several
    ObjectRefs does) must each get their own reply, in whatever order the
    replies arrive relative to the awaits."""
    node = make_node()
    channel = make_channel(node.address)

    async def scenario() -> list[Any]:
        await channel.aopen()
        corrs = [await channel.asubmit(Ping(i)) for i in range(5)]
        # Await in the reverse order of the replies' arrival.
        results = await asyncio.gather(*(channel.aresult(c, timeout=1) for c in reversed(corrs)))
        return [r.body.payload for r in results]

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == [4, 3, 2, 1, 0]


# -------------------------------------------------------------------- errors

def failing_handler(incoming: Incoming) -> Pong:
    raise ValueError(f"cannot handle {incoming.body.payload!r}")


def test_handler_exception_comes_back_as_error_reply(make_node: MakeNode,
                                                     make_channel: MakeChannel) -> None:
    node = make_node()
    node.handler.answer = failing_handler
    channel = make_channel(node.address)
    reply = channel.request(Ping("bad input")).body
    assert isinstance(reply, ErrorReply)
    assert reply.error_type == "ValueError"
    assert reply.message == "cannot handle 'bad input'"
    assert "Traceback" in reply.traceback
    assert "failing_handler" in reply.traceback
    assert "ValueError: cannot handle 'bad input'" in reply.traceback
    # The server keeps serving.
    node.handler.answer = Recorder._echo
    assert channel.request(Ping("good")).body == Pong("good")
    assert node.server.error is None


@pytest.mark.parametrize("bad_answer", [lambda: Pong(object()), lambda: {"not": "a message"}],
                         ids=["unencodable payload", "not a message"])
def test_handler_answer_that_cannot_be_sent_does_not_kill_the_server(
        make_node: MakeNode, make_channel: MakeChannel, bad_answer: Callable[[], Any]) -> None:
    node = make_node()
    node.handler.answer = lambda incoming: (bad_answer() if incoming.body.payload == "bad"
                                            else Recorder._echo(incoming))
    channel = make_channel(node.address)
    try:
        reply: Any = channel.request(Ping("bad"), timeout=1).body
    except RequestTimeoutError:
        reply = None
    assert node.server.error is None, f"server thread died: {node.server.error!r}"
    assert channel.request(Ping("good")).body == Pong("good")
    assert isinstance(reply, ErrorReply), f"the caller got {reply!r} instead of an ErrorReply"


def test_slow_client_that_never_reads_cannot_kill_the_server(make_node: MakeNode,
                                                             make_channel: MakeChannel) -> None:
    """Replies to a client that stopped reading pile up until the send
    deadline passes: that client's replies may be lost, but the server must
    keep serving everyone else."""
    cfg = make_config(send_hwm=2, recv_hwm=2, send_timeout=0.2)
    node = make_node(cfg)
    big = bytes(4 << 20)  # bytes, not an array: it travels in the socket on any host
    requests = 12
    node.handler.answer = lambda incoming: Pong(big if incoming.body.payload == "big"
                                                else incoming.body.payload)
    slow = make_channel(node.address, cfg)
    slow.open()
    for _ in range(requests):
        slow.submit(Ping("big"))  # and never collect the results
    # Each reply that finds the queue full costs the server one send_timeout.
    deadline = time.monotonic() + requests * 0.2 + WAIT
    while not node.handler.wait_count(requests, timeout=0.1):
        assert node.server.error is None, f"server thread died: {node.server.error!r}"
        assert time.monotonic() < deadline, "server stopped serving"
    assert node.server.error is None
    other = make_channel(node.address, cfg)
    assert other.request(Ping("still serving"), timeout=WAIT).body == Pong("still serving")


def test_slow_consumer_gets_every_shared_memory_reply(make_node: MakeNode,
                                                      make_channel: MakeChannel) -> None:
    """More replies in shared memory than a listener tracks at once
    (MAX_EXPORTED), all unread until the last was sent: none is unlinked
    before its receiver maps it, so every result arrives."""
    cfg = make_config(shm_min_bytes=1024)
    node = make_node(cfg)
    node.handler.answer = lambda incoming: Pong(np.full(512, incoming.body.payload, np.float64))
    channel = make_channel(node.address, cfg)
    channel.open()
    count = MAX_EXPORTED + 200
    corrs = [channel.submit(Ping(i)) for i in range(count)]
    assert node.handler.wait_count(count, timeout=30)
    for i, corr in enumerate(corrs):
        payload = channel.result(corr).body.payload
        assert payload.shape == (512,) and payload[0] == i, f"reply {i} lost"
    assert channel.statistics().dropped == 0


def test_shared_memory_of_undelivered_arrays_is_freed(make_node: MakeNode,
                                                      make_channel: MakeChannel) -> None:
    """Arrays handed over through shared memory live in RAM (tmpfs) until
    the receiver maps them. Replies that a client never collects, and a
    request that never reached its server, must not stay there once the
    client and server are gone."""
    node = make_node()
    big = np.ones(1 << 20, np.float64)  # 8 MiB: above the shared-memory threshold
    node.handler.answer = lambda incoming: Pong(big)
    before = shm_objects()
    slow = make_channel(node.address)
    slow.open()
    for _ in range(3):
        slow.submit(Ping("never collected"))
    assert node.handler.wait_count(3)
    lost = make_channel(node.address)
    lost.open()
    node.stop()
    with pytest.raises(RequestTimeoutError):
        lost.request(Ping(big), timeout=0.3)
    slow.close()
    lost.close()
    leaked = shm_objects() - before
    for name in leaked:  # do not leave RAM behind for the next run
        shm.unlink("/" + name)
    assert not leaked, f"{len(leaked)} shared-memory objects leaked: {sorted(leaked)}"


# ----------------------------------------------------------------- admission

def test_wrong_psk_is_refused_at_open(make_node: MakeNode, make_channel: MakeChannel) -> None:
    """A stranger's transport keys (derived from its PSK) fail ZeroMQ's CURVE
    handshake: the listener never sees a byte of it, and the channel says
    why instead of timing out as if nobody listened."""
    node = make_node()
    intruder = make_channel(node.address, ns=NetworkNamespace(node.namespace.name,
                                                              b"not the cluster's psk"))
    with pytest.raises(HandshakeError, match="another namespace or has another PSK"):
        intruder.open()
    assert node.handler.count == 0
    assert not any(dataclasses.astuple(node.listener.statistics()))


def test_wrong_psk_behind_the_right_transport_keys_is_refused(
        make_node: MakeNode, zmq_context: zmq.Context) -> None:
    """pmetal's own handshake still checks the PSK when the transport's CURVE
    handshake passed (defence in depth: the two layers fail separately)."""
    node = make_node()
    cfg = make_config()
    dialer = ZmqTransport(cfg.transport, zmq_context,
                          curve=node.namespace.curve_keys()).dial(node.address)
    intruder = Channel(dialer, NodeIdentity.generate(),
                       NetworkNamespace(node.namespace.name, b"not the cluster's psk"), cfg)
    try:
        with pytest.raises(HandshakeError):
            intruder.open()
        with pytest.raises(HandshakeError):
            intruder.request(Ping("let me in"))
    finally:
        intruder.close()
    assert node.handler.count == 0
    stats = node.listener.statistics()
    assert stats.sessions == 0 and stats.handshakes == 0
    assert stats.refused_handshakes == 2


def test_other_namespace_name_is_refused(make_node: MakeNode, make_channel: MakeChannel
                                         ) -> None:
    node = make_node()
    channel = make_channel(node.address, ns=NetworkNamespace("elsewhere", node.namespace.psk))
    with pytest.raises(HandshakeError):
        channel.open()
    assert node.handler.count == 0


def test_peer_that_skips_the_handshake_gets_nothing_delivered(
        make_node: MakeNode, zmq_context: zmq.Context) -> None:
    node = make_node()
    raw = raw_dealer(zmq_context, node.address)
    raw.send_multipart(encode(Ping("no session"), corr=1))
    assert isinstance(recv_reply(raw), Rejected)
    raw.send_multipart(encode(Welcome("x" * 32, b"k" * 32, b"e" * 32, b"n" * 32, b"p", b"s")))
    assert isinstance(recv_reply(raw), Rejected)
    assert node.handler.count == 0
    stats = node.listener.statistics()
    assert stats.dropped_unauthenticated == 2
    assert stats.received == 0 and stats.sessions == 0


def test_pickled_payloads_only_on_authenticated_sessions(make_node: MakeNode,
                                                         make_channel: MakeChannel,
                                                         zmq_context: zmq.Context) -> None:
    node = make_node()

    def run_code(incoming: Incoming) -> Pong:
        payload = incoming.body.payload
        return Pong(payload.load()(21) if isinstance(payload, Pickled) else None)

    node.handler.answer = run_code
    code = Pickled.dumps(lambda x: x * 2)
    channel = make_channel(node.address)
    assert channel.request(Ping(code)).body == Pong(42)

    raw = raw_dealer(zmq_context, node.address)
    raw.send_multipart(encode(Ping(code), corr=1))
    assert isinstance(recv_reply(raw), Rejected)
    assert node.handler.count == 1
    assert node.listener.statistics().dropped_malformed == 1


def test_shared_memory_references_only_from_authenticated_local_peers(
        make_node: MakeNode, zmq_context: zmq.Context) -> None:
    """A message naming a shared-memory object is refused from a peer that
    is not authenticated, or that is authenticated but on another host: the
    node neither maps nor removes the object."""
    node = make_node()
    before = shm_objects()
    frames = as_bytes(encode(Ping(np.arange(1000, dtype=np.int64)), corr=1,
                             limits=WireLimits(shm_min_bytes=1), oob=shm.Exports()))
    created = shm_objects() - before
    assert len(created) == 1
    try:
        outsider = raw_dealer(zmq_context, node.address)
        outsider.send_multipart(frames)
        assert isinstance(recv_reply(outsider), Rejected)

        remote = raw_dealer(zmq_context, node.address)
        session = raw_handshake(remote, NodeIdentity.generate(), node.namespace,
                                host=b"another machine!")
        remote.send_multipart(session.seal(frames))
        remote.send_multipart(session.seal(encode(Ping("sync"), corr=2)))
        # The sealed request is refused in so many words, not silently.
        refusal = recv_body(session.open(remote.recv_multipart()))
        assert isinstance(refusal, ErrorReply) and refusal.error_type == "ProtocolError"
        assert "could not decode request 1" in refusal.message
        assert recv_body(session.open(remote.recv_multipart())) == Pong("sync")

        assert node.handler.payloads() == ["sync"]
        assert node.listener.statistics().dropped_malformed == 2
        assert created <= shm_objects(), "the node removed an object it was not given"
    finally:
        for name in created:
            shm.unlink("/" + name)


def test_captured_messages_cannot_be_replayed(make_node: MakeNode,
                                              zmq_context: zmq.Context) -> None:
    node = make_node()
    channel, tap = recording_channel(zmq_context, node.address, node.namespace)
    try:
        channel.open()
        assert channel.request(Ping("pay once")).body == Pong("pay once")
        hello, confirm, request = tap.sent

        # Replayed on the same connection (the session's route).
        tap.inner.send(request)
        assert channel.request(Ping("sync")).body == Pong("sync")  # in order: replay was seen
        assert node.handler.payloads() == ["pay once", "sync"]
        assert node.listener.statistics().dropped_auth_failures == 1

        # Replayed from another connection: no session there.
        raw = raw_dealer(zmq_context, node.address)
        raw.send_multipart(request)
        assert isinstance(recv_reply(raw), Rejected)

        # A recorded handshake does not open a session either: the server's
        # Welcome carries a fresh nonce, so the old Confirm no longer fits.
        raw.send_multipart(hello)
        assert isinstance(recv_reply(raw), Welcome)
        raw.send_multipart(confirm)
        assert isinstance(recv_reply(raw), Rejected)
        raw.send_multipart(request)
        assert isinstance(recv_reply(raw), Rejected)

        assert node.handler.payloads() == ["pay once", "sync"]
        stats = node.listener.statistics()
        assert stats.sessions == 1 and stats.refused_handshakes == 1
    finally:
        channel.close()


def test_tampered_message_is_dropped(make_node: MakeNode, zmq_context: zmq.Context) -> None:
    node = make_node()
    client = NodeIdentity.generate()
    raw = raw_dealer(zmq_context, node.address)
    session = raw_handshake(raw, client, node.namespace)
    for position in (0, 5, -20, -9, -1):
        sealed = as_bytes(session.seal(encode(Ping("transfer 10"), corr=1)))
        tampered = bytearray(sealed[0])
        tampered[position] ^= 0x04
        raw.send_multipart([bytes(tampered)])
    sealed = session.seal(encode(Ping("genuine"), corr=2))
    raw.send_multipart(sealed)
    reply = session.open(raw.recv_multipart())
    assert recv_body(reply) == Pong("genuine")
    assert node.handler.payloads() == ["genuine"]
    assert node.listener.statistics().dropped_auth_failures == 5


def test_route_takeover_cannot_inject(make_node: MakeNode, make_channel: MakeChannel,
                                      zmq_context: zmq.Context) -> None:
    """A socket that claims an authenticated peer's routing id is refused by
    the listener's socket (no ROUTER_HANDOVER): nothing it sends arrives,
    and the channel it imitates keeps working and gets every reply."""
    node = make_node()
    channel, tap = recording_channel(zmq_context, node.address, node.namespace)
    try:
        channel.open()
        assert channel.request(Ping("legit")).body == Pong("legit")
        hijacker = raw_dealer(zmq_context, node.address, routing_id=tap.inner.route,
                              RCVTIMEO=300)
        hijacker.send_multipart(encode(Ping("forged"), corr=5))
        hijacker.send_multipart(tap.sent[-1])  # and a replay, for good measure
        # Sync: a fresh authenticated peer is served after the hijacker's messages.
        witness = raw_dealer(zmq_context, node.address)
        session = raw_handshake(witness, NodeIdentity.generate(), node.namespace)
        witness.send_multipart(session.seal(encode(Ping("witness"), corr=1)))
        assert recv_body(session.open(witness.recv_multipart())) == Pong("witness")
        with pytest.raises(zmq.Again):
            hijacker.recv_multipart()
        assert channel.request(Ping("after")).body == Pong("after")
        stats = node.listener.statistics()
        assert stats.dropped_auth_failures == 0 and stats.dropped_unauthenticated == 0
        assert "forged" not in node.handler.payloads()
        assert node.handler.payloads().count("legit") == 1
        hijacker.close()
    finally:
        channel.close()


@pytest.mark.parametrize("client_security,server_security,mode", [
    ({"bulk_auth": False}, {}, Mode.FULL),
    ({}, {"bulk_auth": False}, Mode.FULL),
    ({"encrypt": True}, {}, Mode.ENCRYPTED),
    ({}, {"encrypt": True}, Mode.ENCRYPTED),
], ids=["weak client", "weak server", "encrypting client", "encrypting server"])
def test_both_sides_use_the_stricter_mode(make_node: MakeNode, make_channel: MakeChannel,
                                          client_security: dict[str, Any],
                                          server_security: dict[str, Any], mode: int) -> None:
    node = make_node(make_config(security=server_security))
    channel = make_channel(node.address, make_config(security=client_security))
    data = np.arange(10_000, dtype=np.float32)
    np.testing.assert_array_equal(channel.request(Ping(data)).body.payload, data)
    assert channel.session is not None and channel.session.mode == mode
    server_session = node.listener.session(node.handler.calls[0].route)
    assert server_session is not None and server_session.mode == mode
    assert node.listener.statistics().dropped_auth_failures == 0


def test_encrypted_node_accepts_an_encrypted_client(make_node: MakeNode,
                                                    make_channel: MakeChannel) -> None:
    cfg = make_config(security={"encrypt": True})
    node = make_node(cfg)
    channel = make_channel(node.address, cfg)
    assert channel.request(Ping("secret")).body == Pong("secret")
    assert channel.session is not None and channel.session.mode == Mode.ENCRYPTED


# ------------------------------------------------------ sessions and restarts

def test_channel_can_open_again_on_the_same_connection(make_node: MakeNode,
                                                       make_channel: MakeChannel) -> None:
    """open() twice (e.g. a retry after a handshake that timed out on our
    side but completed on the server's) must give a working session, not a
    Hello the listener drops because the route already has a session."""
    node = make_node()
    channel = make_channel(node.address)
    channel.open()
    assert channel.request(Ping(1)).body == Pong(1)
    try:
        channel.open(timeout=1.0)
    except RequestTimeoutError:
        pytest.fail(f"second open() timed out; listener statistics: "
                    f"{node.listener.statistics()}")
    assert channel.request(Ping(2)).body == Pong(2)


def test_hellos_that_never_confirm_cannot_keep_a_new_peer_out(
        make_node: MakeNode, make_channel: MakeChannel, zmq_context: zmq.Context) -> None:
    """Unconfirmed Hellos from many connections (a namespace member's flood)
    fill the pending handshakes; each new one evicts the oldest, so a real
    peer still gets in, and the pending table never holds more than its
    bound."""
    cfg = make_config(max_pending_handshakes=8)
    node = make_node(cfg)
    flooders = [raw_dealer(zmq_context, node.address) for _ in range(40)]
    for sock in flooders:
        sock.send_multipart(encode(client_hello(NodeIdentity.generate(),
                                                node.namespace).hello))
    for sock in flooders:
        assert isinstance(recv_reply(sock), Welcome)
    stats = node.listener.statistics()
    assert stats.pending_handshakes == 8 and stats.evicted_handshakes == 32
    assert make_channel(node.address, cfg).request(Ping("in")).body == Pong("in")
    assert node.listener.statistics().pending_handshakes <= 8
    for sock in flooders:
        sock.close()


def test_pending_handshakes_expire(make_node: MakeNode, make_channel: MakeChannel,
                                   zmq_context: zmq.Context) -> None:
    cfg = make_config(handshake_timeout=0.2)
    node = make_node(cfg)
    half_open = raw_dealer(zmq_context, node.address)
    half_open.send_multipart(encode(client_hello(NodeIdentity.generate(),
                                                 node.namespace).hello))
    assert isinstance(recv_reply(half_open), Welcome)
    assert node.listener.statistics().pending_handshakes == 1
    # Not a synchronisation: the handshake must age past its timeout, and
    # nothing happens when it does (expiry is checked at the next Hello).
    threading.Event().wait(0.3)
    # The next handshake sweeps the expired one.
    assert make_channel(node.address, cfg).request(Ping("in")).body == Pong("in")
    stats = node.listener.statistics()
    assert stats.pending_handshakes == 0 and stats.expired_handshakes == 1
    half_open.close()


def test_a_forgotten_session_fails_its_pending_requests_at_once(
        make_node: MakeNode, make_channel: MakeChannel) -> None:
    """A listener that forgets a session (more peers than max_sessions) tells
    its peer, whose pending request fails with PeerError at once instead of
    waiting for a reply that can no longer come."""
    cfg = make_config(max_sessions=2, request_timeout=30.0)
    node = make_node(cfg)
    node.handler.answer = lambda incoming: (None if incoming.body.payload == "no answer"
                                            else Recorder._echo(incoming))
    victim = make_channel(node.address, cfg)
    corr = victim.submit(Ping("no answer"))
    assert node.handler.wait_count(1)
    for _ in range(2):
        assert make_channel(node.address, cfg).request(Ping("x")).body == Pong("x")
    start = time.monotonic()
    with pytest.raises(PeerError, match="forgotten"):
        victim.result(corr, timeout=WAIT)
    assert time.monotonic() - start < WAIT
    assert victim.request(Ping("again")).body == Pong("again")   # re-handshakes


def test_a_connection_cannot_take_over_a_routing_id_in_use(
        make_node: MakeNode, zmq_context: zmq.Context) -> None:
    """A second connection that claims the routing id of a live session (it
    holds the namespace keys and learnt the id somehow) is refused by the
    listener's socket: it receives nothing, and the session keeps working
    with the peer that opened it."""
    node = make_node()
    route = os.urandom(16)
    victim = raw_dealer(zmq_context, node.address, routing_id=route)
    session = raw_handshake(victim, NodeIdentity.generate(), node.namespace)

    thief = raw_dealer(zmq_context, node.address, routing_id=route, RCVTIMEO=300)
    thief.send_multipart(encode(client_hello(NodeIdentity.generate(), node.namespace).hello))
    with pytest.raises(zmq.Again):
        thief.recv_multipart()
    assert node.listener.statistics().sessions == 1

    victim.send_multipart(session.seal(encode(Ping("still mine?"), corr=1)))
    assert recv_body(session.open(victim.recv_multipart())) == Pong("still mine?")
    thief.close()


def test_restarted_listener_costs_one_peer_error_then_rehandshakes(
        make_node: MakeNode, make_channel: MakeChannel) -> None:
    server_identity = NodeIdentity.generate()
    first = make_node(identity=server_identity)
    address = f"tcp://127.0.0.1:{port_of(first.address)}"
    channel = make_channel(address)
    assert channel.request(Ping("before")).body == Pong("before")
    first.stop()

    second = listen_again(lambda: make_node(address=address, identity=server_identity))
    outcomes: list[str] = []
    reply = None
    for _ in range(3):
        try:
            reply = channel.request(Ping("after"), timeout=2)
            outcomes.append("ok")
            break
        except PeerError as exc:
            assert "lost our session" in str(exc)
            outcomes.append("peer error")
        except RequestTimeoutError:
            # Only if the request raced the dialer noticing the old
            # connection die, and was lost with that connection.
            outcomes.append("timeout")
    assert outcomes in (["peer error", "ok"], ["timeout", "peer error", "ok"]), outcomes
    assert reply is not None and reply.body == Pong("after")
    assert channel.statistics().handshakes == 2
    assert second.handler.payloads() == ["after"]
    assert second.listener.statistics().handshakes == 1


def test_forgotten_session_rehandshakes(make_node: MakeNode, make_channel: MakeChannel) -> None:
    """Beyond max_sessions the least recently used session is forgotten; its
    peer gets one PeerError and then handshakes again."""
    cfg = make_config(max_sessions=2)
    node = make_node(cfg)
    a, b, c = (make_channel(node.address, cfg) for _ in range(3))
    for ch in (a, b, c):
        ch.open()
    assert node.listener.statistics().sessions == 2
    assert c.request(Ping("c")).body == Pong("c")
    with pytest.raises(PeerError):
        a.request(Ping("a"))
    assert a.request(Ping("a again")).body == Pong("a again")
    assert a.statistics().handshakes == 2
    assert "a" not in node.handler.payloads()


def test_server_stop_is_prompt_and_closes_the_listener(make_node: MakeNode,
                                                       make_channel: MakeChannel) -> None:
    node = make_node()
    channel = make_channel(node.address)
    channel.request(Ping("warm up"))
    start = time.monotonic()
    node.stop()
    assert time.monotonic() - start < 1.0
    assert node.server.error is None
    with pytest.raises(ClosedError):
        node.listener.recv(timeout=0.1)
    with pytest.raises(RequestTimeoutError):
        channel.request(Ping("anyone?"), timeout=0.3)


def test_server_stop_is_prompt_while_busy(make_node: MakeNode, make_channel: MakeChannel
                                          ) -> None:
    """stop() does not wait for a backlog of queued requests to be served."""
    node = make_node()
    release = threading.Event()
    node.handler.answer = lambda incoming: (release.wait(WAIT), Pong(None))[1]
    channel = make_channel(node.address)
    channel.open()
    for i in range(200):
        channel.submit(Ping(i))
    assert node.handler.called.wait(WAIT)
    stopper = threading.Thread(target=node.stop)
    start = time.monotonic()
    stopper.start()
    release.set()
    stopper.join(WAIT)
    assert not stopper.is_alive()
    assert time.monotonic() - start < 2.0
    assert node.handler.count < 200


def test_async_listener_serves_a_channel(make_channel: MakeChannel, zmq_context: zmq.Context,
                                         namespace: NetworkNamespace) -> None:
    """SecureListener.arecv/areply, the asyncio face of the server side."""
    cfg = make_config()
    transport = ZmqTransport(cfg.transport, zmq_context, curve=namespace.curve_keys())
    listener = SecureListener(transport.listen("tcp://127.0.0.1:0"), NodeIdentity.generate(),
                              namespace, cfg)
    channel = make_channel(listener.address)
    answered = threading.Event()

    async def serve() -> None:
        for _ in range(3):
            incoming = await listener.arecv(timeout=WAIT)
            await listener.areply(incoming, Pong(incoming.body.payload))
        answered.set()

    def client() -> list[Any]:
        return [channel.request(Ping(i), timeout=WAIT).body.payload for i in range(3)]

    async def scenario() -> list[Any]:
        server = asyncio.ensure_future(serve())
        replies = await asyncio.to_thread(client)
        await asyncio.wait_for(server, WAIT)
        return replies

    try:
        assert asyncio.run(scenario()) == [0, 1, 2]
        assert answered.is_set()
    finally:
        listener.close()


def test_repeated_hellos_without_confirm_admit_nobody(make_node: MakeNode,
                                                      zmq_context: zmq.Context) -> None:
    """An outsider can make the node answer Hellos (the tag is public), but
    without the PSK that never becomes a session."""
    node = make_node()
    raw = raw_dealer(zmq_context, node.address)
    intruder = NodeIdentity.generate()
    for _ in range(20):
        hello = Hello(intruder.node_id, intruder.public_key, bytes(range(32)), bytes(32),
                      node.namespace.tag)
        raw.send_multipart(encode(hello))
        assert isinstance(recv_reply(raw), Welcome)
    assert node.handler.count == 0
    assert node.listener.statistics().sessions == 0


def test_timeouts_are_builtin_timeouts() -> None:
    assert issubclass(RequestTimeoutError, PMetalTimeoutError)
    assert issubclass(RequestTimeoutError, TimeoutError)


def test_raw_handshake_helper_matches_channel(make_node: MakeNode,
                                              zmq_context: zmq.Context) -> None:
    """The hand-rolled client used by the attack tests is a faithful client."""
    node = make_node()
    raw = raw_dealer(zmq_context, node.address)
    session = raw_handshake(raw, NodeIdentity.generate(), node.namespace)
    raw.send_multipart(session.seal(encode(Ping("raw"), corr=3)))
    reply = session.open(raw.recv_multipart())
    assert recv_body(reply) == Pong("raw"), error_text(recv_body(reply))


def test_a_request_the_listener_cannot_decode_fails_at_once(make_node: MakeNode,
                                                            make_channel: MakeChannel) -> None:
    """A sealed request whose body does not decode (a field of the wrong
    type: what a peer of another protocol version sends) is answered with
    ProtocolError naming the request, not left to the request timeout; the
    session serves on."""
    node = make_node()
    channel = make_channel(node.address)
    started = time.monotonic()
    with pytest.raises(ProtocolError, match=r"could not decode request \d+: Call: .*same pmetal"):
        channel.request(Call(5, "method", [], {}), timeout=30)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5, "the refusal waited for a timeout"
    corr = channel.submit(Call("a", 7, [], {}))  # type: ignore[arg-type]
    assert channel.request(Ping("after")).body == Pong("after")
    with pytest.raises(ProtocolError):
        channel.result(corr, timeout=5)
    assert node.handler.payloads() == ["after"]
    assert node.listener.statistics().refused_requests == 2
    assert node.server.error is None
