"""The namespace handshake and sealed sessions, driven directly (no sockets).

Handshake messages travel through the real wire codec between the steps, as
they would between two processes."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pmetal.config import SecurityConfig, load_config
from pmetal.errors import (
    AuthenticationError,
    ConfigError,
    HandshakeError,
    ReplayError,
    SecurityError,
)
from pmetal.identity import NodeIdentity
from pmetal.security import (
    MIN_PSK_BYTES,
    Mode,
    NetworkNamespace,
    Session,
    client_finish,
    client_hello,
    mode_for,
    server_finish,
    server_welcome,
)
from pmetal.wire import (
    Ping,
    WireLimits,
    decode,
    encode,
    frame_bytes,
)

MODES = [Mode.CONTROL, Mode.FULL, Mode.ENCRYPTED]
MODE_IDS = ["control", "full", "encrypted"]
PSK = b"correct horse battery staple 42!"


def over_the_wire(msg: Any) -> Any:
    """A handshake message after encoding and decoding (unauthenticated path)."""
    return decode(encode(msg, sender="x")).body


def handshake(client_ns: NetworkNamespace, server_ns: NetworkNamespace | None = None, *,
              client_mode: int = Mode.FULL, server_mode: int = Mode.FULL
              ) -> tuple[Session, Session, NodeIdentity, NodeIdentity]:
    server_ns = server_ns or client_ns
    client_id, server_id = NodeIdentity.generate(), NodeIdentity.generate()
    state = client_hello(client_id, client_ns, client_mode)
    welcome, server_state = server_welcome(server_id, server_ns, over_the_wire(state.hello),
                                           server_mode)
    confirm, client_session = client_finish(client_id, client_ns, state,
                                            over_the_wire(welcome), client_mode)
    server_session = server_finish(server_ns, server_state, over_the_wire(confirm),
                                   server_mode)
    return client_session, server_session, client_id, server_id


@pytest.fixture
def ns() -> NetworkNamespace:
    return NetworkNamespace("lab", PSK)


def pair(ns: NetworkNamespace, mode: int) -> tuple[Session, Session]:
    client, server, _, _ = handshake(ns, client_mode=mode, server_mode=mode)
    return client, server


def as_bytes(frames: list[Any]) -> list[bytes]:
    return [bytes(frame_bytes(f)) for f in frames]


# ----------------------------------------------------------------- handshake

def test_handshake_gives_matching_sessions(ns: NetworkNamespace) -> None:
    client, server, client_id, server_id = handshake(ns)
    assert client.peer == server_id.node_id
    assert client.peer_public_key == server_id.public_key
    assert server.peer == client_id.node_id
    assert server.peer_public_key == client_id.public_key
    assert client.mode == server.mode == Mode.FULL


def test_each_handshake_makes_fresh_keys(ns: NetworkNamespace) -> None:
    a_client, a_server = pair(ns, Mode.FULL)
    _b_client, b_server = pair(ns, Mode.FULL)
    sealed = a_client.seal(encode(Ping("for a")))
    with pytest.raises(AuthenticationError):
        b_server.open(sealed)
    assert decode(a_server.open(sealed)).body == Ping("for a")


PAYLOADS: dict[str, Callable[[], Any]] = {
    "nothing": lambda: None,
    "small value": lambda: {"text": "hello", "n": [1, 2, 3]},
    "small array": lambda: np.arange(12, dtype=np.int32).reshape(3, 4),
    "16 KiB envelope": lambda: b"e" * (20 << 10),  # single frame, Poly1305 path
    "large array": lambda: np.random.default_rng(1).standard_normal(40_000),  # 320 kB
    "several arrays": lambda: [np.ones(5000, np.float32), np.zeros(0), np.arange(70_000,
                                                                                 dtype=np.uint8)],
    "chunked array": lambda: np.arange(300_000, dtype=np.int64),  # 2.4 MB in 1 MiB chunks
}


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_sessions_open_each_others_messages(ns: NetworkNamespace, mode: int,
                                            payload: Callable[[], Any]) -> None:
    client, server = pair(ns, mode)
    value = payload()
    for sender, receiver in ((client, server), (server, client), (client, server)):
        frames = encode(Ping(value), corr=7, term=3, sender=sender.peer)
        before = as_bytes(frames)
        sealed = sender.seal(frames)
        assert as_bytes(frames) == before, "seal() modified the caller's frames"
        env = decode(receiver.open(sealed), allow_pickle=True)
        assert env.corr == 7 and env.term == 3
        assert_same(value, env.body.payload)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_many_messages_in_order(ns: NetworkNamespace, mode: int) -> None:
    client, server = pair(ns, mode)
    for i in range(200):
        env = decode(server.open(client.seal(encode(Ping(i)))))
        assert env.body.payload == i
    assert client.statistics().sealed == 200
    assert server.statistics().opened == 200
    assert server.statistics().rejected == 0


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_statistics_count_bytes_in_every_mode(ns: NetworkNamespace, mode: int) -> None:
    client, server = pair(ns, mode)
    frames = encode(Ping(np.zeros(1000, np.uint8)))
    size = sum(len(frame_bytes(f)) for f in frames)
    server.open(client.seal(frames))
    assert client.statistics().bytes_sealed == size
    assert server.statistics().bytes_opened == size


def test_reflected_message_is_refused(ns: NetworkNamespace) -> None:
    """Each direction has its own key: a message cannot be bounced back."""
    client, _server = pair(ns, Mode.FULL)
    sealed = client.seal(encode(Ping("mine")))
    with pytest.raises(AuthenticationError):
        client.open(sealed)


def test_hello_with_another_psk_is_refused(ns: NetworkNamespace) -> None:
    other = NetworkNamespace(ns.name, b"another pre-shared key, wrong!!")
    with pytest.raises(HandshakeError):
        handshake(other, ns)
    with pytest.raises(HandshakeError):
        handshake(ns, other)


def test_client_refuses_a_server_that_only_knows_the_public_tag(ns: NetworkNamespace) -> None:
    """A server without the PSK that echoes the (public) tag still cannot
    produce the proof the client checks."""
    impostor_ns = NetworkNamespace(ns.name, b"impostor does not know the psk")
    client_id, impostor = NodeIdentity.generate(), NodeIdentity.generate()
    state = client_hello(client_id, ns)
    hello = dataclasses.replace(over_the_wire(state.hello), namespace_tag=impostor_ns.tag)
    welcome, _ = server_welcome(impostor, impostor_ns, hello)
    with pytest.raises(HandshakeError, match="PSK"):
        client_finish(client_id, ns, state, over_the_wire(welcome), Mode.FULL)


def test_server_refuses_a_client_that_only_knows_the_public_tag(ns: NetworkNamespace) -> None:
    """A client without the PSK gets past the tag check (the tag is public)
    but cannot prove the PSK: the server checks the Confirm against its own."""
    impostor_ns = NetworkNamespace(ns.name, b"impostor does not know the psk")
    impostor, server_id = NodeIdentity.generate(), NodeIdentity.generate()
    # Everything the impostor can compute: a full handshake in its own namespace...
    state = client_hello(impostor, impostor_ns)
    welcome, server_state = server_welcome(server_id, impostor_ns, state.hello)
    confirm, _ = client_finish(impostor, impostor_ns, state, welcome, Mode.FULL)
    # ...is refused by a server that checks with the real PSK.
    with pytest.raises(HandshakeError):
        server_finish(ns, server_state, confirm, Mode.FULL)


def test_confirm_from_another_handshake_is_refused(ns: NetworkNamespace) -> None:
    client_id, server_id = NodeIdentity.generate(), NodeIdentity.generate()
    first = client_hello(client_id, ns)
    w1, s1 = server_welcome(server_id, ns, first.hello)
    confirm1, _ = client_finish(client_id, ns, first, w1, Mode.FULL)
    second = client_hello(client_id, ns)
    _, s2 = server_welcome(server_id, ns, second.hello)
    with pytest.raises(HandshakeError):
        server_finish(ns, s2, confirm1, Mode.FULL)
    assert server_finish(ns, s1, confirm1, Mode.FULL).peer == client_id.node_id


def test_confirm_signed_by_another_key_is_refused(ns: NetworkNamespace) -> None:
    """Knowing the PSK is not enough to act as another node: the Confirm must
    be signed by the key the Hello announced."""
    victim, thief, server_id = (NodeIdentity.generate() for _ in range(3))
    state = client_hello(victim, ns)
    welcome, server_state = server_welcome(server_id, ns, state.hello)
    confirm, _ = client_finish(thief, ns, state, welcome, Mode.FULL)
    with pytest.raises(HandshakeError, match="signed"):
        server_finish(ns, server_state, confirm, Mode.FULL)


def test_welcome_signed_by_another_key_is_refused(ns: NetworkNamespace) -> None:
    client_id, server_id, other = (NodeIdentity.generate() for _ in range(3))
    state = client_hello(client_id, ns)
    welcome, _ = server_welcome(server_id, ns, state.hello)
    forged = dataclasses.replace(welcome, node_id=other.node_id, public_key=other.public_key)
    with pytest.raises(HandshakeError):
        client_finish(client_id, ns, state, forged, Mode.FULL)


def test_hello_whose_node_id_is_not_its_key_is_refused(ns: NetworkNamespace) -> None:
    client_id, server_id, other = (NodeIdentity.generate() for _ in range(3))
    hello = client_hello(client_id, ns).hello
    with pytest.raises(HandshakeError, match="node id"):
        server_welcome(server_id, ns, dataclasses.replace(hello, node_id=other.node_id))


def test_welcome_whose_node_id_is_not_its_key_is_refused(ns: NetworkNamespace) -> None:
    client_id, server_id, other = (NodeIdentity.generate() for _ in range(3))
    state = client_hello(client_id, ns)
    welcome, _ = server_welcome(server_id, ns, state.hello)
    with pytest.raises(HandshakeError, match="node id"):
        client_finish(client_id, ns, state,
                      dataclasses.replace(welcome, node_id=other.node_id), Mode.FULL)


@pytest.mark.parametrize("field,value", [
    ("public_key", b"\x01" * 31),
    ("ephemeral_key", b"\x01" * 33),
    ("nonce", b""),
    ("ephemeral_key", b"\x00" * 32),  # a low-order point: no shared secret
])
def test_malformed_hello_is_refused(ns: NetworkNamespace, field: str, value: bytes) -> None:
    client_id, server_id = NodeIdentity.generate(), NodeIdentity.generate()
    hello = client_hello(client_id, ns).hello
    with pytest.raises(HandshakeError):
        server_welcome(server_id, ns, dataclasses.replace(hello, **{field: value}))


def test_tampered_welcome_proof_is_refused(ns: NetworkNamespace) -> None:
    client_id, server_id = NodeIdentity.generate(), NodeIdentity.generate()
    state = client_hello(client_id, ns)
    welcome, _ = server_welcome(server_id, ns, state.hello)
    proof = bytearray(welcome.proof)
    proof[0] ^= 1
    with pytest.raises(HandshakeError):
        client_finish(client_id, ns, state,
                      dataclasses.replace(welcome, proof=bytes(proof)), Mode.FULL)


def test_handshake_errors_are_security_errors() -> None:
    assert issubclass(HandshakeError, SecurityError)
    assert issubclass(ReplayError, AuthenticationError)
    assert issubclass(AuthenticationError, SecurityError)


def test_handshake_messages_carry_no_secret(ns: NetworkNamespace) -> None:
    client_id, server_id = NodeIdentity.generate(), NodeIdentity.generate()
    state = client_hello(client_id, ns)
    welcome, _server_state = server_welcome(server_id, ns, state.hello)
    confirm, _ = client_finish(client_id, ns, state, welcome, Mode.FULL)
    wire = b"".join(b"".join(as_bytes(encode(m))) for m in (state.hello, welcome, confirm))
    assert PSK not in wire
    assert client_id.seed() not in wire and server_id.seed() not in wire


# --------------------------------------------------------------- namespace tag

def test_namespace_tag_depends_on_name_and_psk_and_hides_the_psk() -> None:
    a = NetworkNamespace("lab", PSK)
    assert a.tag == NetworkNamespace("lab", PSK).tag
    assert a.tag != NetworkNamespace("lab", PSK + b"!").tag
    assert a.tag != NetworkNamespace("lab2", PSK).tag
    assert a.tag != NetworkNamespace("home", PSK).tag
    assert len(a.tag) == 8
    assert PSK not in a.tag and a.tag not in PSK
    assert PSK.hex() not in a.tag.hex()


@pytest.mark.parametrize("psk", [b"", b"short", b"x" * (MIN_PSK_BYTES - 1)])
def test_short_psk_is_a_config_error(psk: bytes) -> None:
    with pytest.raises(ConfigError) as info:
        NetworkNamespace("lab", psk)
    assert isinstance(info.value, ValueError)
    if psk:
        assert psk.decode() not in str(info.value)


def test_psk_of_minimum_length_is_accepted() -> None:
    assert NetworkNamespace("lab", b"x" * MIN_PSK_BYTES).psk == b"x" * MIN_PSK_BYTES


def test_repr_and_str_never_show_the_psk() -> None:
    ns = NetworkNamespace("lab", b"super-secret-psk-value-123")
    for text in (repr(ns), str(ns), f"{ns}", f"{ns!r}", repr([ns]), repr({"ns": ns})):
        assert "super-secret" not in text
        assert b"super-secret-psk-value-123".hex() not in text
    assert "lab" in repr(ns)


def test_generated_namespaces_have_distinct_strong_psks() -> None:
    a, b = NetworkNamespace.generate(), NetworkNamespace.generate()
    assert a.psk != b.psk
    assert len(a.psk) >= 32
    assert a.tag != b.tag


def test_resolve_prefers_explicit_then_env_then_file(tmp_path: Path) -> None:
    key_file = tmp_path / "psk"
    key_file.write_bytes(b"psk-from-the-file-0123456789\n")
    cfg = load_config(env={}, security={"namespace": "lab", "psk_file": str(key_file)}).security
    env = {"PMETAL_PSK": "psk-from-the-environment-0123"}

    explicit = NetworkNamespace.resolve(cfg, psk="explicit-psk-0123456789", env=env)
    assert explicit.psk == b"explicit-psk-0123456789"
    assert explicit.name == "lab"
    assert NetworkNamespace.resolve(cfg, psk=b"explicit-bytes-0123456", env=env).psk == \
        b"explicit-bytes-0123456"
    assert NetworkNamespace.resolve(cfg, env=env).psk == b"psk-from-the-environment-0123"
    from_file = NetworkNamespace.resolve(cfg, env={})
    assert from_file.psk == b"psk-from-the-file-0123456789"  # trailing newline stripped
    # An empty PMETAL_PSK counts as unset.
    assert NetworkNamespace.resolve(cfg, env={"PMETAL_PSK": ""}).psk == from_file.psk


def test_resolve_expands_the_home_folder_in_psk_file(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cluster.psk").write_bytes(b"psk-in-the-home-folder-01234")
    cfg = SecurityConfig(psk_file="~/cluster.psk")
    assert NetworkNamespace.resolve(cfg, env={}).psk == b"psk-in-the-home-folder-01234"


def test_resolve_without_any_psk_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="PSK"):
        NetworkNamespace.resolve(SecurityConfig(), env={})


def test_resolve_with_missing_psk_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.psk"
    with pytest.raises(ConfigError) as info:
        NetworkNamespace.resolve(SecurityConfig(psk_file=str(missing)), env={})
    assert str(missing) in str(info.value)


def test_resolve_refuses_a_short_psk_from_any_source(tmp_path: Path) -> None:
    short = tmp_path / "short.psk"
    short.write_bytes(b"tiny\n")
    with pytest.raises(ConfigError):
        NetworkNamespace.resolve(SecurityConfig(psk_file=str(short)), env={})
    with pytest.raises(ConfigError):
        NetworkNamespace.resolve(SecurityConfig(), env={"PMETAL_PSK": "tiny"})


def test_mode_for_config() -> None:
    assert mode_for(SecurityConfig()) == Mode.FULL
    assert mode_for(SecurityConfig(bulk_auth=False)) == Mode.CONTROL
    assert mode_for(SecurityConfig(encrypt=True)) == Mode.ENCRYPTED
    assert mode_for(SecurityConfig(bulk_auth=False, encrypt=True)) == Mode.ENCRYPTED


# ----------------------------------------------------------------- tampering

def sample_message() -> list[Any]:
    """Envelope plus a 64 KiB buffer (Poly1305) and a small one."""
    big = np.arange(16 * 1024, dtype=np.float32)
    return encode(Ping([big, np.arange(7, dtype=np.int16)]), corr=1)


def flipped(frames: list[Any], frame: int, index: int) -> list[bytes]:
    out = as_bytes(frames)
    data = bytearray(out[frame])
    data[index] ^= 0x01
    out[frame] = bytes(data)
    return out


def positions(length: int) -> list[int]:
    """Every byte of a short frame; a spread of bytes of a long one."""
    if length <= 256:
        return list(range(length))
    picks = set(range(64)) | set(range(length - 64, length))
    picks |= set(range(0, length, max(1, length // 64)))
    return sorted(picks)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_any_flipped_bit_in_the_envelope_or_seal_is_refused(ns: NetworkNamespace,
                                                            mode: int) -> None:
    client, server = pair(ns, mode)
    for frames in (encode(Ping("small")), sample_message()):
        sealed = client.seal(frames)
        for i in positions(len(frame_bytes(sealed[0]))):
            with pytest.raises(AuthenticationError):
                server.open(flipped(sealed, 0, i))
        # Failed attempts did not move the replay window: the genuine one opens.
        decode(server.open(sealed))


@pytest.mark.parametrize("mode", [Mode.FULL, Mode.ENCRYPTED], ids=["full", "encrypted"])
def test_any_flipped_bit_in_a_buffer_is_refused(ns: NetworkNamespace, mode: int) -> None:
    client, server = pair(ns, mode)
    sealed = client.seal(sample_message())
    for frame in range(1, len(sealed)):
        for i in positions(len(frame_bytes(sealed[frame]))):
            with pytest.raises(AuthenticationError):
                server.open(flipped(sealed, frame, i))
    decode(server.open(sealed))


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_changed_frame_sizes_and_counts_are_refused(ns: NetworkNamespace, mode: int) -> None:
    client, server = pair(ns, mode)
    sealed = as_bytes(client.seal(sample_message()))
    variants = {
        "buffer truncated": [sealed[0], sealed[1][:-1], sealed[2]],
        "buffer extended": [sealed[0], sealed[1] + b"\0", sealed[2]],
        "envelope truncated": [sealed[0][1:], sealed[1], sealed[2]],
        "frame dropped": [sealed[0], sealed[1]],
        "frame added": [*sealed, b""],
        "frames swapped": [sealed[0], sealed[2], sealed[1]],
        "empty": [],
        "seal only": [sealed[0][-25:]],
        "seal missing": [sealed[0][:-25], sealed[1], sealed[2]],
        "tail only": [sealed[0][-9:]],
    }
    for name, frames in variants.items():
        with pytest.raises(AuthenticationError):
            server.open(frames)
            pytest.fail(f"{name} was accepted")
    decode(server.open(sealed))


def test_control_mode_authenticates_buffer_sizes_not_contents(ns: NetworkNamespace) -> None:
    client, server = pair(ns, Mode.CONTROL)
    sealed = client.seal(sample_message())
    # Contents of a buffer may change unnoticed (that is what the mode trades away)...
    opened = server.open(flipped(sealed, 1, 100))
    arrays = decode(opened).body.payload
    assert arrays[0].tobytes() != np.arange(16 * 1024, dtype=np.float32).tobytes()
    # ...but not their sizes, nor anything in the envelope.
    later = client.seal(sample_message())
    raw = as_bytes(later)
    with pytest.raises(AuthenticationError):
        server.open([raw[0], raw[1] + b"1234", raw[2]])
    with pytest.raises(AuthenticationError):
        server.open(flipped(later, 0, 3))
    decode(server.open(later))


# ------------------------------------------------------------------- replays

@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_replayed_message_is_refused(ns: NetworkNamespace, mode: int) -> None:
    client, server = pair(ns, mode)
    first = as_bytes(client.seal(encode(Ping(1))))
    second = as_bytes(client.seal(sample_message()))
    server.open(first)
    with pytest.raises(ReplayError):
        server.open(first)
    server.open(second)
    for old in (first, second):
        with pytest.raises(ReplayError):
            server.open(old)
    stats = server.statistics()
    assert stats.opened == 2 and stats.rejected == 3


def test_message_delayed_past_a_newer_one_is_refused(ns: NetworkNamespace) -> None:
    client, server = pair(ns, Mode.FULL)
    older = client.seal(encode(Ping("older")))
    newer = client.seal(encode(Ping("newer")))
    server.open(newer)
    with pytest.raises(ReplayError):
        server.open(older)


def test_replay_into_another_direction_or_session_is_refused(ns: NetworkNamespace) -> None:
    client, server = pair(ns, Mode.FULL)
    other_client, other_server = pair(ns, Mode.FULL)
    sealed = client.seal(encode(Ping("once")))
    for wrong in (client, other_server, other_client):
        with pytest.raises(AuthenticationError):
            wrong.open(sealed)
    server.open(sealed)


# --------------------------------------------------------------------- modes

@pytest.mark.parametrize("client_mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("server_mode", MODES, ids=MODE_IDS)
def test_handshake_settles_on_the_stricter_mode(ns: NetworkNamespace, client_mode: int,
                                                server_mode: int) -> None:
    client, server, _, _ = handshake(ns, client_mode=client_mode, server_mode=server_mode)
    assert client.mode == server.mode == max(client_mode, server_mode)
    decode(server.open(client.seal(sample_message())))
    decode(client.open(server.seal(sample_message())))


@pytest.mark.parametrize("side", ["hello", "welcome"])
def test_mode_downgrade_in_transit_is_detected(ns: NetworkNamespace, side: str) -> None:
    """The modes are part of the signed transcript: a man in the middle who
    lowers one (to read or alter bulk data) breaks the handshake."""
    # The side whose message is altered asks for encryption; the other for little.
    client_mode, server_mode = ((Mode.ENCRYPTED, Mode.CONTROL) if side == "hello"
                                else (Mode.CONTROL, Mode.ENCRYPTED))
    client_id, server_id = NodeIdentity.generate(), NodeIdentity.generate()
    state = client_hello(client_id, ns, client_mode)
    hello = state.hello
    if side == "hello":
        hello = dataclasses.replace(hello, mode=Mode.CONTROL)
    welcome, server_state = server_welcome(server_id, ns, hello, server_mode)
    if side == "welcome":
        welcome = dataclasses.replace(welcome, mode=Mode.CONTROL)
    with pytest.raises(HandshakeError):
        confirm, _ = client_finish(client_id, ns, state, welcome, client_mode)
        server_finish(ns, server_state, confirm, server_mode)


@pytest.mark.parametrize("mode", [0, 4, 255])
def test_unknown_mode_in_hello_is_refused(ns: NetworkNamespace, mode: int) -> None:
    hello = client_hello(NodeIdentity.generate(), ns).hello
    with pytest.raises(HandshakeError):
        server_welcome(NodeIdentity.generate(), ns, dataclasses.replace(hello, mode=mode))


@pytest.mark.parametrize("sender_mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("receiver_mode", MODES, ids=MODE_IDS)
def test_receiver_refuses_weaker_modes(ns: NetworkNamespace, sender_mode: int,
                                       receiver_mode: int) -> None:
    """Whatever was negotiated, a receiver refuses a message protected less
    than it requires (as if the sender had been configured differently)."""
    client, server, _, _ = handshake(ns, client_mode=sender_mode, server_mode=sender_mode)
    server.mode = receiver_mode
    for frames in (encode(Ping("small")), sample_message()):
        sealed = client.seal(frames)
        if sender_mode >= receiver_mode:
            decode(server.open(sealed))
        else:
            with pytest.raises(AuthenticationError, match="mode"):
                server.open(sealed)


@pytest.mark.parametrize("claimed", [0, 4, 7, 255])
def test_unknown_mode_byte_is_refused(ns: NetworkNamespace, claimed: int) -> None:
    client, server = pair(ns, Mode.CONTROL)
    raw = as_bytes(client.seal(encode(Ping("x"))))
    raw[0] = raw[0][:-1] + bytes([claimed])
    with pytest.raises(AuthenticationError):
        server.open(raw)


def test_encrypted_frames_do_not_contain_the_plaintext(ns: NetworkNamespace) -> None:
    client, server = pair(ns, Mode.ENCRYPTED)
    secret_text = "the launch code is 0000"
    secret_array = np.frombuffer(b"PLAINTEXT-ARRAY-MARKER" * 1000, dtype=np.uint8)
    frames = encode(Ping({"note": secret_text, "data": secret_array}))
    sealed = as_bytes(client.seal(frames))
    wire = b"".join(sealed)
    assert secret_text.encode() not in wire
    assert b"PLAINTEXT-ARRAY-MARKER" not in wire
    assert b"note" not in wire  # even the field names are hidden
    body = decode(server.open(sealed)).body
    assert body.payload["note"] == secret_text
    np.testing.assert_array_equal(body.payload["data"], secret_array)


def test_full_mode_does_not_encrypt(ns: NetworkNamespace) -> None:
    """Mode FULL authenticates but leaves data readable (documented trade-off)."""
    client, _ = pair(ns, Mode.FULL)
    wire = b"".join(as_bytes(client.seal(encode(Ping("visible text")))))
    assert b"visible text" in wire


# ----------------------------------------------------------------- streaming

def stream_message() -> list[Any]:
    """About 700 kB of buffers in 64 KiB chunks."""
    return encode(Ping(np.arange(90_000, dtype=np.float64)), corr=5,
                  limits=WireLimits(chunk_bytes=64 << 10))


def streamed_pair(ns: NetworkNamespace, mode: int) -> tuple[Session, Session]:
    client, server = pair(ns, mode)
    if not hasattr(client, "seal_parts"):
        pytest.skip("this Session has no streaming")
    client.stream_bytes = 128 << 10
    return client, server


def open_all(session: Session, parts: list[list[Any]]) -> list[Any] | None:
    result = None
    for i, part in enumerate(parts):
        result = session.open_part(part)
        if i < len(parts) - 1:
            assert result is None, "a streamed message completed early"
    return result


@pytest.mark.parametrize("mode", [Mode.CONTROL, Mode.FULL], ids=["control", "full"])
def test_streamed_message_round_trip(ns: NetworkNamespace, mode: int) -> None:
    client, server = streamed_pair(ns, mode)
    parts = client.seal_parts(stream_message())
    assert len(parts) > 2, "expected a head and several segments"
    opened = open_all(server, parts)
    assert opened is not None
    env = decode(opened)
    assert env.corr == 5
    np.testing.assert_array_equal(env.body.payload, np.arange(90_000, dtype=np.float64))
    # Plain messages still flow before and after.
    decode(server.open_part(client.seal_parts(encode(Ping("after")))[0]))


def test_streamed_message_with_a_flipped_bit_is_refused(ns: NetworkNamespace) -> None:
    client, _server = streamed_pair(ns, Mode.FULL)
    parts = [as_bytes(p) for p in client.seal_parts(stream_message())]
    for target in range(len(parts)):
        for frame in range(len(parts[target])):
            length = len(parts[target][frame])
            for i in (0, length // 2, length - 1):
                client2, server2 = streamed_pair(ns, Mode.FULL)
                sealed = [as_bytes(p) for p in client2.seal_parts(stream_message())]
                sealed[target] = flipped(sealed[target], frame, i)
                with pytest.raises(AuthenticationError):
                    open_all(server2, sealed)


def test_replayed_streamed_message_is_refused(ns: NetworkNamespace) -> None:
    client, server = streamed_pair(ns, Mode.FULL)
    parts = [as_bytes(p) for p in client.seal_parts(stream_message())]
    assert open_all(server, parts) is not None
    with pytest.raises(ReplayError):
        open_all(server, parts)


@pytest.mark.parametrize("how", ["segment dropped", "segments swapped", "segment repeated",
                                 "segment alone", "segment of another message"])
def test_streamed_message_out_of_order_is_refused(ns: NetworkNamespace, how: str) -> None:
    client, server = streamed_pair(ns, Mode.FULL)
    parts = [as_bytes(p) for p in client.seal_parts(stream_message())]
    other = [as_bytes(p) for p in client.seal_parts(stream_message())]
    head, segments = parts[0], parts[1:]
    broken = {
        "segment dropped": [head, *segments[1:]],
        "segments swapped": [head, segments[1], segments[0], *segments[2:]],
        "segment repeated": [head, segments[0], segments[0], *segments[1:]],
        "segment alone": [segments[0]],
        "segment of another message": [head, other[1], *segments[1:]],
    }[how]
    with pytest.raises(AuthenticationError):
        open_all(server, broken)
    # A later genuine message still gets through.
    assert open_all(server, other) is not None


def test_streamed_message_in_control_mode_authenticates_sizes(ns: NetworkNamespace) -> None:
    client, server = streamed_pair(ns, Mode.CONTROL)
    parts = [as_bytes(p) for p in client.seal_parts(stream_message())]
    parts[1][1] = parts[1][1] + b"\0"
    with pytest.raises(AuthenticationError):
        open_all(server, parts)


def test_streamed_message_is_refused_by_a_stricter_receiver(ns: NetworkNamespace) -> None:
    client, server = streamed_pair(ns, Mode.CONTROL)
    server.mode = Mode.FULL
    parts = client.seal_parts(stream_message())
    with pytest.raises(AuthenticationError):
        open_all(server, parts)


def test_unsealed_frames_are_refused(ns: NetworkNamespace) -> None:
    _, server = pair(ns, Mode.FULL)
    for frames in ([], [b""], [b"short"], encode(Ping("plain")), [os.urandom(100)],
                   [os.urandom(40), os.urandom(10)]):
        with pytest.raises(AuthenticationError):
            server.open(frames)
    assert server.statistics().rejected == 6


@pytest.mark.parametrize("frames", [[b"\x80"], [b"\x82" * 8], [b"\xc0" * 3, b"12345678"],
                                    [b"\x41"], [b"\x42" * 24]],
                         ids=["head flag, 1 byte", "head flag, 8 bytes", "head flag, 2 frames",
                              "segment flag, 1 byte", "segment flag, 24 bytes"])
def test_short_frames_with_stream_flags_are_refused_cleanly(ns: NetworkNamespace,
                                                            frames: list[bytes]) -> None:
    """Garbage whose last byte looks like a stream flag is an authentication
    failure like any other, never a crash of the receiver."""
    _, server = streamed_pair(ns, Mode.FULL)
    with pytest.raises(AuthenticationError):
        server.open_part(frames)
    assert server.statistics().rejected == 1
