"""Sealed links: every message on a TCP link between two ranks encrypted
and authenticated (AES-256-GCM), keyed per connection by its handshake.

Why AES-GCM: on the machines pmetal targets both x86 (AES-NI, PCLMUL) and
Apple Silicon (the ARMv8 crypto extensions) run it in hardware. Measured
here through ``cryptography`` (``encrypt_into``, one core): AES-256-GCM
5.0 GB/s on 1 MiB and 1.8 us on a 2.3 KiB pipeline hop, ChaCha20-Poly1305
2.0 GB/s and 3.7 us (docs/performance.md, "Sealed links").

**Keys.** The handshake (:mod:`pmetal.links.tcphandshake`) proves the
namespace's PSK both ways over a transcript of the group's tag, both
ranks, both nonces and both sides' seal flags. :func:`derive` turns the
same transcript into two keys with HKDF-SHA256 (the collective key as the
secret, the nonces as the salt): one per direction, so neither side's
frames can be reflected back at it. A fresh pair per connection: frames of
another connection, group, formation or direction never open.

**Nonces.** The nonce of a frame is its number in its direction (a 96-bit
counter from 0), never sent: the receiver expects the next number. So a
frame replayed, dropped, reordered, cut short or spliced in from elsewhere
fails its tag, and the link breaks with :class:`~pmetal.errors.
AuthenticationError` naming the peer. TCP already delivers in order, so
a failure is an attack or a corrupting middlebox, never bad luck.

**Frames** (docs/protocol.md, "Sealed collective links"): a message's
28-byte header is sealed on its own (44 bytes on the wire), so its byte
count is authenticated before a single payload byte is trusted; the
payload follows as segments of at most :data:`SEGMENT` bytes, each sealed
(16 more bytes) under the next number. Segments let a large message go out
while the rest is still being sealed, and let the receiver open each one
straight into the destination array (``decrypt_into``): sealing costs no
copy on either side beyond the cipher's own pass.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pmetal.errors import AuthenticationError
from pmetal.transport import is_loopback

__all__ = ["OVERHEAD", "SEGMENT", "Direction", "LinkSeal", "derive", "requires_seal",
           "segments"]

OVERHEAD = 16          # bytes an AES-GCM tag adds to each sealed piece
SEGMENT = 256 << 10    # payload bytes per sealed segment, at most
_INFO = b"pmetal-link-seal-1"


def requires_seal(policy: str, hosts: Iterable[str]) -> bool:
    """Whether a rank whose ``link_encryption`` setting is ``policy``
    requires its links sealed, in a group whose ranks listen on ``hosts``:
    "on" always, "off" never (trusted links; still sealed when the other
    side requires it), "auto" unless every rank is on loopback (then no
    byte leaves the machine)."""
    if policy == "on":
        return True
    if policy == "off":
        return False
    if policy != "auto":
        raise ValueError(f"link_encryption is {policy!r}; use auto, on or off")
    return not all(is_loopback(h) for h in hosts)


def derive(key: bytes, tag: bytes, low: int, high: int, nonces: bytes,
           flags: bytes) -> tuple[bytes, bytes]:
    """The two keys of the connection between ranks ``low`` (listening)
    and ``high`` (dialling): (high -> low, low -> high). Everything the
    handshake's proofs cover goes in, so a connection whose transcript
    differs in any byte gets other keys."""
    info = _INFO + tag + struct.pack("<II", low, high) + flags
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=nonces, info=info).derive(key)
    return okm[:32], okm[32:]


def segments(nbytes: int) -> list[tuple[int, int]]:
    """The (start, end) of each sealed segment of an ``nbytes`` payload."""
    return [(start, min(start + SEGMENT, nbytes)) for start in range(0, nbytes, SEGMENT)]


class Direction:
    """One direction of a sealed link: its cipher and the number of the
    next frame. Not thread-safe: the sending side seals under its peer's
    send lock, the receiving side opens from the one reading thread."""

    __slots__ = ("_aead", "frames")

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self.frames = 0

    def _nonce(self) -> bytes:
        nonce = self.frames.to_bytes(12, "little")
        self.frames += 1
        return nonce

    def seal_into(self, data: memoryview | bytes, out: memoryview | bytearray) -> None:
        """Seal ``data`` into ``out`` (exactly ``len(data) + OVERHEAD`` bytes)."""
        self._aead.encrypt_into(self._nonce(), data, None, out)

    def open_into(self, sealed: memoryview | bytearray, out: memoryview | bytearray) -> bool:
        """Open ``sealed`` into ``out`` (``OVERHEAD`` bytes shorter); False
        when the tag does not verify (``out`` then holds garbage)."""
        try:
            self._aead.decrypt_into(self._nonce(), sealed, None, out)
        except InvalidTag:
            return False
        return True


class LinkSeal:
    """Both directions of one sealed connection to rank ``peer``."""

    __slots__ = ("peer", "rx", "tx")

    def __init__(self, peer: int, tx_key: bytes, rx_key: bytes) -> None:
        self.peer = peer
        self.tx = Direction(tx_key)
        self.rx = Direction(rx_key)

    def refused(self, what: str) -> AuthenticationError:
        """The error of a frame from the peer that did not open."""
        return AuthenticationError(
            f"{what} from rank {self.peer} failed authentication (frame "
            f"{self.rx.frames - 1} of the link): it was altered, replayed, reordered or "
            "cut short on the way (someone between the ranks, or a corrupting network "
            "device); the connection is closed and nothing of it was used")
