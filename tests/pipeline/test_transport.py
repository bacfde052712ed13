"""Hops over real TCP links on loopback (a mesh formed by threads of this
process), the multiplexer's lanes, and a stage fed malformed hops."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from pmetal.links import tcplinks
from pmetal.links.tcplinks import P2P_BASE
from pmetal.errors import ProtocolError
from pmetal.pipeline.activations import ActivationCodec
from pmetal.pipeline.generation import StreamMultiplexer, _Sequence
from pmetal.pipeline.sampling import SamplingConfig
from pmetal.pipeline.transport import Entry, Hop, HopReceiver, HopSender

WAIT = 10.0


@pytest.fixture
def pair() -> Iterator[tuple[tcplinks.TcpLinks, tcplinks.TcpLinks]]:
    listeners = [tcplinks.listen("127.0.0.1", 0) for _ in range(2)]
    addresses = [("127.0.0.1", s.getsockname()[1]) for s in listeners]
    tag = tcplinks.group_tag("pipeline-test", 0, 1)
    out: dict[int, tcplinks.TcpLinks] = {}

    def form(rank: int) -> None:
        out[rank] = tcplinks.connect_mesh(rank, addresses, listeners[rank], key=b"k" * 32,
                                          tag=tag, epoch=1,
                                          deadline=time.monotonic() + WAIT)

    threads = [threading.Thread(target=form, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    for s in listeners:
        s.close()
    yield out[0], out[1]
    for links in out.values():
        links.close(timeout=1.0)


@pytest.mark.parametrize("codec", list(ActivationCodec))
def test_hops_cross_intact_with_every_codec(pair: tuple[tcplinks.TcpLinks, ...],
                                            codec: ActivationCodec) -> None:
    a, b = pair
    rng = np.random.default_rng(1)
    hidden = [rng.standard_normal((rows, 48)).astype(np.float32) for rows in (5, 1, 1)]
    logits = rng.standard_normal(300).astype(np.float32)
    hop = Hop([
        Entry(7, 0, activation=codec.encode(hidden[0], sequence_id=7, prefill=True),
              prefill=True, setup={"max_len": 64, "sampling": {"temperature": 0.5}}),
        Entry(8, 11, activation=codec.encode(hidden[1], sequence_id=8, position=11)),
        Entry(9, 3, tokens=(42,), logits=logits, end=True),
        Entry(10, 4, end=True),
        Entry(11, 2, error="stage 1 (layers 2-3): no room"),
        Entry(12, 20, activation=codec.encode(hidden[2], sequence_id=12, position=20)),
    ])
    sender, receiver = HopSender(a, 1), HopReceiver(b, 0)
    for _ in range(3):       # numbered in order, several in a row
        sender.send(hop)
    for _ in range(3):
        got = receiver.recv(time.monotonic() + WAIT)
        assert [e.sequence_id for e in got.entries] == [7, 8, 9, 10, 11, 12]
        for e, h in zip((got.entries[0], got.entries[1], got.entries[5]), hidden, strict=True):
            assert e.activation is not None
            assert np.array_equal(codec.decode(e.activation),
                                  codec.decode(codec.encode(h)))
        assert got.entries[0].prefill and got.entries[0].setup == hop.entries[0].setup
        assert got.entries[1].position == 11 and not got.entries[1].prefill
        assert got.entries[2].tokens == (42,) and got.entries[2].end
        assert np.array_equal(got.entries[2].logits, logits)
        assert got.entries[3].end and got.entries[3].activation is None
        assert got.entries[4].error == "stage 1 (layers 2-3): no room"
    assert receiver.bytes == sender.bytes > 0


def test_an_idle_link_times_out_and_stays_usable(pair: tuple[tcplinks.TcpLinks, ...]) -> None:
    a, b = pair
    receiver = HopReceiver(b, 0)
    with pytest.raises(TimeoutError):
        receiver.recv(time.monotonic() + 0.2)
    HopSender(a, 1).send(Hop([Entry(1, 0, tokens=(1, 2))]))
    assert receiver.recv(time.monotonic() + WAIT).entries[0].tokens == (1, 2)


@pytest.mark.parametrize("header", [
    b"\xc1garbage",
    msgpack.packb([99, [], 1]),
    msgpack.packb([1, []]),
    msgpack.packb([1, [], -1]),
    msgpack.packb([1, [[1, 2, 3]], 1]),
    msgpack.packb([1, [[-1, 0, [], None, False, False, None, False, None]], 1]),
    msgpack.packb([1, [[1, 0, [-5], None, False, False, None, False, None]], 1]),
    msgpack.packb([1, [[1, 0, [], "not bytes", False, False, None, False, None]], 1]),
    msgpack.packb([1, [[1, 0, [], None, 1, False, None, False, None]], 1]),
    msgpack.packb([1, [[1, 0, [], None, False, False, [1], False, None]], 1]),
    msgpack.packb([1, [[1, 0, [], None, False, False, None, False, 5]], 1]),
])
def test_malformed_hops_are_refused(pair: tuple[tcplinks.TcpLinks, ...],
                                    header: bytes) -> None:
    a, b = pair
    a.send(1, P2P_BASE + 1, 0, np.frombuffer(header, np.uint8))
    with pytest.raises(ProtocolError, match="pipeline hop from rank 0"):
        HopReceiver(b, 0).recv(time.monotonic() + WAIT)


def test_an_activation_that_lies_about_its_size_is_refused(
        pair: tuple[tcplinks.TcpLinks, ...]) -> None:
    a, b = pair
    message = ActivationCodec.NONE.encode(np.ones((2, 8), np.float32), sequence_id=3)
    head = bytes(message.to_frames()[0])
    header = msgpack.packb([1, [[3, 0, [], head, False, False, None, False, None]], 1])
    a.send(1, P2P_BASE + 1, 0, np.frombuffer(header, np.uint8))
    a.send(1, P2P_BASE + 1, 1, np.ones(5, np.float32))     # 2x8 promised
    with pytest.raises(ProtocolError, match="data frame"):
        HopReceiver(b, 0).recv(time.monotonic() + WAIT)


def test_a_sender_that_stops_mid_hop_times_out_after_rest(
        pair: tuple[tcplinks.TcpLinks, ...]) -> None:
    """A hop's header and then silence (a stage stopped mid-send): the
    receiver gives up ``rest`` seconds after the header."""
    a, b = pair
    message = ActivationCodec.NONE.encode(np.ones((1, 8), np.float32), sequence_id=3)
    header = msgpack.packb([1, [[3, 0, [], bytes(message.to_frames()[0]), False, False,
                                 None, False, None]], 1])
    a.send(1, P2P_BASE + 1, 0, np.frombuffer(header, np.uint8))     # no data part
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        HopReceiver(b, 0).recv(time.monotonic() + WAIT, rest=0.3)
    assert time.monotonic() - started < WAIT


def _seq(sid: int, prompt: int = 3, max_tokens: int = 5) -> _Sequence:
    return _Sequence(sid, list(range(1, prompt + 1)), SamplingConfig(max_tokens=max_tokens),
                     64, False, None)


def test_the_multiplexer_spreads_sequences_evenly_over_the_lanes() -> None:
    mux = StreamMultiplexer(lanes=2, max_in_flight=64)
    for sid in range(1, 6):
        mux.submit(_seq(sid))
    first = mux.next_hop(0, 0.0)
    second = mux.next_hop(1, 0.0)
    assert first is not None and second is not None
    assert [e.sequence_id for e in first.entries] == [1, 2, 3]
    assert [e.sequence_id for e in second.entries] == [4, 5]
    assert all(e.prefill and e.setup is not None for e in first.entries)
    # One sequence alone takes one lane; the other lane has nothing to send.
    lone = StreamMultiplexer(lanes=3, max_in_flight=64)
    lone.submit(_seq(1))
    assert lone.next_hop(0, 0.0) is not None
    assert lone.next_hop(1, 0.0) is None and lone.next_hop(2, 0.0) is None


def test_the_multiplexer_marks_last_steps_and_frees_finished_sequences() -> None:
    mux = StreamMultiplexer(lanes=1, max_in_flight=8)
    mux.submit(_seq(1, max_tokens=2))
    mux.submit(_seq(2, max_tokens=9))
    hop = mux.next_hop(0, 0.0)
    assert hop is not None
    mux.on_hop(0, Hop([Entry(1, 3, tokens=(50,)), Entry(2, 3, tokens=(60,))]), 0.1)
    hop = mux.next_hop(0, 0.2)
    assert hop is not None
    # Sequence 1's second token is its last: the stages drop it after the step.
    assert [(e.sequence_id, e.end, e.tokens) for e in hop.entries] == [(1, True, (50,)),
                                                                          (2, False, (60,))]
    # Sequence 2 is cancelled: its next hop carries an end-only entry.
    assert mux.cancel(2)
    mux.on_hop(0, Hop([Entry(1, 4, tokens=(51,), end=True), Entry(2, 4, tokens=(61,))]), 0.3)
    hop = mux.next_hop(0, 0.4)
    assert hop is not None and [(e.sequence_id, e.end, e.tokens) for e in hop.entries] == [
        (2, True, ())]
    assert not mux.pending()
    assert mux.sequences[1].finish == "length" and mux.sequences[1].tokens == [50, 51]
    assert mux.sequences[2].finish == "cancelled" and mux.sequences[2].tokens == [60]
