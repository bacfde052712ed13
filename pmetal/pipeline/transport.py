"""Hops between the stages of a pipeline, over the collectives' TCP links.

A pipeline of K stages is a ring of K + 1 ranks: rank 0 is the driver (the
process generating), rank ``i`` holds stage ``i - 1``. Every hop goes one
way round the ring::

    driver --tokens--> stage 0 --activations--> ... --> stage K-1 --token--> driver

so each rank has exactly one sender and one receiver and a step needs no
round trip through the driver until the token is sampled. The links are a
:func:`pmetal.links.tcplinks.connect_mesh` mesh (PSK-authenticated,
bound to the pipeline's tag, and sealed: ``connect_mesh`` requires it by
default and neither end of a ring asks otherwise), used as point-to-point links: messages of a
directed hop are numbered from ``P2P_BASE`` and read strictly in order.

One hop carries a :class:`Hop` (a list of :class:`Entry`, one per sequence
with work at this step) as link messages of the same number:

    chunk 0   uint8: msgpack [HOP_FORMAT, [entry, ...], busy], each entry
              [sequence_id, position, tokens, activation header, prefill,
               end, setup, has_logits, error]; ``busy`` is how many hops
              the driver had in flight when it sent this one (the stages'
              BLAS thread hint: alone, a stage may use every core)
    chunk 1.. the entries' arrays in order: an activation's data (and its
              int8 scales), then logits when the entry carries them

An activation header is :meth:`ActivationMessage.to_frames`'s frame 0, and
the arrays arrive straight into fresh buffers, so decoding is
:meth:`ActivationMessage.from_frames` over them: the same checks, no copy.
Anything malformed raises :class:`~pmetal.errors.ProtocolError`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from pmetal.links.tcplinks import P2P_BASE
from pmetal.errors import ProtocolError
from pmetal.pipeline.activations import ActivationMessage, DtypeTag

__all__ = ["HOP_FORMAT", "Entry", "Hop", "HopReceiver", "HopSender"]

HOP_FORMAT = 1
_MAX_HEADER = 1 << 22      # 4 MiB of entries (a 4096-token prompt is ~20 KiB)
_MAX_ENTRIES = 4096
_MAX_TOKENS = 1 << 20


@dataclass
class Entry:
    """One sequence's share of a hop.

    - ``tokens``: into stage 0, the token ids to embed at ``position``; out
      of the last stage, the one token sampled.
    - ``activation``: between stages, the hidden rows (encoded).
    - ``setup``: at a sequence's first step, what every stage needs to know
      (``max_len`` of its KV cache; the last stage's ``sampling`` settings
      and ``stream``; ``logits``: return the logits too).
    - ``end``: the stages drop the sequence's state after this step; an
      entry with ``end`` and nothing else only drops it (cancellation).
    - ``error``: the sequence failed at a stage; later stages pass it on.
    """

    sequence_id: int
    position: int = 0
    tokens: tuple[int, ...] = ()
    activation: ActivationMessage | None = None
    prefill: bool = False
    end: bool = False
    setup: dict[str, Any] | None = None
    logits: np.ndarray | None = None
    error: str | None = None


@dataclass
class Hop:
    """What moves along one link at one step. ``busy``: hops in flight
    round the ring when the driver sent it (1: this stage computes alone)."""

    entries: list[Entry] = field(default_factory=list)
    busy: int = 1

    @property
    def payload_bytes(self) -> int:
        """Bytes of arrays (activations and logits), without headers."""
        total = 0
        for e in self.entries:
            if e.activation is not None:
                total += e.activation.nbytes
            if e.logits is not None:
                total += e.logits.nbytes
        return total


class HopSender:
    """Sends the hops of one directed link, numbered in order."""

    def __init__(self, links: Any, to_rank: int) -> None:
        self.links = links
        self.to_rank = to_rank
        self.count = 0
        self.bytes = 0

    def send(self, hop: Hop) -> None:
        self.count += 1
        op = P2P_BASE + self.count
        rows, arrays = [], []
        for e in hop.entries:
            head = None
            if e.activation is not None:
                frames = e.activation.to_frames()
                head = bytes(frames[0])
                arrays.append(np.ascontiguousarray(e.activation.data).reshape(-1))
                if e.activation.scales is not None:
                    arrays.append(e.activation.scales)
            if e.logits is not None:
                arrays.append(np.ascontiguousarray(e.logits, dtype=np.float32).reshape(-1))
            rows.append([e.sequence_id, e.position, list(e.tokens), head, e.prefill, e.end,
                         e.setup, e.logits is not None, e.error])
        header = msgpack.packb([HOP_FORMAT, rows, hop.busy])
        self.links.send(self.to_rank, op, 0, np.frombuffer(header, np.uint8))
        for i, array in enumerate(arrays, 1):
            self.links.send(self.to_rank, op, i, array)
            self.bytes += array.nbytes
        self.bytes += len(header)
        # The links may still hold views of the arrays: copy what is unsent,
        # so the caller may reuse its buffers at once.
        self.links.release(op)


class HopReceiver:
    """Receives the hops of one directed link, in order."""

    def __init__(self, links: Any, from_rank: int) -> None:
        self.links = links
        self.from_rank = from_rank
        self.count = 0
        self.bytes = 0

    def recv(self, deadline: float, *, rest: float = 60.0) -> Hop:
        """The next hop. ``TimeoutError`` when none starts by ``deadline``
        (the link stays usable); once it has started, its remaining parts
        must arrive within ``rest`` seconds. Raises what the links raise
        (``PeerError`` when the sender died) and :class:`ProtocolError`
        for a malformed hop."""
        op = P2P_BASE + self.count + 1
        chunk, raw = self.links.recv(self.from_rank, op, deadline)
        self.count += 1
        deadline = time.monotonic() + rest
        if chunk != 0 or raw.dtype != np.uint8 or raw.nbytes > _MAX_HEADER:
            raise ProtocolError(f"pipeline hop from rank {self.from_rank}: expected a header "
                                f"of at most {_MAX_HEADER} bytes, got chunk {chunk} "
                                f"({raw.dtype}, {raw.nbytes} bytes)")
        self.bytes += raw.nbytes
        rows, busy = _parse_header(raw.tobytes(), self.from_rank)
        entries: list[Entry] = []
        part = 0

        def next_array() -> np.ndarray:
            nonlocal part
            part += 1
            got, array = self.links.recv(self.from_rank, op, deadline)
            if got != part:
                raise ProtocolError(f"pipeline hop from rank {self.from_rank}: part {got} "
                                    f"came where part {part} belongs")
            self.bytes += array.nbytes
            return array

        for row in rows:
            seq, pos, tokens, head, prefill, end, setup, has_logits, error = row
            activation = None
            if head is not None:
                frames = [head, next_array()]
                if _is_int8(head):
                    frames.append(next_array())
                activation = ActivationMessage.from_frames(
                    [frames[0], *(memoryview(a).cast("B") for a in frames[1:])])
                if activation.sequence_id != seq:
                    raise ProtocolError(f"pipeline hop from rank {self.from_rank}: activation "
                                        f"of sequence {activation.sequence_id} in the entry "
                                        f"of sequence {seq}")
            logits = None
            if has_logits:
                logits = next_array()
                if logits.dtype != np.float32:
                    raise ProtocolError(f"pipeline hop from rank {self.from_rank}: logits "
                                        f"must be float32, got {logits.dtype}")
            entries.append(Entry(seq, pos, tuple(tokens), activation, prefill, end, setup,
                                 logits, error))
        return Hop(entries, busy)


def _is_int8(head: bytes) -> bool:
    try:
        return msgpack.unpackb(head)[5] == int(DtypeTag.INT8)
    except Exception:  # noqa: BLE001 - from_frames says what is wrong with it
        return False


def _parse_header(data: bytes, sender: int) -> tuple[list[list[Any]], int]:
    where = f"pipeline hop from rank {sender}"
    try:
        head = msgpack.unpackb(data, raw=False, strict_map_key=True,
                               max_array_len=_MAX_TOKENS)
    except Exception as exc:  # msgpack raises a dozen unrelated types on garbage
        raise ProtocolError(f"{where}: unreadable header: {exc}") from exc
    if not (isinstance(head, list) and len(head) == 3 and head[0] == HOP_FORMAT
            and isinstance(head[1], list) and _is_count(head[2]) and head[2] <= _MAX_ENTRIES):
        raise ProtocolError(f"{where}: not a hop of format {HOP_FORMAT}")
    rows = head[1]
    if len(rows) > _MAX_ENTRIES:
        raise ProtocolError(f"{where}: {len(rows)} entries, at most {_MAX_ENTRIES}")
    for row in rows:
        if not (isinstance(row, list) and len(row) == 9):
            raise ProtocolError(f"{where}: an entry is not a 9-item array")
        seq, pos, tokens, head_, prefill, end, setup, has_logits, error = row
        if not (_is_count(seq) and _is_count(pos)):
            raise ProtocolError(f"{where}: sequence id {seq!r} or position {pos!r} out of range")
        if not (isinstance(tokens, list) and all(_is_count(t) and t < 1 << 31 for t in tokens)):
            raise ProtocolError(f"{where}: tokens of sequence {seq} are not token ids")
        if head_ is not None and not isinstance(head_, bytes):
            raise ProtocolError(f"{where}: activation header of sequence {seq} is not bytes")
        if not all(type(flag) is bool for flag in (prefill, end, has_logits)):
            raise ProtocolError(f"{where}: flags of sequence {seq} are not booleans")
        if setup is not None and not isinstance(setup, dict):
            raise ProtocolError(f"{where}: setup of sequence {seq} is not a map")
        if error is not None and not isinstance(error, str):
            raise ProtocolError(f"{where}: error of sequence {seq} is not a string")
    return rows, head[2]


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 63
