"""Strangers at a pipeline's ring while it forms (docs/security.md, "The
pipeline ring").

The driver's ``connect_mesh`` is wrapped so that, just before the driver
joins the ring, this process attacks the first stage's listening port: the
stages are by then listening and accepting (a stage dials the driver first,
so no stage's own connection can reach another stage before the attacks are
answered, which makes every answer deterministic). Each attack is a real
connection from this process over loopback; each is refused (or dropped)
by the stage's process, and the pipeline still forms and generates the
single-process tokens. Once formed, no stage listens any more.

A member's hop with settings the driver never sends fails its sequence
only, not the stage's serving thread.

The ring's hops are sealed by default: a relay in front of the driver's
port (every stage that dials the driver goes through it) reads no prompt.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import msgpack
import pytest

from pmetal.errors import AuthenticationError, CollectiveError
from pmetal.links import tcphandshake, tcplinks
from pmetal.pipeline.generation import generate_single_process
from pmetal.pipeline.llama import LlamaConfig, LlamaStage, LlamaWeights
from pmetal.pipeline.pipeline import Pipeline
from pmetal.pipeline.sampling import SamplingConfig
from pmetal.pipeline.stage import PipelineStageConfig, PipelineStageRuntime
from pmetal.pipeline.transport import Entry, Hop
from tests.links.relay import Relay

TINY = LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9] * 12]
MAX_LEN = 96
WAIT = 10.0
REFUSED = bytes(48)        # a refusal: 16 bytes (no nonce), a proof of zeros, then the reason


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the peer sends until it closes the connection (deadline)."""
    sock.settimeout(timeout)
    data = bytearray()
    while True:
        part = sock.recv(4096)
        if not part:
            return bytes(data)
        data += part


def attack(address: tuple[str, int], tag: bytes, psk_key: bytes) -> dict[str, Any]:
    """Every attack on a forming stage (rank 1, waiting for ranks 2 and 3);
    what each attacker saw."""
    seen: dict[str, Any] = {}
    deadline = time.monotonic() + WAIT
    # A connection that never says anything: the stage gives up on it
    # after its 2 s handshake read timeout and goes on accepting.
    silent = socket.create_connection(address, timeout=WAIT)
    seen["silent"] = silent
    # No PSK, and no idea of the pipeline's random tag.
    stranger_tag = tcplinks.group_tag("pipeline/guess", 0, 1)
    for name, key, claimed_tag, rank in (
            ("no psk, guessed tag", os.urandom(32), stranger_tag, 2),
            ("no psk, sniffed tag", os.urandom(32), tag, 2),
            ("psk, another pipeline's tag", psk_key, stranger_tag, 3),
            ("psk, a rank not expected", psk_key, tag, 0)):
        try:
            sock = tcphandshake.dial(address, rank, 1, key, claimed_tag, deadline)
        except (AuthenticationError, CollectiveError) as exc:
            seen[name] = exc
        else:
            sock.close()
            seen[name] = "accepted"
    # Garbage the size of a hello, and half a hello then nothing.
    garbage = socket.create_connection(address, timeout=WAIT)
    garbage.sendall(os.urandom(64))
    seen["garbage"] = read_until_closed(garbage, WAIT)
    garbage.close()
    half = socket.create_connection(address, timeout=WAIT)
    half.sendall(b"PMCOLL1\x00\x02\x00")
    half.shutdown(socket.SHUT_WR)
    seen["half hello"] = read_until_closed(half, WAIT)
    half.close()
    return seen


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    whole = LlamaStage(LlamaWeights.random(TINY, seed=3))
    return [r.tokens for r in generate_single_process(whole, PROMPTS,
                                                      SamplingConfig(max_tokens=12),
                                                      max_len=MAX_LEN)]


def test_strangers_at_a_forming_ring_are_refused_and_it_still_forms(
        cluster: Any, expected: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    real_connect_mesh = tcplinks.connect_mesh
    ring: list[tuple[str, int]] = []
    seen: dict[str, Any] = {}

    def attacked_connect_mesh(rank: int, addresses: Any, listener: Any, *, key: bytes,
                              tag: bytes, **options: Any) -> Any:
        assert rank == 0               # the driver's own formation
        ring.extend(tuple(a) for a in addresses)
        seen.update(attack(ring[1], tag, key))
        # Garbage at the driver's own port too, queued with the stages' dials.
        seen["driver garbage"] = socket.create_connection(ring[0], timeout=WAIT)
        seen["driver garbage"].sendall(os.urandom(64))
        return real_connect_mesh(rank, addresses, listener, key=key, tag=tag, **options)

    monkeypatch.setattr(tcplinks, "connect_mesh", attacked_connect_mesh)
    started = time.monotonic()
    pipe = Pipeline.from_pretrained(random_model=TINY, seed=3, stages=3, max_len=MAX_LEN,
                                    threads=1, connect_timeout=15.0)
    try:
        formed = time.monotonic() - started
        monkeypatch.undo()
        assert [r.tokens for r in pipe.generate(PROMPTS, max_tokens=12)] == expected
        # Every attacker was refused, and told why where it got that far.
        assert isinstance(seen["no psk, guessed tag"], AuthenticationError)
        assert "another group, or another formation" in str(seen["no psk, guessed tag"])
        # With the tag (it crosses in clear) but not the PSK: the stage's
        # proof does not verify, and it never gets to prove anything itself.
        assert isinstance(seen["no psk, sniffed tag"], AuthenticationError)
        assert "could not prove the namespace's PSK" in str(seen["no psk, sniffed tag"])
        assert "another group" in str(seen["psk, another pipeline's tag"])
        assert "it claims rank 0 dialling rank 1; this is rank 1 waiting for [2, 3]" in str(
            seen["psk, a rank not expected"])
        assert seen["garbage"].startswith(REFUSED)
        assert b"not a pmetal collective connection" in seen["garbage"]
        assert seen["half hello"] == b""        # dropped without a word
        # The silent connection was dropped by the stage, not held.
        assert read_until_closed(seen["silent"], WAIT) == b""
        seen["silent"].close()
        # Refused, or (the ring formed first) dropped unanswered or reset
        # with its unread bytes.
        try:
            answer = read_until_closed(seen["driver garbage"], WAIT)
        except ConnectionResetError:
            answer = b""
        assert answer == b"" or answer.startswith(REFUSED), answer
        seen["driver garbage"].close()
        assert formed < 15.0
        # Formed: no stage (nor the driver) listens any more.
        for host, port in ring:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((host, port), timeout=WAIT).close()
        assert pipe.generate(PROMPTS[:1], max_tokens=12)[0].tokens == expected[0]
    finally:
        pipe.close()


class _Fronted(socket.socket):
    """A listening socket that names another address (a relay's) as its own."""
    front: tuple[str, int] = ("", 0)

    def getsockname(self) -> Any:
        return self.front


def test_a_relay_on_the_ring_reads_no_prompt(cluster: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's listener is fronted by a relay: both stages that dial
    the driver (stage 0, which the prompt goes to, and the last stage,
    which sends back the tokens) connect through it. The prompt's token ids
    would cross as one run of bytes in a hop's header; the relay carries
    the whole generation and never sees that run."""
    prompt = list(range(101, 117))
    pattern = bytes(prompt)
    assert pattern in msgpack.packb([1, [[1, 0, prompt]]])    # how it would cross in clear
    relays: list[Relay] = []

    def fronted_listen(host: str, port: int = 0) -> socket.socket:
        sock = _Fronted(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, port))
        sock.listen(64)
        relays.append(Relay(socket.socket.getsockname(sock)))
        sock.front = relays[-1].address
        return sock

    monkeypatch.setattr(tcplinks, "listen", fronted_listen)
    whole = LlamaStage(LlamaWeights.random(TINY, seed=3))
    expected = generate_single_process(whole, [prompt], SamplingConfig(max_tokens=12),
                                       max_len=MAX_LEN)[0].tokens
    pipe = Pipeline.from_pretrained(random_model=TINY, seed=3, stages=2, max_len=MAX_LEN,
                                    threads=1, connect_timeout=15.0)
    try:
        monkeypatch.undo()
        assert pipe.generate([prompt], max_tokens=12)[0].tokens == expected
    finally:
        pipe.close()
        for relay in relays:
            relay.close()
    (relay,) = relays
    assert relay.connections == 2
    seen = bytes(relay.seen)
    assert len(seen) > 12 * 44            # every step's hops crossed it
    assert pattern not in seen and pattern[:8] not in seen


@pytest.mark.parametrize("setup", [
    {"max_len": 8, "sampling": {"bogus": 1}},
    {"max_len": 8, "sampling": {"stop_token_ids": 5}},
    {"max_len": 8, "sampling": {"seed": "x"}},
    {"max_len": 8, "stream": "x"},
    {"max_len": True},
    {"max_len": 8, "sampling": [1, 2]},
])
def test_a_members_bad_setup_fails_its_sequence_not_the_stage(setup: dict[str, Any]) -> None:
    """A hop's setup comes from the driver, a namespace member; settings the
    driver itself never sends (an unknown sampling key, a stop list that is
    not a list) fail that sequence with a reason, and the stage goes on
    serving the others. (Before: a TypeError escaped the serving thread and
    ended the stage.)"""
    runtime = PipelineStageRuntime(PipelineStageConfig(
        start=0, end=TINY.num_hidden_layers, index=0, num_stages=1,
        random_model=dict(TINY.__dict__), seed=3))
    good = Entry(2, 0, tokens=(1, 2, 3, 4), prefill=True, setup={"max_len": 8})
    out = runtime.step(Hop([Entry(1, 0, tokens=(1, 2), prefill=True, setup=setup), good]))
    bad, fine = out.entries
    assert bad.end and bad.error is not None and bad.error.startswith("stage 0 (layers 0-5)")
    assert fine.error is None and len(fine.tokens) == 1
    assert runtime.sequences == 1          # the good one's state only
