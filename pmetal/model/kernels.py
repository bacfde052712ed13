"""Matrix products with weights kept in their GGUF blocks.

What it owns: the Python face of the C extension ``pmetal.model._qk``
(``pmetal/model/csrc/``), and a numpy fallback for when the extension did
not build.  A :class:`QMatrix` is a view of a tensor's bytes, typically
inside a memory-mapped GGUF file; nothing here ever makes a float32 copy of
a whole matrix.

* :func:`matmul` is the decode path: ``out[i] = x @ dequant(weights[i]).T``
  for a few x rows.  Each x row is quantized once per call to the activation
  format its weight type needs (blocks of 32 or 256 int8 values with a float
  scale, like llama.cpp), then integer dot products apply the weight and
  activation scales inside the dot.  One threaded dispatch covers every matrix
  of the call, so q, k and v (or gate and up) need no fused copy.
* :func:`dequantize` turns a slice of rows into float32, for prefill (a tile
  of rows at a time, multiplied with numpy's GEMM) and embeddings;
  :func:`take_rows` is the embedding lookup.

Determinism (C path): the bits of ``out[i][r]`` depend only on ``x[r]`` and
``weights[i]``, never on the number of rows, the other matrices or
``threads``: each output element is computed start to finish by one thread
in a fixed order.  The numpy fallback makes no such promise.

Accuracy (C path), with u = 2**-24, for one output y = sum_i w_i x_i over K
values in n_b blocks; the derivation is in docs/kernels.md:

* quantized weights: ``|y - exact| <= sum_b delta_b * sum_{i in b} |c_i|
  + gamma(n_b + 8) * sum_i mag_i * (|x_i| + delta_b)`` with
  ``delta_b = max_{i in b}|x_i| / 254 * (1 + 2**-14)`` (x rounded to int8 per
  block of 32 or 256), ``gamma(n) = n u / (1 - n u)``, ``c_i`` the weight part
  that multiplies the quantized x (``w_i``, except ``w_i - m_b`` for Q4_1
  and Q5_1, whose min term uses the float sum of x) and ``mag_i`` the sum of the
  magnitudes of the scale and min parts of ``w_i`` (``|w_i|`` for formats
  without a min).
* F32, F16, BF16 weights: ``|y - exact| <= gamma(ceil(K / 8) + 12) * sum_i
  |w_i x_i|``.

The instruction set is chosen at import: AVX2+FMA+F16C on x86-64 CPUs that
have them, NEON on arm64, else portable C.  ``PMETAL_KERNEL_ISA`` (``auto``,
``scalar``, ``avx2``, ``neon``) narrows the choice, for tests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pmetal.errors import ConfigError, PMetalValueError

__all__ = [
    "BF16",
    "F16",
    "F32",
    "KernelError",
    "Q4_0",
    "Q4_1",
    "Q4_K",
    "Q5_0",
    "Q5_1",
    "Q5_K",
    "Q6_K",
    "Q8_0",
    "QMatrix",
    "SUPPORTED",
    "available",
    "block_shape",
    "dequantize",
    "isa",
    "matmul",
    "take_rows",
]

log = logging.getLogger(__name__)

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30

# ggml type id -> (name, values per block, bytes per block)
_LAYOUT: dict[int, tuple[str, int, int]] = {
    F32: ("F32", 1, 4), F16: ("F16", 1, 2), BF16: ("BF16", 1, 2),
    Q4_0: ("Q4_0", 32, 18), Q4_1: ("Q4_1", 32, 20), Q5_0: ("Q5_0", 32, 22),
    Q5_1: ("Q5_1", 32, 24), Q8_0: ("Q8_0", 32, 34),
    Q4_K: ("Q4_K", 256, 144), Q5_K: ("Q5_K", 256, 176), Q6_K: ("Q6_K", 256, 210),
}
SUPPORTED: frozenset[int] = frozenset(_LAYOUT)

_F32 = np.dtype(np.float32)   # numpy's float32 dtype is a singleton: tested with `is`

# Rows dequantized at a time by the numpy fallback: bounds its float32
# temporaries to a few MB whatever the matrix.
_FALLBACK_BYTES = 4 << 20


class KernelError(PMetalValueError):
    """A kernel argument is unusable: an unsupported ggml type, a matrix whose
    bytes do not match its shape, an x or ``out`` of the wrong dtype, shape or
    layout, mismatched K, ``threads < 1``, a row id out of range.

    Sits under :class:`~pmetal.errors.PMetalValueError` (so also
    ``ValueError`` and :class:`~pmetal.errors.PMetalError`) in the tree of
    ``pmetal/errors.py``; the message names the argument and what is wrong.
    """


def _name(ggml_type: int) -> str:
    layout = _LAYOUT.get(ggml_type)
    return layout[0] if layout else f"ggml type {ggml_type}"


def block_shape(ggml_type: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a supported ggml type."""
    ok = isinstance(ggml_type, (int, np.integer)) and not isinstance(ggml_type, bool)
    layout = _LAYOUT.get(int(ggml_type)) if ok else None
    if layout is None:
        supported = ", ".join(name for name, _, _ in _LAYOUT.values())
        raise KernelError(f"ggml type {ggml_type!r} is not supported (supported: {supported})")
    return layout[1], layout[2]


@dataclass(frozen=True, eq=False)
class QMatrix:
    """A (rows, cols) matrix in one GGUF block format; `data` is a C-contiguous uint8 array of
    rows * row_bytes bytes, shaped (rows, row_bytes) — typically a view of a memory-mapped
    GGUF file (never copied).

    Compared and hashed by identity (two views of the same bytes are two
    matrices); the repr names the format and shape, not the bytes."""

    data: np.ndarray
    ggml_type: int
    rows: int
    cols: int
    _spec: tuple[np.ndarray, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        per_block, _ = block_shape(self.ggml_type)
        name = _name(self.ggml_type)
        for attribute in ("rows", "cols"):
            value = getattr(self, attribute)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise KernelError(f"QMatrix {attribute} must be an int >= 0, got {value!r}")
            object.__setattr__(self, attribute, int(value))
        object.__setattr__(self, "ggml_type", int(self.ggml_type))
        if self.cols == 0 or self.cols % per_block:
            raise KernelError(f"QMatrix of {name}: cols={self.cols} is not a positive multiple "
                              f"of the block size {per_block}")
        data = self.data
        if not isinstance(data, np.ndarray):
            raise KernelError(f"QMatrix data must be a numpy array, got {type(data).__name__}")
        if data.dtype != np.uint8:
            raise KernelError(f"QMatrix data must be uint8 (the raw GGUF bytes), got {data.dtype}")
        if data.shape != (self.rows, self.row_bytes):
            raise KernelError(f"QMatrix of {name} ({self.rows} x {self.cols}): data has shape "
                              f"{data.shape}, expected ({self.rows}, {self.row_bytes})")
        if not data.flags.c_contiguous:
            raise KernelError("QMatrix data must be C-contiguous")
        # what the C extension is handed, built once
        object.__setattr__(self, "_spec", (data, self.ggml_type, self.rows))

    def __repr__(self) -> str:
        return f"QMatrix({_name(self.ggml_type)}, {self.rows} x {self.cols}, {self.nbytes} bytes)"

    @property
    def row_bytes(self) -> int:
        per_block, nbytes = block_shape(self.ggml_type)
        return self.cols // per_block * nbytes

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def rows_view(self, first: int, last: int) -> QMatrix:
        """Rows [first, last) as a QMatrix sharing this one's bytes."""
        _check_range(self, first, last)
        return QMatrix(self.data[first:last], self.ggml_type, last - first, self.cols)


def _load_extension() -> Any:
    try:
        from pmetal.model import _qk  # type: ignore[attr-defined]
    except ImportError as exc:
        log.warning("pmetal.model._qk did not load (%s): kernels fall back to numpy, "
                    "about 100x slower; rebuild with pip install -e .", exc)
        return None
    wanted = os.environ.get("PMETAL_KERNEL_ISA", "auto").strip().lower() or "auto"
    if wanted not in ("auto", "scalar", "avx2", "neon"):
        raise ConfigError(f"PMETAL_KERNEL_ISA={wanted!r}: choose auto, scalar, avx2 or neon")
    try:
        chosen = _qk.select_isa(wanted)
    except ValueError as exc:
        raise ConfigError(f"PMETAL_KERNEL_ISA={wanted!r}: {exc}") from exc
    log.debug("quantized kernels: %s", chosen)
    return _qk


_qk = _load_extension()


def available() -> bool:
    """Whether the C extension loaded (when not, the numpy fallback runs)."""
    return _qk is not None


def isa() -> str:
    """The instruction set the kernels use: "avx2", "neon", "neon+dotprod",
    "scalar", or "numpy" when the extension is missing."""
    return _qk.isa() if _qk is not None else "numpy"


# ------------------------------------------------------------- validation

def _check_threads(threads: int) -> int:
    if not isinstance(threads, (int, np.integer)) or isinstance(threads, bool) or threads < 1:
        raise KernelError(f"threads must be an int >= 1, got {threads!r}")
    return int(threads)


def _check_range(w: QMatrix, first: int, last: int) -> None:
    for name, value in (("first", first), ("last", last)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise KernelError(f"{name} must be an int, got {value!r}")
    if not 0 <= first <= last <= w.rows:
        raise KernelError(f"rows [{first}, {last}) are not within [0, {w.rows})")


def _check_out(out: Any, shape: tuple[int, int], what: str) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.float32)
    if (type(out) is np.ndarray and out.dtype == np.float32 and out.shape == shape
            and out.flags.c_contiguous and out.flags.writeable):
        return out
    if not isinstance(out, np.ndarray) or out.dtype != np.float32:
        kind = out.dtype if isinstance(out, np.ndarray) else type(out).__name__
        raise KernelError(f"{what} must be a float32 numpy array, got {kind}")
    if out.shape != shape:
        raise KernelError(f"{what} has shape {out.shape}, expected {shape}")
    raise KernelError(f"{what} must be C-contiguous and writeable")


def _check_matrix(w: Any, what: str) -> QMatrix:
    if not isinstance(w, QMatrix):
        raise KernelError(f"{what} must be a QMatrix, got {type(w).__name__}")
    return w


# -------------------------------------------------------------------- API

def matmul(x: np.ndarray, weights: Sequence[QMatrix], *, threads: int = 1,
           out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """out[i] = x @ dequant(weights[i]).T, float32 (R, weights[i].rows), for x float32 C-contiguous (R, K),
    every weights[i].cols == K. ONE threaded dispatch covers all matrices (so q,k,v or gate,up need no fused copy).
    The bits of out[i][r] depend only on x[r] and weights[i]: never on R, on the other rows, on the other
    matrices, or on `threads` (each output element is computed start to finish by one thread, in a fixed order).
    The GIL is released while computing."""
    # Called a few hundred times per decoded token, so the common case costs
    # a few exact type tests; layout (C-contiguous, writeable) is checked by
    # the extension's buffer requests, and a refusal there is diagnosed here.
    if type(threads) is not int or threads < 1:
        threads = _check_threads(threads)
    if type(x) is not np.ndarray or x.dtype is not _F32 or x.ndim != 2:
        _refuse_x(x)
    if type(weights) not in (list, tuple) and (isinstance(weights, QMatrix)
                                              or not isinstance(weights, Sequence)):
        raise KernelError("weights must be a sequence of QMatrix")
    R, K = x.shape
    for i, w in enumerate(weights):
        if type(w) is not QMatrix:
            _check_matrix(w, f"weights[{i}]")
        if w.cols != K:
            raise KernelError(f"weights[{i}] has {w.cols} columns but x has K={K}")
    if out is None:
        outs = [np.empty((R, w.rows), _F32) for w in weights]
    else:
        outs = list(out)
        if len(outs) != len(weights):
            raise KernelError(f"out has {len(outs)} arrays for {len(weights)} matrices")
        for i, (o, w) in enumerate(zip(outs, weights)):
            if type(o) is not np.ndarray or o.dtype is not _F32 or o.shape != (R, w.rows):
                _check_out(o, (R, w.rows), f"out[{i}]")
        if len(outs) > 1 and len({id(o) for o in outs}) != len(outs):
            raise KernelError("out arrays must be distinct")
    if not outs:
        return outs
    if _qk is None:
        _check_layout(x, outs)
        for w, o in zip(weights, outs):
            step = _fallback_rows(w)
            for first in range(0, w.rows, step):
                last = min(w.rows, first + step)
                o[:, first:last] = x @ _numpy_dequantize(w, first, last).T
        return outs
    try:
        _qk.matmul(x, R, K, [w._spec for w in weights], outs, threads)
    except (BufferError, ValueError) as exc:
        _check_layout(x, outs)
        raise KernelError(f"the kernel refused its arguments: {exc}") from exc
    return outs


def _check_layout(x: np.ndarray, outs: list[np.ndarray]) -> None:
    if not x.flags.c_contiguous:
        raise KernelError("x must be C-contiguous")
    for i, o in enumerate(outs):
        if not o.flags.c_contiguous or not o.flags.writeable:
            raise KernelError(f"out[{i}] must be C-contiguous and writeable")


def _refuse_x(x: Any) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        kind = x.dtype if isinstance(x, np.ndarray) else type(x).__name__
        raise KernelError(f"x must be a float32 numpy array, got {kind}")
    if x.ndim != 2:
        raise KernelError(f"x must be 2-D (R, K), got shape {x.shape}")
    raise KernelError("x must be C-contiguous")


def dequantize(w: QMatrix, first: int = 0, last: int | None = None, *, out: np.ndarray | None = None,
               threads: int = 1) -> np.ndarray:
    """rows [first, last) as float32 (last-first, cols): for prefill tiles (the engine dequantizes a slice of
    rows at a time and uses numpy's GEMM) and for embedding rows."""
    w = _check_matrix(w, "w")
    threads = _check_threads(threads)
    last = w.rows if last is None else last
    _check_range(w, first, last)
    result = _check_out(out, (last - first, w.cols), "out")
    if _qk is not None:
        _qk.dequantize(w.data, w.ggml_type, w.rows, w.cols, first, last, result, threads, None)
        return result
    step = _fallback_rows(w)
    for lo in range(first, last, step):
        hi = min(last, lo + step)
        result[lo - first:hi - first] = _numpy_dequantize(w, lo, hi)
    return result


def take_rows(w: QMatrix, ids: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """float32 (len(ids), cols): embedding lookup; ids bounds-checked with a clear error."""
    w = _check_matrix(w, "w")
    ids = np.asarray(ids)
    if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
        raise KernelError(f"ids must be a 1-D integer array, got {ids.dtype} of shape {ids.shape}")
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= w.rows))
    if bad.size:
        raise KernelError(f"ids[{bad[0]}] = {ids[bad[0]]} is out of range for a matrix of "
                          f"{w.rows} rows ({bad.size} bad ids)")
    result = _check_out(out, (ids.size, w.cols), "out")
    if _qk is not None:
        _qk.dequantize(w.data, w.ggml_type, w.rows, w.cols, 0, 0, result, 1, ids)
        return result
    for i, row in enumerate(ids.tolist()):
        result[i] = _numpy_dequantize(w, row, row + 1)[0]
    return result


# ---------------------------------------------------------- numpy fallback

def _fallback_rows(w: QMatrix) -> int:
    return max(1, min(w.rows, _FALLBACK_BYTES // (4 * w.cols)))


def _numpy_dequantize(w: QMatrix, first: int, last: int) -> np.ndarray:
    """Rows [first, last) as float32 through the gguf package's dequantizer."""
    import gguf.quants

    return np.asarray(gguf.quants.dequantize(w.data[first:last], w.ggml_type),
                      dtype=np.float32).reshape(last - first, w.cols)

