"""Sealed sessions: the frames an authenticated peer sends and receives.

A :class:`Session` is opened by the handshake of :mod:`pmetal.security`
with one key per direction; it seals outgoing and opens incoming frames,
refusing replays and anything weaker than its mode. Large messages can be
sealed and opened in segments of ``STREAM_SEGMENT_BYTES``
(:meth:`Session.iter_parts`, :meth:`Session.open_part`), so a receiver
checks each before the next arrives.

Sealed frames: ``[envelope | seal, *buffers]``: the seal is appended to
frame 0 (saving a frame per message) and reads
``tag (16 bytes; absent in mode 3) | seq (8 bytes LE) | mode (1 byte)``.
``seq`` starts at 1 and strictly increases per direction; a message whose
seq is not above the last one accepted is a replay and is refused.

=====  =========================================================================
mode   protection
=====  =========================================================================
1      control only: envelope and the sizes of all frames authenticated,
       buffer contents not (``SecurityConfig.bulk_auth = False``)
2      everything authenticated (default): keyed BLAKE2b for small messages,
       Poly1305 with a one-time key from BLAKE2b(key, seq) for large ones
3      everything encrypted and authenticated: ChaCha20-Poly1305 per frame,
       nonce = seq | frame index, associated data = mode, seq, frame count
=====  =========================================================================

A receiver refuses messages weaker than its own configured mode.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.poly1305 import Poly1305

from pmetal.codec import frame_bytes
from pmetal.errors import AuthenticationError, ReplayError
from pmetal.ids import NodeId

__all__ = ["STREAM_SEGMENT_BYTES", "Mode", "Session", "SessionStatistics"]

log = logging.getLogger("pmetal.security")   # the security layer's messages keep its name

_blake2b = hashlib.blake2b
_compare = hmac.compare_digest
_TAIL = struct.Struct("<QB")   # seq, mode: the last 9 bytes of a sealed frame 0
_HEAD1 = struct.Struct("<BQIQ")  # MAC header of a message with no buffers
_SMALL = 16 << 10          # below this many bytes BLAKE2b is cheaper than Poly1305 setup
_TAIL_SIZE = _TAIL.size
_SEAL_SIZE = 16 + _TAIL.size   # tag and tail appended to frame 0
_MIN_SMALL_SEALED = _SEAL_SIZE + 1
_TAIL_unpack_from = _TAIL.unpack_from
_HEAD1_pack = _HEAD1.pack
STREAM_SEGMENT_BYTES = 8 << 20
_HEAD = 0x80               # mode-byte flags of streamed messages
_SEGMENT = 0x40
_SEG = struct.Struct("<QIB")     # seq, segment index, mode|_SEGMENT (after a 16-byte tag)
_SEGHDR = struct.Struct("<BQIII")  # MAC header of a segment: mode, seq, index, first frame, count


class Mode:
    CONTROL = 1
    FULL = 2
    ENCRYPTED = 3


@dataclass(frozen=True, slots=True)
class SessionStatistics:
    sealed: int
    opened: int
    rejected: int
    bytes_sealed: int
    bytes_opened: int


class Session:
    """Seals outgoing and opens incoming frames for one authenticated peer."""

    __slots__ = ("_aead_recv", "_aead_send", "_mac_recv", "_mac_send", "_recv_key", "_send_key",
                 "_stats", "_stream",
                 "local", "mode", "peer", "peer_pid", "peer_public_key", "recv_seq", "send_seq",
                 "stream_bytes")

    def __init__(self, *, send_key: bytes, recv_key: bytes, peer: NodeId,
                 peer_public_key: bytes, mode: int = Mode.FULL, local: bool = False,
                 peer_pid: int = 0) -> None:
        # The peer proved it shares this machine's /dev/shm: large arrays may
        # use shm. Its pid (0: unknown) names it as the reader of objects
        # made for it, so that they can be swept when it dies.
        self.local = local
        self.peer_pid = peer_pid
        self._send_key = send_key
        self._recv_key = recv_key
        self.peer = peer
        self.peer_public_key = peer_public_key
        self.mode = mode
        self.send_seq = 0
        self.recv_seq = 0
        self._aead_send = ChaCha20Poly1305(send_key)
        self._aead_recv = ChaCha20Poly1305(recv_key)
        # Keyed BLAKE2b states, copied per message: the key block is
        # compressed once per session, not once per message.
        self._mac_send = _blake2b(key=send_key, digest_size=16)
        self._mac_recv = _blake2b(key=recv_key, digest_size=16)
        self._stats = [0, 0, 0, 0, 0]
        self._stream: _Stream | None = None
        self.stream_bytes = STREAM_SEGMENT_BYTES

    def statistics(self) -> SessionStatistics:
        return SessionStatistics(*self._stats)

    def seal(self, frames: Sequence[Any]) -> list[Any]:
        """Frames with the seal appended to frame 0 (encrypted in mode 3)."""
        self.send_seq += 1
        seq = self.send_seq
        mode = self.mode
        stats = self._stats
        stats[0] += 1
        tail = _TAIL.pack(seq, mode)
        if len(frames) == 1 and mode != Mode.ENCRYPTED:
            head = frames[0]
            if type(head) is not bytes:
                head = bytes(frame_bytes(head))
            stats[3] += len(head)
            if len(head) < _SMALL:
                mac = self._mac_send.copy()
                mac.update(_HEAD1_pack(mode, seq, 1, len(head)) + head)
                tag = mac.digest()
            else:
                tag = _mac(self._send_key, mode, seq, [memoryview(head)])
            return [head + tag + tail]
        if mode == Mode.ENCRYPTED:
            aad = tail + len(frames).to_bytes(4, "little")
            nonce = seq.to_bytes(8, "little")
            plain = [bytes(frame_bytes(f)) for f in frames]
            stats[3] += sum(len(p) for p in plain)
            out = [self._aead_send.encrypt(nonce + i.to_bytes(4, "little"), p, aad)
                   for i, p in enumerate(plain)]
            out[0] += tail
            return out
        views = [frame_bytes(f) for f in frames]
        stats[3] += sum(len(v) for v in views)
        out = list(frames)
        out[0] = bytes(views[0]) + _mac(self._send_key, mode, seq, views) + tail
        return out

    def open_small(self, head: Any) -> bytes | None:
        """The envelope of a one-frame message sealed in this session's own
        mode with the small-message MAC (nearly every control message); None
        for anything else, which :meth:`open` then verifies (and refuses with
        the precise error). :meth:`open_part` tries it first."""
        n = len(head)
        if type(head) is not bytes or not _MIN_SMALL_SEALED <= n < _SMALL:
            return None
        seq, mode = _TAIL_unpack_from(head, n - _TAIL_SIZE)
        if mode != self.mode or mode == Mode.ENCRYPTED or seq <= self.recv_seq:
            return None
        cut = n - _SEAL_SIZE
        env = head[:cut]
        mac = self._mac_recv.copy()
        mac.update(_HEAD1_pack(mode, seq, 1, cut) + env)
        if not _compare(head[cut:cut + 16], mac.digest()):
            return None
        self.recv_seq = seq
        stats = self._stats
        stats[1] += 1
        stats[4] += cut
        return env

    def open(self, frames: Sequence[Any]) -> list[Any]:
        """Verify the seal and strip it; raise AuthenticationError or ReplayError."""
        stats = self._stats
        head = frame_bytes(frames[0]) if frames else memoryview(b"")
        if len(head) < _TAIL.size:
            stats[2] += 1
            raise AuthenticationError(f"unsealed message from {self.peer}")
        seq, mode = _TAIL.unpack_from(head, len(head) - _TAIL.size)
        if not self.mode <= mode <= Mode.ENCRYPTED:
            stats[2] += 1
            raise AuthenticationError(
                f"peer {self.peer} sent a message protected with mode {mode}; this node "
                f"requires mode {self.mode} (check security.bulk_auth/encrypt on both sides)")
        if mode == Mode.ENCRYPTED:
            aad = bytes(head[-_TAIL.size:]) + len(frames).to_bytes(4, "little")
            nonce = seq.to_bytes(8, "little")
            try:
                opened: list[Any] = [
                    self._aead_recv.decrypt(nonce + i.to_bytes(4, "little"),
                                            bytes(v), aad)
                    for i, v in enumerate([head[:-_TAIL.size],
                                           *(frame_bytes(f) for f in frames[1:])])]
            except InvalidTag as exc:
                stats[2] += 1
                raise AuthenticationError(f"message from {self.peer} failed decryption") from exc
            byte_count = sum(len(o) for o in opened)
        else:
            cut = len(head) - _TAIL.size - 16
            if cut < 0:
                stats[2] += 1
                raise AuthenticationError(f"unsealed message from {self.peer}")
            if len(frames) == 1 and cut < _SMALL:
                env = head[:cut]
                mac = self._mac_recv.copy()
                mac.update(_HEAD1_pack(mode, seq, 1, cut) + env)
                expect = mac.digest()
                views = [env]
            else:
                views = [head[:cut], *(frame_bytes(f) for f in frames[1:])]
                expect = _mac(self._recv_key, mode, seq, views)
            if not _compare(head[cut:cut + 16], expect):
                stats[2] += 1
                raise AuthenticationError(f"message from {self.peer} failed authentication")
            opened = views
            byte_count = sum(len(v) for v in views)
        # Checked after the MAC so that a forged seq cannot move the window.
        if seq <= self.recv_seq:
            stats[2] += 1
            raise ReplayError(f"message {seq} from {self.peer} was already received "
                              f"(last {self.recv_seq}): replay refused")
        self.recv_seq = seq
        stats[1] += 1
        stats[4] += byte_count
        return opened


    # ---------------------------------------------------------- streaming

    def seal_parts(self, frames: Sequence[Any]) -> list[list[Any]]:
        """Seal a message as one or more ZeroMQ messages ("parts"): the list
        of :meth:`iter_parts`."""
        return list(self.iter_parts(frames))

    def iter_parts(self, frames: Sequence[Any]) -> Iterator[list[Any]]:
        """Seal a message as one or more ZeroMQ messages ("parts"), each made
        when the caller asks for it.

        A message whose buffers exceed ``stream_bytes`` is streamed: a head
        part (envelope plus every frame length) and segments of at most
        ``stream_bytes`` each with a tag of its own. A sender that sends each
        part before asking for the next authenticates segment k+1 while
        ZeroMQ moves segment k; the receiver verifies segment k while
        segment k+1 arrives. The sequence number is taken at the first part.
        """
        mode = self.mode
        if len(frames) == 1 or mode == Mode.ENCRYPTED:
            yield self.seal(frames)
            return
        views = [frame_bytes(f) for f in frames]
        if sum(len(v) for v in views) - len(views[0]) <= self.stream_bytes:
            yield self.seal(frames)
            return
        self.send_seq += 1
        seq = self.send_seq
        self._stats[0] += 1
        self._stats[3] += sum(len(v) for v in views)
        lengths = struct.pack(f"<{len(views)}Q", *(len(v) for v in views))
        head_tag = _blake2b(_HEAD1.pack(mode, seq, len(views), len(views[0])) + lengths
                            + views[0], key=self._send_key, digest_size=16).digest()
        yield [bytes(views[0]) + head_tag + _TAIL.pack(seq, mode | _HEAD), lengths]
        index = 0
        group: list[memoryview] = []
        size = 0
        first = 1
        for i in range(1, len(views) + 1):
            if i < len(views) and (not group or size + len(views[i]) <= self.stream_bytes):
                group.append(views[i])
                size += len(views[i])
                continue
            tag = _segment_mac(self._send_key, mode, seq, index, first, group)
            yield [tag + _SEG.pack(seq, index, mode | _SEGMENT), *group]
            index += 1
            first = i
            if i < len(views):
                group, size = [views[i]], len(views[i])

    def open_part(self, frames: Sequence[Any]) -> list[Any] | None:
        """Open one received part: the message's frames once it is complete,
        None while a streamed message still lacks segments."""
        if len(frames) == 1:
            small = self.open_small(frames[0])
            if small is not None:
                return [small]
        head = frame_bytes(frames[0]) if frames else memoryview(b"")
        flags = head[-1] if len(head) else 0
        if not flags & (_HEAD | _SEGMENT):
            if self._stream is not None:
                self._drop_stream("a new message arrived before it was complete")
            return self.open(frames)
        stats = self._stats
        if flags & _HEAD:
            return self._open_head(head, frames)
        stream = self._stream
        if stream is None or len(head) != 16 + _SEG.size:
            stats[2] += 1
            raise AuthenticationError(f"unexpected stream segment from {self.peer}")
        seq, index, mode = _SEG.unpack_from(head, 16)
        if seq != stream.seq or index != stream.next_index or (mode & 3) != stream.mode:
            self._drop_stream("segment out of order")
            stats[2] += 1
            raise AuthenticationError(f"stream segment from {self.peer} out of order")
        views = [frame_bytes(f) for f in frames[1:]]
        first = len(stream.frames)
        want = stream.lengths[first:first + len(views)]
        if [len(v) for v in views] != list(want) or not _compare(
                head[:16], _segment_mac(self._recv_key, mode & 3, seq, index, first, views)):
            self._drop_stream("segment failed authentication")
            stats[2] += 1
            raise AuthenticationError(f"stream segment from {self.peer} failed authentication")
        stream.frames.extend(frames[1:])
        stream.next_index += 1
        if len(stream.frames) < len(stream.lengths):
            return None
        self._stream = None
        stats[1] += 1
        stats[4] += sum(stream.lengths)
        return stream.frames

    def _open_head(self, head: memoryview, frames: Sequence[Any]) -> None:
        stats = self._stats
        if self._stream is not None:
            self._drop_stream("a new message arrived before it was complete")
        cut = len(head) - _TAIL.size - 16
        if cut < 0 or len(frames) != 2:
            stats[2] += 1
            raise AuthenticationError(f"malformed stream head from {self.peer}")
        seq, flags = _TAIL.unpack_from(head, len(head) - _TAIL.size)
        mode = flags & 3
        if mode < self.mode or mode == Mode.ENCRYPTED:
            stats[2] += 1
            raise AuthenticationError(f"malformed stream head from {self.peer}")
        lengths_raw = bytes(frame_bytes(frames[1]))
        if len(lengths_raw) % 8 or not lengths_raw:
            stats[2] += 1
            raise AuthenticationError(f"malformed stream head from {self.peer}")
        lengths = struct.unpack(f"<{len(lengths_raw) // 8}Q", lengths_raw)
        expect = _blake2b(_HEAD1.pack(mode, seq, len(lengths), cut) + lengths_raw + head[:cut],
                          key=self._recv_key, digest_size=16).digest()
        if not _compare(head[cut:cut + 16], expect) or lengths[0] != cut:
            stats[2] += 1
            raise AuthenticationError(f"stream head from {self.peer} failed authentication")
        if seq <= self.recv_seq:
            stats[2] += 1
            raise ReplayError(f"message {seq} from {self.peer} was already received "
                              f"(last {self.recv_seq}): replay refused")
        self.recv_seq = seq
        self._stream = _Stream(seq, mode, lengths, [head[:cut]])
        return None

    def _drop_stream(self, why: str) -> None:
        log.warning("dropped an incomplete streamed message from %s: %s", self.peer, why)
        self._stream = None


@dataclass
class _Stream:
    """A streamed message being received: its head is verified, its
    segments arrive one by one."""

    seq: int
    mode: int
    lengths: tuple[int, ...]
    frames: list[Any]
    next_index: int = 0


def _segment_mac(key: bytes, mode: int, seq: int, index: int, first: int,
                 views: Sequence[memoryview]) -> bytes:
    header = _SEGHDR.pack(mode, seq, index, first, len(views))
    otk = _blake2b(header, key=key, digest_size=32, person=b"pmetal-seg").digest()
    p = Poly1305(otk)
    p.update(header)
    if mode == Mode.FULL:
        for v in views:
            p.update(v)
    return p.finalize()


def _mac(key: bytes, mode: int, seq: int, views: Sequence[memoryview]) -> bytes:
    if len(views) == 1:
        header = _HEAD1.pack(mode, seq, 1, len(views[0]))
        if len(views[0]) < _SMALL:
            return hashlib.blake2b(header + views[0], key=key, digest_size=16).digest()
    else:
        header = struct.pack(f"<BQI{len(views)}Q", mode, seq, len(views),
                             *(len(v) for v in views))
    covered = views if mode == Mode.FULL else views[:1]
    if sum(len(v) for v in covered) < _SMALL:
        h = hashlib.blake2b(header, key=key, digest_size=16)
        for v in covered:
            h.update(v)
        return h.digest()
    otk = hashlib.blake2b(header[:9], key=key, digest_size=32, person=b"pmetal-otk").digest()
    p = Poly1305(otk)
    p.update(header)
    for v in covered:
        p.update(v)
    return p.finalize()
