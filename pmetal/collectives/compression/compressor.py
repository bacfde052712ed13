"""The stateful half of compression: per tensor name, the error-feedback
residual, random-k's step count and PowerSGD's warm start."""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from pmetal.collectives.compression import codecs, powersgd
from pmetal.collectives.compression.base import (
    Compressed,
    CompressionConfig,
    CompressionStatistics,
    CompressionStrategy,
    work_dtype,
)
from pmetal.collectives.compression.reduce import decompress
from pmetal.errors import PMetalTypeError, PMetalValueError

__all__ = ["GradientCompressor"]



def _narrow(values: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """``values`` cast to ``dtype``, clipped to its finite range first: a
    float16 gradient's float32 residual, or float32 into fp16, can exceed
    it, and an inf would reach every rank. Error feedback keeps the excess."""
    limit = float(np.finfo(dtype).max)
    return np.clip(values, -limit, limit).astype(dtype)


def _as_numpy(array: Any, what: str) -> np.ndarray:
    if isinstance(array, np.ndarray):
        result = array
    elif type(array).__module__.startswith("mlx"):
        import mlx.core as mx  # only when the caller already uses MLX
        if array.dtype == mx.bfloat16:
            array = array.astype(mx.float32)
        result = np.array(array)
    else:
        raise PMetalTypeError(f"{what} must be a numpy or MLX array, not {type(array).__name__}")
    if result.dtype not in (np.float16, np.float32, np.float64):
        raise PMetalTypeError(
            f"{what} has dtype {result.dtype}; gradient compression takes float16, float32"
            " or float64 arrays")
    return result


class GradientCompressor:
    """Compresses named gradients step after step, keeping per name the
    error-feedback residual and PowerSGD's warm-start Q."""

    def __init__(self, config: CompressionConfig) -> None:
        if not isinstance(config, CompressionConfig):
            raise PMetalTypeError(
                f"GradientCompressor takes a CompressionConfig, not {type(config).__name__}")
        self.config = config
        self._residuals: dict[str, np.ndarray] = {}
        self._shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self._steps: dict[str, int] = {}
        self._powersgd: dict[str, powersgd.PowerSGDTensor] = {}
        self._tensors = self._uncompressed = self._bytes_in = self._bytes_out = 0

    # -- element-wise strategies --------------------------------------------

    def compress(self, name: str, array: Any) -> Compressed:
        """Compress ``array`` (plus ``name``'s residual) for the wire."""
        x = _as_numpy(array, f"gradient {name!r}")
        strategy = self.config.strategy
        if strategy is CompressionStrategy.POWERSGD:
            return self._compress_powersgd(name, x)
        if strategy is CompressionStrategy.NONE:
            self._count(x.nbytes, x.nbytes, uncompressed=False)
            return Compressed(name, strategy, x.shape, x.dtype, x.reshape(-1).copy())
        work = self._with_residual(name, x, (x.size,))
        compressed = self._encode(name, x, work)
        if self.config.error_feedback:
            with np.errstate(over="ignore"):   # _keep refuses a residual that overflowed
                self._keep(name, work - decompress(compressed).reshape(-1).astype(work.dtype))
        self._count(x.nbytes, compressed.nbytes, uncompressed=False)
        return compressed

    def decompress(self, compressed: Compressed) -> np.ndarray:
        """The tensor ``compressed`` stands for, in its shape and dtype."""
        return decompress(compressed)

    def _encode(self, name: str, x: np.ndarray, work: np.ndarray) -> Compressed:
        c = self.config
        s = c.strategy
        made = (name, s, x.shape, x.dtype)
        if s is CompressionStrategy.FP16:
            return Compressed(*made, _narrow(work, np.float16))
        if s is CompressionStrategy.BF16:
            return Compressed(*made, codecs.bf16_encode(
                np.clip(work, -codecs.BF16_MAX, codecs.BF16_MAX)))
        if s is CompressionStrategy.INT8:
            codes, scales = codecs.int8_encode(work, c.chunk_size)
            return Compressed(*made, codes, scales=scales, chunk_size=c.chunk_size)
        if s is CompressionStrategy.ONE_BIT:
            bits, scales = codecs.one_bit_encode(work, c.chunk_size)
            return Compressed(*made, bits, scales=scales, chunk_size=c.chunk_size)
        k = min(work.size, max(1, math.ceil(c.ratio * work.size))) if work.size else 0
        if s is CompressionStrategy.TOPK:
            indices = codecs.top_k_indices(work, k)
            return Compressed(*made, _narrow(work[indices], x.dtype), indices=indices)
        # RANDOM_K: draws depend on (seed, name, step) only, so ranks that
        # share a seed pick the same positions in the same step.
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        rng = np.random.default_rng([c.seed, zlib.crc32(name.encode()), step])
        indices = codecs.random_k_indices(rng, work.size, k)
        values = work[indices]
        if not c.error_feedback and k:
            values = values * (work.size / k)  # unbiased: E[decompressed] = input
        return Compressed(*made, _narrow(values, x.dtype), indices=indices)

    # -- PowerSGD -------------------------------------------------------------

    def powersgd_eligible(self, shape: tuple[int, ...]) -> bool:
        """Whether PowerSGD compresses a tensor of ``shape`` (see module doc)."""
        return powersgd.eligible(tuple(shape), self.config.rank)

    def powersgd_p(self, name: str, grad: Any) -> np.ndarray:
        """Step 1 of 3: this rank's ``P = M @ Q`` (M: ``grad`` plus its
        residual, as a matrix). All-reduce it (SUM) across the group."""
        x = _as_numpy(grad, f"gradient {name!r}")
        if not self.powersgd_eligible(x.shape):
            raise PMetalValueError(
                f"PowerSGD at rank {self.config.rank} cannot shrink {name!r} of shape {x.shape};"
                " all-reduce it uncompressed (check powersgd_eligible(shape) first)")
        shape = powersgd.matrix_shape(x.shape)
        matrix = self._with_residual(name, x, shape)
        state = self._powersgd.get(name)
        if state is None:
            state = powersgd.PowerSGDTensor.start(name, shape, self.config.rank,
                                                  self.config.seed, matrix.dtype)
            self._powersgd[name] = state
        p = state.p(matrix)
        if not np.isfinite(p).all():
            raise PMetalValueError(f"PowerSGD's P for {name!r} overflowed: the gradient is too"
                                   f" large for {matrix.dtype}; clip it first")
        self._count(x.nbytes, p.nbytes, uncompressed=False)
        return p

    def powersgd_q(self, name: str, p_reduced: Any) -> np.ndarray:
        """Step 2 of 3: orthonormalise the reduced P and return this rank's
        ``Q = M.T @ P^``. All-reduce it (SUM) across the group."""
        q = self._powersgd_state(name, "powersgd_q").q_step(
            _as_numpy(p_reduced, f"reduced P of {name!r}"))
        self._bytes_out += q.nbytes
        return q

    def powersgd_finish(self, name: str, q_reduced: Any) -> np.ndarray:
        """Step 3 of 3: the approximation of the reduced gradient, in the
        gradient's shape and dtype (a SUM of gradients if P and Q were
        summed). Keeps this rank's residual and the warm start."""
        state = self._powersgd_state(name, "powersgd_finish")
        approx, local, matrix = state.finish(_as_numpy(q_reduced, f"reduced Q of {name!r}"))
        if self.config.error_feedback:
            self._keep(name, matrix - local)
        shape, dtype = self._shapes[name]
        return approx.reshape(shape).astype(dtype)

    def _powersgd_state(self, name: str, call: str) -> powersgd.PowerSGDTensor:
        if self.config.strategy is not CompressionStrategy.POWERSGD:
            raise PMetalValueError(
                f"{call} needs a compressor configured with CompressionStrategy.POWERSGD,"
                f" this one uses {self.config.strategy.name}")
        state = self._powersgd.get(name)
        if state is None:
            raise PMetalValueError(f"{call}({name!r}) called before powersgd_p({name!r})")
        return state

    def _compress_powersgd(self, name: str, x: np.ndarray) -> Compressed:
        """The three steps with a group of one: for a single process, or for
        all-gathering factors instead of all-reducing them."""
        if not self.powersgd_eligible(x.shape):
            self._count(x.nbytes, x.nbytes, uncompressed=True)
            return Compressed(name, CompressionStrategy.NONE, x.shape, x.dtype,
                              x.reshape(-1).copy())
        p = self.powersgd_p(name, x)
        q = self.powersgd_q(name, p)
        state = self._powersgd[name]
        assert state.p_hat is not None  # set by powersgd_q
        p_hat = state.p_hat
        self.powersgd_finish(name, q)
        return Compressed(name, CompressionStrategy.POWERSGD, x.shape, x.dtype, p_hat, factor=q)

    # -- state ------------------------------------------------------------------

    def residual(self, name: str) -> np.ndarray | None:
        """A copy of what error feedback still owes ``name`` (flat for the
        element-wise strategies, a matrix for PowerSGD), or None."""
        residual = self._residuals.get(name)
        return None if residual is None else residual.copy()

    def reset(self, name: str | None = None) -> None:
        """Forget one tensor's state (or every tensor's): its residual, its
        random-k step count and PowerSGD's warm start. Needed when a tensor
        changes shape; on a group re-formed, all ranks must reset alike."""
        for table in (self._residuals, self._shapes, self._steps, self._powersgd):
            if name is None:
                table.clear()
            else:
                table.pop(name, None)

    def statistics(self) -> CompressionStatistics:
        return CompressionStatistics(self.config.strategy, self._tensors, self._uncompressed,
                                     self._bytes_in, self._bytes_out)

    def _count(self, bytes_in: int, bytes_out: int, *, uncompressed: bool) -> None:
        self._tensors += 1
        self._uncompressed += uncompressed
        self._bytes_in += bytes_in
        self._bytes_out += bytes_out

    def _check_shape(self, name: str, x: np.ndarray) -> None:
        known = self._shapes.setdefault(name, (x.shape, x.dtype))
        if known != (x.shape, x.dtype):
            raise PMetalValueError(
                f"gradient {name!r} was {known[0]} {known[1]} and is now {x.shape} {x.dtype};"
                f" its residual no longer fits: call reset({name!r}) first")

    def _with_residual(self, name: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """``x`` in working precision and ``shape``, plus what error feedback
        owes it; refuses NaN and inf without touching any state."""
        if not np.isfinite(x).all():
            raise PMetalValueError(
                f"gradient {name!r} contains NaN or inf; error feedback would carry it into"
                " every later step, so it was not compressed: skip this step or clip first")
        self._check_shape(name, x)
        work = x.reshape(shape).astype(work_dtype(x.dtype))
        residual = self._residuals.get(name)
        if residual is not None:
            with np.errstate(over="ignore"):   # an overflow is refused just below
                work += residual
            if not np.isfinite(work).all():
                raise PMetalValueError(
                    f"gradient {name!r} plus its error-feedback residual overflows {work.dtype};"
                    f" clip gradients, or call reset({name!r}) to drop the residual")
        return work

    def _keep(self, name: str, residual: np.ndarray) -> None:
        if not np.isfinite(residual).all():
            raise PMetalValueError(
                f"gradient {name!r} overflowed {residual.dtype} when compressed with"
                f" {self.config.strategy.name}; clip gradients first")
        self._residuals[name] = residual

