"""Namespace security: the PSK, the handshake, and the sessions it opens.

Trust boundary: the pre-shared key (PSK) of a namespace. Anyone who lacks it
can neither join, nor run code, nor read (when encryption is on) or forge
messages. See docs/security.md for the threat model.

Handshake (client C dials server S; all three messages unauthenticated)::

    C -> S  Hello(id_C, pk_C, eph_C, nonce_C, tag)
    S -> C  Welcome(id_S, pk_S, eph_S, nonce_S, proof_S, sig_S)
    C -> S  Confirm(proof_C, sig_C)
    S -> C  Accepted(id_S)                      <- the first sealed message

    th      = SHA-256("pmetal-hs-1" | namespace | Hello fields | id_S pk_S eph_S nonce_S)
    proof_S = HMAC-SHA256(PSK, "server" | th)        sig_S = Ed25519_S("server" | th)
    th2     = SHA-256(th | proof_S | sig_S)
    proof_C = HMAC-SHA256(PSK, "client" | th2)       sig_C = Ed25519_C("client" | th2)
    keys    = HKDF-SHA256(PSK | X25519(eph_C, eph_S), salt=th2) -> k_C->S, k_S->C

Each side proves the PSK over both nonces and both public keys and signs the
transcript with its identity key; the ephemeral X25519 exchange gives forward
secrecy. ``id`` must be the hash of ``pk`` (identity.node_id_for).

The handshake's keys open a :class:`~pmetal.session.Session` (its sealed
frames and modes: :mod:`pmetal.session`); ``Mode``, ``Session`` and
``SessionStatistics`` stay importable from here.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import (X25519PrivateKey,
                                                              X25519PublicKey)
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from pmetal.config import SecurityConfig
from pmetal.errors import ConfigError, HandshakeError
from pmetal.identity import NodeIdentity, check_private_file, node_id_for, verify_signature
from pmetal import shm
from pmetal.ids import NodeId
from pmetal.transport import CurveKeys
from pmetal.session import Mode, Session, SessionStatistics
from pmetal.wire import Confirm, Hello, Welcome

log = logging.getLogger(__name__)

__all__ = [
    "MIN_PSK_BYTES",
    "Mode",
    "NetworkNamespace",
    "Session",
    "SessionStatistics",
    "client_finish",
    "client_hello",
    "mode_for",
    "server_finish",
    "server_welcome",
]

MIN_PSK_BYTES = 16
_HS_LABEL = b"pmetal-hs-1"


def mode_for(cfg: SecurityConfig) -> int:
    if cfg.encrypt:
        return Mode.ENCRYPTED
    return Mode.FULL if cfg.bulk_auth else Mode.CONTROL


@dataclass(frozen=True)
class NetworkNamespace:
    """A cluster: a name plus the pre-shared key that admits its members."""

    name: str
    psk: bytes

    def __post_init__(self) -> None:
        if len(self.psk) < MIN_PSK_BYTES:
            raise ConfigError(
                f"the PSK of namespace {self.name!r} has {len(self.psk)} bytes; it needs at "
                f"least {MIN_PSK_BYTES} (generate one with 'pmetal keygen')")

    def __repr__(self) -> str:  # never print the key
        return f"NetworkNamespace({self.name!r}, tag={self.tag.hex()})"

    @property
    def tag(self) -> bytes:
        """Public 8-byte tag for discovery: derived from name and PSK, reveals neither."""
        return hashlib.blake2b(self.name.encode(), key=self.psk, digest_size=8,
                               person=b"pmetal-ns-tag").digest()

    def curve_keys(self) -> CurveKeys:
        """The namespace's ZMTP CURVE keys, derived from name and PSK.

        Every member's listener is a CURVE server with one server key pair
        and every dialer a CURVE client with one client key pair, so only a
        PSK holder gets through libzmq's handshake (see pmetal.transport).
        The keys identify the namespace, not a node: pmetal's own handshake
        on top proves each node's identity."""
        return _curve_keys(self.name, self.psk)

    @classmethod
    def generate(cls, name: str = "local") -> NetworkNamespace:
        """A namespace with a fresh random PSK (an embedded local cluster)."""
        return cls(name, os.urandom(32).hex().encode())

    @classmethod
    def resolve(cls, cfg: SecurityConfig, psk: str | bytes | None = None,
                env: Mapping[str, str] | None = None) -> NetworkNamespace:
        """The namespace from an explicit ``psk``, else ``PMETAL_PSK``, else
        ``cfg.psk_file``. Raises ConfigError when none is given."""
        env = os.environ if env is None else env
        if psk is None and env.get("PMETAL_PSK_HEX"):
            try:
                psk = bytes.fromhex(env["PMETAL_PSK_HEX"])
            except ValueError as exc:
                raise ConfigError("PMETAL_PSK_HEX is not hexadecimal") from exc
        if psk is None:
            psk = env.get("PMETAL_PSK") or None
        if psk is None and cfg.psk_file:
            path = Path(cfg.psk_file).expanduser()
            check_private_file(path, "the PSK file", ConfigError)
            try:
                psk = path.read_bytes().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read the PSK file {path}: {exc}") from exc
        if psk is None:
            raise ConfigError("no PSK: pass psk=..., set PMETAL_PSK, or point "
                              "PMETAL_SECURITY_PSK_FILE at a key file ('pmetal keygen' makes one)")
        return cls(cfg.namespace, psk.encode() if isinstance(psk, str) else bytes(psk))


# --------------------------------------------------------------- handshake

@lru_cache(maxsize=16)
def _curve_keys(name: str, psk: bytes) -> CurveKeys:
    def pair(role: bytes) -> tuple[bytes, bytes]:
        secret = HKDF(hashes.SHA256(), 32, salt=b"pmetal-curve-1",
                      info=role + b"|" + name.encode()).derive(psk)
        return _x25519_public(X25519PrivateKey.from_private_bytes(secret)), secret

    server_public, server_secret = pair(b"server")
    client_public, client_secret = pair(b"client")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def _x25519_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _transcript(ns: NetworkNamespace, hello: Hello, node_id: str, public_key: bytes,
                ephemeral_key: bytes, nonce: bytes, mode: int, host: bytes) -> bytes:
    h = hashlib.sha256(_HS_LABEL)
    for part in (ns.name.encode(), hello.node_id.encode(), hello.public_key,
                 hello.ephemeral_key, hello.nonce, hello.namespace_tag,
                 bytes([hello.mode & 0xFF]), hello.host, node_id.encode(), public_key,
                 ephemeral_key, nonce, bytes([mode & 0xFF]), host):
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    return h.digest()


def _proof(ns: NetworkNamespace, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(ns.psk, role + transcript, hashlib.sha256).digest()


def _session_keys(ns: NetworkNamespace, shared: bytes, th2: bytes) -> tuple[bytes, bytes]:
    okm = HKDF(hashes.SHA256(), 64, salt=th2, info=b"pmetal session keys").derive(ns.psk + shared)
    return okm[:32], okm[32:]


def _check_peer_key(node_id: str, public_key: bytes, ephemeral_key: bytes, nonce: bytes) -> None:
    if len(public_key) != 32 or len(ephemeral_key) != 32 or len(nonce) != 32:
        raise HandshakeError("malformed handshake: keys and nonce must be 32 bytes")
    if node_id_for(public_key) != node_id:
        raise HandshakeError(f"peer claims node id {node_id} that does not belong to its key")


@dataclass
class ClientHandshake:
    """Client-side state between Hello and Welcome."""

    hello: Hello
    ephemeral: X25519PrivateKey
    host_token: shm.HostToken | None = None

    def discard(self) -> None:
        """Free what the handshake holds (its same-machine token); a no-op
        once :func:`client_finish` has run."""
        if self.host_token is not None:
            self.host_token.discard()


def client_hello(identity: NodeIdentity, ns: NetworkNamespace, mode: int = Mode.FULL,
                 *, prove_host: bool = False) -> ClientHandshake:
    """The Hello and the state to finish the handshake with. ``prove_host``:
    offer the same-machine proof (a token in shared memory, which the state
    holds until :func:`client_finish` or :meth:`ClientHandshake.discard`);
    without it the session is never local."""
    eph = X25519PrivateKey.generate()
    host, token = shm.offer() if prove_host else (b"", None)
    hello = Hello(identity.node_id, identity.public_key, _x25519_public(eph), os.urandom(32),
                  ns.tag, mode, host)
    return ClientHandshake(hello, eph, token)


@dataclass
class ServerHandshake:
    """Server-side state between Welcome and Confirm."""

    hello: Hello
    th2: bytes
    keys: tuple[bytes, bytes]
    mode: int = Mode.FULL
    peer_host: shm.Peer = shm.Peer()


def server_welcome(identity: NodeIdentity, ns: NetworkNamespace, hello: Hello,
                   mode: int = Mode.FULL) -> tuple[Welcome, ServerHandshake]:
    """Answer a Hello, or raise HandshakeError (wrong namespace, bad key).
    The session's mode is the stricter of ``mode`` and the client's."""
    if not hmac.compare_digest(hello.namespace_tag, ns.tag):
        raise HandshakeError("peer is in another namespace or has another PSK")
    if not Mode.CONTROL <= hello.mode <= Mode.ENCRYPTED:
        raise HandshakeError(f"peer asks for unknown protection mode {hello.mode}")
    _check_peer_key(hello.node_id, hello.public_key, hello.ephemeral_key, hello.nonce)
    eph = X25519PrivateKey.generate()
    eph_pub = _x25519_public(eph)
    nonce = os.urandom(32)
    host, peer_host = shm.answer(hello.host)
    th = _transcript(ns, hello, identity.node_id, identity.public_key, eph_pub, nonce, mode,
                     host)
    proof = _proof(ns, b"server", th)
    signature = identity.sign(b"server" + th)
    th2 = hashlib.sha256(th + proof + signature).digest()
    try:
        shared = eph.exchange(X25519PublicKey.from_public_bytes(hello.ephemeral_key))
    except ValueError as exc:
        raise HandshakeError(f"bad ephemeral key from peer: {exc}") from exc
    welcome = Welcome(identity.node_id, identity.public_key, eph_pub, nonce, proof, signature,
                      mode, host)
    return welcome, ServerHandshake(hello, th2, _session_keys(ns, shared, th2),
                                    max(mode, hello.mode), peer_host)


def client_finish(identity: NodeIdentity, ns: NetworkNamespace, state: ClientHandshake,
                  welcome: Welcome, mode: int) -> tuple[Confirm, Session]:
    """Check the server's Welcome; return the Confirm and the client session."""
    _check_peer_key(welcome.node_id, welcome.public_key, welcome.ephemeral_key, welcome.nonce)
    th = _transcript(ns, state.hello, welcome.node_id, welcome.public_key,
                     welcome.ephemeral_key, welcome.nonce, welcome.mode, welcome.host)
    if not hmac.compare_digest(welcome.proof, _proof(ns, b"server", th)):
        raise HandshakeError("server could not prove the namespace PSK: the two sides "
                             "have different PSKs")
    if not verify_signature(welcome.public_key, welcome.signature, b"server" + th):
        raise HandshakeError(f"server {welcome.node_id} signed the handshake with a key "
                             f"that is not its own")
    th2 = hashlib.sha256(th + welcome.proof + welcome.signature).digest()
    proof = _proof(ns, b"client", th2)
    signature = identity.sign(b"client" + th2)
    try:
        shared = state.ephemeral.exchange(X25519PublicKey.from_public_bytes(welcome.ephemeral_key))
    except ValueError as exc:
        raise HandshakeError(f"bad ephemeral key from server: {exc}") from exc
    c2s, s2c = _session_keys(ns, shared, th2)
    if not Mode.CONTROL <= welcome.mode <= Mode.ENCRYPTED:
        raise HandshakeError(f"server uses unknown protection mode {welcome.mode}")
    peer_host = shm.confirm(state.host_token, welcome.host) if state.host_token else shm.Peer()
    session = Session(send_key=c2s, recv_key=s2c, peer=NodeId(welcome.node_id),
                      peer_public_key=welcome.public_key, mode=max(mode, welcome.mode),
                      local=peer_host.local, peer_pid=peer_host.pid)
    return Confirm(proof, signature), session


def server_finish(ns: NetworkNamespace, state: ServerHandshake, confirm: Confirm,
                  mode: int) -> Session:
    """Check the client's Confirm; return the server session."""
    if not hmac.compare_digest(confirm.proof, _proof(ns, b"client", state.th2)):
        raise HandshakeError("client could not prove the namespace PSK")
    if not verify_signature(state.hello.public_key, confirm.signature, b"client" + state.th2):
        raise HandshakeError(f"client {state.hello.node_id} signed the handshake with a key "
                             f"that is not its own")
    c2s, s2c = state.keys
    return Session(send_key=s2c, recv_key=c2s, peer=NodeId(state.hello.node_id),
                   peer_public_key=state.hello.public_key, mode=max(mode, state.mode),
                   local=state.peer_host.local, peer_pid=state.peer_host.pid)
