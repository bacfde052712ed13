"""Activations between pipeline stages: the codec and the message.

A stage hands the next one a float32 hidden state ``[rows, hidden]`` (rows:
the prompt's tokens at prefill, one per sequence step at decode). The
:class:`ActivationCodec` chosen for the pipeline shrinks it on the way out
and the receiving stage decodes it back to float32; the receiver dispatches
on the message's :class:`DtypeTag`, so it need not know the sender's codec.

=========  ============  ==============  ===========================================
codec      tag           bytes per row   error of decode(encode(x)), per element
=========  ============  ==============  ===========================================
``none``   float32       4 * hidden      exact (and zero-copy both ways)
``fp16``   float16       2 * hidden      <= 2**-11 * |x| + 2**-25 (round to nearest
                                         even); finite values beyond 65504 saturate
``bf16``   bfloat16      2 * hidden      <= 2**-8 * |x| + 2**-134 (round to nearest
                                         even); beyond 3.39e38 rounds to infinity
``int8``   int8 + scale  hidden + 4      <= max|row| / 254 (half a step of the
                                         row's scale max|row| / 127); a row whose
                                         max|row| < 2**-100 decodes to zeros
=========  ============  ==============  ===========================================

For the default model (hidden 576) a token costs 2304, 1152, 1152 or 580
bytes. NaN and infinity pass through ``none``, ``fp16`` and ``bf16``
unchanged; ``int8`` refuses them, and rows beyond 2**100 (the model diverged).

Frames (:meth:`ActivationMessage.to_frames`)::

    frame 0   msgpack array [format, sequence_id, position, rows, hidden, tag, prefill]
    frame 1   the data, C order, little-endian: float32, float16, bfloat16 bits
              as uint16, or int8
    frame 2   int8 only: one float32 scale per row, little-endian

``format`` is :data:`FRAME_FORMAT`. The buffers are views of the arrays, never
copies; :meth:`ActivationMessage.from_frames` wraps received frames the same
way and checks everything first (tag, sizes, finite non-negative scales),
raising :class:`~pmetal.errors.ProtocolError` for anything malformed.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from pmetal.codec import frame_bytes
from pmetal.errors import PMetalTypeError, PMetalValueError, ProtocolError

__all__ = ["DEFAULT_MAX_BYTES", "FRAME_FORMAT", "ActivationCodec", "ActivationMessage",
           "DtypeTag"]

FRAME_FORMAT = 1
DEFAULT_MAX_BYTES = 1 << 30
"""Largest payload :meth:`ActivationMessage.from_frames` accepts by default
(1 GiB: a 4096-token prefill of a hidden-8192 model in float32 is 128 MiB)."""

_MAX_HEADER = 128          # the header is ~20 bytes; anything longer is not ours
_MAX_DIM = 1 << 31
_FP16_MAX = np.float32(65504.0)
# int8 rows: below 2**-100 a row is zero for any model, beyond 2**100 it has
# diverged; inside, 127 / peak and 127 * scale stay finite in float32.
_INT8_FLUSH = np.float32(2.0**-100)
_INT8_LIMIT = np.float32(2.0**100)
_MAX_SCALE = _INT8_LIMIT / np.float32(127)


class DtypeTag(enum.IntEnum):
    """How an :class:`ActivationMessage`'s data is stored on the wire."""

    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3     # the upper 16 bits of float32, carried as uint16
    INT8 = 4         # with one float32 scale per row

    @property
    def wire_dtype(self) -> np.dtype:
        """The numpy dtype of the data frame (little-endian)."""
        return _WIRE_DTYPES[self]


_WIRE_DTYPES = {DtypeTag.FLOAT32: np.dtype("<f4"), DtypeTag.FLOAT16: np.dtype("<f2"),
                DtypeTag.BFLOAT16: np.dtype("<u2"), DtypeTag.INT8: np.dtype("i1")}
_SCALE_DTYPE = np.dtype("<f4")


@dataclass(frozen=True, eq=False)
class ActivationMessage:
    """One hidden state in flight from a stage to the next.

    ``position`` is the sequence position of the first row (the KV cache
    offset the receiving stage writes at); ``prefill`` says whether the rows
    are a prompt's tokens or decode steps. ``data`` has ``shape`` and the
    tag's wire dtype; ``scales`` (float32, one per row) is present for
    ``INT8`` only. The arrays may be read-only views of received frames.
    """

    sequence_id: int
    position: int
    shape: tuple[int, int]
    dtype: DtypeTag
    data: np.ndarray
    scales: np.ndarray | None = None
    prefill: bool = False

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem:
            raise PMetalValueError(f"inconsistent ActivationMessage: {problem}")

    @property
    def nbytes(self) -> int:
        """Payload bytes on the wire (data plus scales, without the header)."""
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def to_frames(self) -> list[Any]:
        """The header and zero-copy views of the buffers, for a multipart send."""
        head = msgpack.packb([FRAME_FORMAT, self.sequence_id, self.position, self.shape[0],
                              self.shape[1], int(self.dtype), self.prefill])
        frames: list[Any] = [head, memoryview(self.data).cast("B")]
        if self.scales is not None:
            frames.append(memoryview(self.scales).cast("B"))
        return frames

    @classmethod
    def from_frames(cls, frames: Sequence[Any], *,
                    max_bytes: int = DEFAULT_MAX_BYTES) -> ActivationMessage:
        """Wrap received frames (bytes, memoryviews or ``zmq.Frame``) without
        copying them; raise :class:`ProtocolError` if they are malformed."""
        if not isinstance(frames, Sequence) or not 2 <= len(frames) <= 3:
            raise ProtocolError("activation message: expected 2 or 3 frames "
                                f"(header, data[, scales]), got {_count(frames)}")
        try:
            views = [frame_bytes(f) for f in frames]
        except TypeError as exc:
            raise ProtocolError(f"activation message: a frame is not a buffer: {exc}") from exc
        if len(views[0]) > _MAX_HEADER:
            raise ProtocolError(f"activation message: header of {len(views[0])} bytes "
                                f"(at most {_MAX_HEADER})")
        try:
            head = msgpack.unpackb(views[0], raw=True, max_array_len=16, max_map_len=0,
                                   max_str_len=0, max_bin_len=0, max_ext_len=0)
        except Exception as exc:  # msgpack raises a dozen unrelated types on garbage
            raise ProtocolError(f"activation message: unreadable header: {exc}") from exc
        if not isinstance(head, list) or len(head) != 7:
            raise ProtocolError("activation message: header is not a 7-item array")
        fmt, seq, pos, rows, hidden, tag, prefill = head
        if fmt != FRAME_FORMAT or type(fmt) is not int:
            raise ProtocolError(f"activation message: frame format {fmt!r}, "
                                f"this node reads {FRAME_FORMAT}")
        for name, value, low in (("sequence_id", seq, 0), ("position", pos, 0),
                                 ("rows", rows, 1), ("hidden", hidden, 1)):
            if type(value) is not int or not low <= value < (1 << 63 if low == 0 else _MAX_DIM):
                raise ProtocolError(f"activation message: {name} {value!r} out of range")
        if type(prefill) is not bool:
            raise ProtocolError(f"activation message: prefill flag {prefill!r} is not a bool")
        try:
            dtype = DtypeTag(tag)
        except ValueError as exc:
            raise ProtocolError(f"activation message: unknown dtype tag {tag!r} "
                                f"(known: {[int(t) for t in DtypeTag]})") from exc
        size = rows * hidden * dtype.wire_dtype.itemsize
        scale_size = rows * _SCALE_DTYPE.itemsize if dtype is DtypeTag.INT8 else 0
        if size + scale_size > max_bytes:
            raise ProtocolError(f"activation message: {rows}x{hidden} {dtype.name} is "
                                f"{size + scale_size} bytes, more than the limit {max_bytes}")
        if len(views) != (3 if scale_size else 2):
            raise ProtocolError(f"activation message: {dtype.name} takes "
                                f"{3 if scale_size else 2} frames, got {len(views)}")
        if len(views[1]) != size:
            raise ProtocolError(f"activation message: data frame of {len(views[1])} bytes, "
                                f"{rows}x{hidden} {dtype.name} needs {size}")
        data = np.frombuffer(views[1], dtype.wire_dtype).reshape(rows, hidden)
        scales = None
        if scale_size:
            if len(views[2]) != scale_size:
                raise ProtocolError(f"activation message: scales frame of {len(views[2])} "
                                    f"bytes, {rows} rows need {scale_size}")
            scales = np.frombuffer(views[2], _SCALE_DTYPE)
            if not ((scales >= 0).all() and (scales <= _MAX_SCALE).all()):   # NaN fails both
                raise ProtocolError("activation message: int8 scales must be finite, "
                                    f"non-negative and at most {_MAX_SCALE:.3g}")
        return cls(seq, pos, (rows, hidden), dtype, data, scales, prefill)


def _count(frames: Any) -> str:
    try:
        return str(len(frames))
    except TypeError:
        return type(frames).__name__


def _problem(msg: ActivationMessage) -> str:
    """What is inconsistent in ``msg`` ('' if nothing)."""
    if not isinstance(msg.dtype, DtypeTag):
        return f"dtype {msg.dtype!r} is not a DtypeTag"
    if not (isinstance(msg.shape, tuple) and len(msg.shape) == 2
            and all(type(d) is int and d >= 1 for d in msg.shape)):
        return f"shape {msg.shape!r} is not (rows >= 1, hidden >= 1)"
    if not all(type(v) is int and 0 <= v < 1 << 63 for v in (msg.sequence_id, msg.position)):
        return "sequence_id and position must be ints in [0, 2**63)"
    if type(msg.prefill) is not bool:
        return f"prefill {msg.prefill!r} is not a bool"
    data = msg.data
    if not isinstance(data, np.ndarray) or data.dtype != msg.dtype.wire_dtype \
            or data.shape != msg.shape or not data.flags.c_contiguous:
        return (f"data must be a C-contiguous {msg.dtype.wire_dtype} array of shape "
                f"{msg.shape}")
    if (msg.scales is not None) != (msg.dtype is DtypeTag.INT8):
        return "scales go with INT8 data, and only with it"
    if msg.scales is not None and (msg.scales.dtype != _SCALE_DTYPE
                                   or msg.scales.shape != (msg.shape[0],)):
        return f"scales must be float32 of shape ({msg.shape[0]},)"
    return ""


def _as_float32_rows(x: Any) -> np.ndarray:
    """``x`` (numpy, or MLX when installed) as a C-contiguous float32 [rows, hidden]."""
    mx = sys.modules.get("mlx.core")
    if mx is not None and isinstance(x, mx.array):
        if x.dtype != mx.float32:
            x = x.astype(mx.float32)   # numpy has no bfloat16: convert on the MLX side
        x = np.asarray(x)
    if not isinstance(x, np.ndarray):
        raise PMetalTypeError(f"activations must be a numpy or MLX array, got "
                              f"{type(x).__name__}")
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise PMetalValueError(f"activations must be [rows, hidden] with both >= 1, got "
                               f"shape {x.shape}")
    if x.dtype != np.float32:
        if not np.issubdtype(x.dtype, np.floating):
            raise PMetalTypeError(f"activations must be floating point, got {x.dtype}")
        x = x.astype(np.float32)
    return np.ascontiguousarray(x)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding to nearest even (as torch and MLX do)."""
    u = x.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half-way cases to even.
    bits = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype("<u2")
    nan = np.isnan(x)
    if nan.any():   # rounding could carry a NaN's low payload into infinity
        bits[nan] = (u[nan] >> 16).astype(np.uint16) | 0x0040
    return bits


class ActivationCodec(enum.Enum):
    """How a stage compresses the hidden state it sends (see the module table)."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"

    @classmethod
    def parse(cls, name: str) -> ActivationCodec:
        """The codec called ``name`` (``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``)."""
        try:
            return cls(name.lower() if isinstance(name, str) else name)
        except ValueError as exc:
            raise PMetalValueError(f"unknown activation codec {name!r}; choose one of "
                                   f"{[c.value for c in cls]}") from exc

    @property
    def tag(self) -> DtypeTag:
        return _TAGS[self]

    def bytes_per_row(self, hidden: int) -> int:
        """Payload bytes per token (row) for a model of width ``hidden``."""
        return hidden * self.tag.wire_dtype.itemsize + (4 if self is ActivationCodec.INT8 else 0)

    def encode(self, x: Any, *, sequence_id: int = 0, position: int = 0,
               prefill: bool = False) -> ActivationMessage:
        """Compress the float32 ``[rows, hidden]`` hidden state ``x``.

        ``NONE`` keeps a view of ``x`` when it is already C-contiguous
        float32: do not write to ``x`` until the message is sent."""
        x = _as_float32_rows(x)
        scales = None
        if self is ActivationCodec.NONE:
            data = x
        elif self is ActivationCodec.FP16:
            # Saturate rather than let a large finite value become infinity.
            data = np.clip(x, -_FP16_MAX, _FP16_MAX).astype("<f2")
        elif self is ActivationCodec.BF16:
            data = _bf16_bits(x)
        else:
            peak = np.abs(x).max(axis=1)
            if not (peak <= _INT8_LIMIT).all():   # NaN fails too
                raise PMetalValueError("int8 activation codec: the hidden state holds NaN, "
                                       "infinity or values beyond 2**100 (the model "
                                       "diverged); use codec none to carry it as it is")
            peak[peak < _INT8_FLUSH] = 0
            scales = (peak / np.float32(127)).astype(_SCALE_DTYPE)
            inverse = np.divide(np.float32(127), peak, out=np.zeros_like(peak),
                                where=peak > 0)
            data = np.rint(x * inverse[:, None]).astype(np.int8)
        return ActivationMessage(sequence_id, position, (x.shape[0], x.shape[1]), self.tag,
                                 data, scales, prefill)

    @staticmethod
    def decode(msg: ActivationMessage) -> np.ndarray:
        """The float32 ``[rows, hidden]`` hidden state in ``msg``, whatever its tag.

        A ``FLOAT32`` message decodes to its own data, without a copy (read
        only when it wraps a received frame)."""
        if msg.dtype is DtypeTag.FLOAT32:
            return msg.data
        if msg.dtype is DtypeTag.FLOAT16:
            return msg.data.astype(np.float32)
        if msg.dtype is DtypeTag.BFLOAT16:
            return (msg.data.astype(np.uint32) << 16).view(np.float32)
        assert msg.scales is not None
        return msg.data.astype(np.float32) * msg.scales[:, None]


_TAGS = {ActivationCodec.NONE: DtypeTag.FLOAT32, ActivationCodec.FP16: DtypeTag.FLOAT16,
         ActivationCodec.BF16: DtypeTag.BFLOAT16, ActivationCodec.INT8: DtypeTag.INT8}
