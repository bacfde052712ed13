"""The node key pair on disk: creation, permissions, corruption, signatures."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from pmetal.config import SecurityConfig
from pmetal.errors import ConfigError, IdentityError, PMetalError
from pmetal.security import NetworkNamespace
from pmetal.identity import KEYPAIR_FILE, NodeIdentity, node_id_for, verify_signature


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write_key_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)


def raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


# ------------------------------------------------------------ load_or_create

def test_first_call_creates_a_private_key_file(tmp_path: Path) -> None:
    home = tmp_path / "nested" / "pmetal"
    ident = NodeIdentity.load_or_create(home)
    path = home / KEYPAIR_FILE
    assert ident.path == path
    assert path.is_file()
    assert mode_of(path) == 0o600
    assert mode_of(home) == 0o700
    data = path.read_bytes()
    assert len(data) == 64
    assert data[32:] == ident.public_key
    assert data[:32] == ident.seed()
    # No temporary files are left behind.
    assert sorted(p.name for p in home.iterdir()) == [KEYPAIR_FILE]


def test_second_call_returns_the_same_identity(tmp_path: Path) -> None:
    first = NodeIdentity.load_or_create(tmp_path)
    before = (tmp_path / KEYPAIR_FILE).read_bytes()
    second = NodeIdentity.load_or_create(tmp_path)
    assert second.node_id == first.node_id
    assert second.public_key == first.public_key
    assert (tmp_path / KEYPAIR_FILE).read_bytes() == before


def test_different_homes_have_different_identities(tmp_path: Path) -> None:
    a = NodeIdentity.load_or_create(tmp_path / "a")
    b = NodeIdentity.load_or_create(tmp_path / "b")
    assert a.node_id != b.node_id


def test_pmetal_home_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "from-env"
    monkeypatch.setenv("PMETAL_HOME", str(home))
    ident = NodeIdentity.load_or_create()
    assert ident.path == home / KEYPAIR_FILE
    assert (home / KEYPAIR_FILE).is_file()
    assert NodeIdentity.load_or_create().node_id == ident.node_id
    # An explicit folder wins over the environment.
    other = NodeIdentity.load_or_create(tmp_path / "explicit")
    assert other.node_id != ident.node_id


def test_concurrent_first_calls_agree_on_one_identity(tmp_path: Path) -> None:
    """Several processes (here threads) starting at once on a fresh machine
    must end up with one key, not one each."""
    home = tmp_path / "race"
    workers = 8
    barrier = threading.Barrier(workers, timeout=10)
    results: list[str | IdentityError] = []
    lock = threading.Lock()

    def run() -> None:
        barrier.wait()
        try:
            result: str | IdentityError = NodeIdentity.load_or_create(home).node_id
        except IdentityError as exc:
            result = exc
        with lock:
            results.append(result)

    threads = [threading.Thread(target=run) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == workers
    assert len(set(results)) == 1, results
    assert NodeIdentity.load_or_create(home).node_id == results[0]


# ------------------------------------------------------------------ bad files

@pytest.mark.parametrize("size", [0, 1, 32, 63, 65, 128])
def test_truncated_or_oversized_file_is_an_error_naming_the_file(tmp_path: Path,
                                                                  size: int) -> None:
    path = tmp_path / KEYPAIR_FILE
    data = os.urandom(size)
    write_key_file(path, data)
    with pytest.raises(IdentityError) as info:
        NodeIdentity.load_or_create(tmp_path)
    assert str(path) in str(info.value)
    assert "corrupt" in str(info.value)
    assert path.read_bytes() == data  # left alone for inspection, never overwritten


def test_truncated_copy_of_a_real_key_is_an_error(tmp_path: Path) -> None:
    NodeIdentity.load_or_create(tmp_path)
    path = tmp_path / KEYPAIR_FILE
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(IdentityError, match="corrupt") as info:
        NodeIdentity.load_or_create(tmp_path)
    assert str(path) in str(info.value)


def test_public_half_that_does_not_match_is_an_error(tmp_path: Path) -> None:
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    seed = NodeIdentity(key).seed()
    path = tmp_path / KEYPAIR_FILE
    write_key_file(path, seed + raw_public(other))
    with pytest.raises(IdentityError) as info:
        NodeIdentity.load_or_create(tmp_path)
    assert str(path) in str(info.value)
    assert "public half" in str(info.value)


def test_flipped_bit_in_the_seed_is_an_error(tmp_path: Path) -> None:
    NodeIdentity.load_or_create(tmp_path)
    path = tmp_path / KEYPAIR_FILE
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IdentityError) as info:
        NodeIdentity.load_or_create(tmp_path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_file_readable_by_others_is_an_error_mentioning_chmod(tmp_path: Path,
                                                               mode: int) -> None:
    NodeIdentity.load_or_create(tmp_path)
    path = tmp_path / KEYPAIR_FILE
    path.chmod(mode)
    with pytest.raises(IdentityError) as info:
        NodeIdentity.load_or_create(tmp_path)
    message = str(info.value)
    assert "chmod" in message
    assert str(path) in message
    assert f"{mode:04o}" in message


def test_owner_only_modes_are_accepted(tmp_path: Path) -> None:
    ident = NodeIdentity.load_or_create(tmp_path)
    (tmp_path / KEYPAIR_FILE).chmod(0o400)
    assert NodeIdentity.load_or_create(tmp_path).node_id == ident.node_id


def test_a_directory_in_place_of_the_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / KEYPAIR_FILE).mkdir(mode=0o700)
    with pytest.raises(IdentityError) as info:
        NodeIdentity.load_or_create(tmp_path)
    assert str(tmp_path / KEYPAIR_FILE) in str(info.value)


def test_identity_error_is_a_pmetal_error() -> None:
    assert issubclass(IdentityError, PMetalError)


# --------------------------------------------------------------- node id, keys

def test_node_id_is_32_hex_chars_derived_from_the_public_key(tmp_path: Path) -> None:
    ident = NodeIdentity.load_or_create(tmp_path)
    assert len(ident.node_id) == 32
    assert all(c in "0123456789abcdef" for c in ident.node_id)
    assert ident.node_id == hashlib.sha256(ident.public_key).hexdigest()[:32]
    assert node_id_for(ident.public_key) == ident.node_id
    assert len(ident.public_key) == 32


def test_generated_identities_are_distinct_and_not_saved() -> None:
    a, b = NodeIdentity.generate(), NodeIdentity.generate()
    assert a.node_id != b.node_id
    assert a.path is None
    assert a.node_id in repr(a)
    assert a.seed().hex() not in repr(a)


def test_sign_and_verify() -> None:
    ident, other = NodeIdentity.generate(), NodeIdentity.generate()
    data = b"the transcript of a handshake"
    sig = ident.sign(data)
    assert len(sig) == 64
    assert verify_signature(ident.public_key, sig, data)
    assert not verify_signature(ident.public_key, sig, data + b"!")
    assert not verify_signature(ident.public_key, sig, b"X" + data[1:])
    assert not verify_signature(other.public_key, sig, data)
    tampered = bytearray(sig)
    tampered[10] ^= 0x80
    assert not verify_signature(ident.public_key, bytes(tampered), data)
    assert not verify_signature(ident.public_key, sig[:63], data)
    assert not verify_signature(ident.public_key, b"", data)


@pytest.mark.parametrize("bad_key", [b"", b"short", b"\x00" * 31, b"\x00" * 33])
def test_verify_with_a_malformed_key_is_false_not_an_exception(bad_key: bytes) -> None:
    ident = NodeIdentity.generate()
    assert verify_signature(bad_key, ident.sign(b"data"), b"data") is False


def test_loaded_identity_signs_like_the_one_that_created_it(tmp_path: Path) -> None:
    created = NodeIdentity.load_or_create(tmp_path)
    loaded = NodeIdentity.load_or_create(tmp_path)
    sig = loaded.sign(b"payload")
    assert verify_signature(created.public_key, sig, b"payload")


# ------------------------------------------ files another user could plant

OTHER_UID = 65534   # "nobody"
as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="giving a file to another user needs root")


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777], ids=["world", "group", "sticky"])
def test_home_writable_by_others_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    home = tmp_path / "home"
    NodeIdentity.load_or_create(home)
    home.chmod(mode)
    with pytest.raises(IdentityError, match=rf"chmod go-w {home}"):
        NodeIdentity.load_or_create(home)


def test_key_file_writable_by_others_is_refused(tmp_path: Path) -> None:
    path = NodeIdentity.load_or_create(tmp_path).path
    assert path is not None
    path.chmod(0o622)
    with pytest.raises(IdentityError, match=rf"chmod 600 {path}"):
        NodeIdentity.load_or_create(tmp_path)


@as_root
def test_key_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = NodeIdentity.load_or_create(tmp_path).path
    assert path is not None
    os.chown(path, OTHER_UID, -1)
    with pytest.raises(IdentityError, match=rf"belongs to user .*chown \w+ {path}"):
        NodeIdentity.load_or_create(tmp_path)


@as_root
def test_home_of_another_user_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    NodeIdentity.load_or_create(home)
    os.chown(home, OTHER_UID, -1)
    with pytest.raises(IdentityError, match="belongs to user"):
        NodeIdentity.load_or_create(home)


def _psk_file(folder: Path) -> Path:
    path = folder / "psk"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    path.chmod(0o600)
    return path


def test_psk_file_writable_by_others_is_refused(tmp_path: Path) -> None:
    path = _psk_file(tmp_path)
    cfg = SecurityConfig(psk_file=str(path))
    assert NetworkNamespace.resolve(cfg, env={}).psk.startswith(b"0123")
    path.chmod(0o666)
    with pytest.raises(ConfigError, match=rf"chmod go-w {path}"):
        NetworkNamespace.resolve(cfg, env={})


@as_root
def test_psk_file_of_another_user_is_refused(tmp_path: Path) -> None:
    """A PSK planted by another local user would let that user run code as
    this node's user: refused, as ssh refuses such a key."""
    path = _psk_file(tmp_path)
    os.chown(path, OTHER_UID, -1)
    with pytest.raises(ConfigError, match=rf"belongs to user .*chown \w+ {path}"):
        NetworkNamespace.resolve(SecurityConfig(psk_file=str(path)), env={})


def test_node_record_writable_by_others_is_refused(tmp_path: Path) -> None:
    from pmetal.node.daemon import node_file
    from pmetal.cli.daemon import _read_node_file
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    record = node_file(home)
    record.write_text('{"pid": 1, "address": "tcp://127.0.0.1:1"}\n')
    record.chmod(0o600)
    assert _read_node_file(home) is not None
    record.chmod(0o646)
    with pytest.raises(ConfigError, match=rf"chmod go-w {record}"):
        _read_node_file(home)
