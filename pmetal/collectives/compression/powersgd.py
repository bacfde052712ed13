"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): rank-``r``
gradient compression with one step of power iteration, warm-started from the
previous step's ``Q``.

A gradient reshaped to an ``n x m`` matrix ``M`` (first axis by the rest)
travels as two thin matrices, ``P`` (``n x r``) and ``Q`` (``m x r``), in two
all-reduces::

    P_i = M_i @ Q                  all-reduce P      (every rank, same Q)
    P^  = orthonormal(sum P_i)     numpy QR, identical on every rank
    Q_i = M_i.T @ P^               all-reduce Q
    approximation = P^ @ (sum Q_i).T

The approximation of the sum equals the sum of each rank's local
approximation ``P^ @ Q_i.T`` (the map is linear in ``Q_i``), which is what
makes it correct under reduction; each rank's error feedback keeps
``M_i - P^ @ Q_i.T``. Every rank must start from the same ``Q``: it is drawn
from the compressor's seed and the tensor's name, so ranks built with the
same :class:`~pmetal.collectives.compression.CompressionConfig` agree.

This module holds the per-tensor state machine; the compressor adds error
feedback, statistics and dtype handling around it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from pmetal.errors import PMetalValueError

__all__ = ["PowerSGDTensor", "eligible", "matrix_shape"]


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The ``n x m`` matrix a gradient of ``shape`` is viewed as: its first
    axis by the product of the others (a conv kernel's output channels by
    everything else)."""
    return shape[0], math.prod(shape[1:])


def eligible(shape: tuple[int, ...], rank: int) -> bool:
    """Whether rank-``rank`` factors are smaller than the tensor itself.

    Vectors (biases, norms) and matrices too thin for the rank are sent
    uncompressed: their factors would cost more bytes than they save."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    return (n + m) * rank < n * m


@dataclass
class PowerSGDTensor:
    """One tensor's power-iteration state across the three calls of a step
    (``p`` -> ``q`` -> ``finish``) and the ``Q`` carried to the next step."""

    name: str
    shape: tuple[int, int]
    q: np.ndarray                      # warm start, m x r, shared by all ranks
    matrix: np.ndarray | None = None   # this step's M (gradient + residual)
    p_hat: np.ndarray | None = None    # orthonormalised reduced P
    q_local: np.ndarray | None = None  # this rank's M.T @ P^

    @classmethod
    def start(cls, name: str, shape: tuple[int, int], rank: int, seed: int,
              dtype: np.dtype) -> PowerSGDTensor:
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        return cls(name, shape, rng.standard_normal((shape[1], rank)).astype(dtype))

    def p(self, matrix: np.ndarray) -> np.ndarray:
        # A step abandoned half way (a failed all-reduce) is simply
        # restarted: nothing of it reached the residual or the warm start.
        self.matrix, self.p_hat, self.q_local = matrix, None, None
        with np.errstate(over="ignore"):   # the caller refuses a product that overflowed
            return matrix @ self.q

    def q_step(self, p_reduced: np.ndarray) -> np.ndarray:
        if self.matrix is None:
            raise PMetalValueError(
                f"powersgd_q({self.name!r}) called before powersgd_p for this step")
        p_reduced = self._check("P", p_reduced, (self.shape[0], self.q.shape[1]))
        # Reduced QR of a rank-deficient P (a zero gradient) still returns
        # orthonormal columns, so the step never divides by zero.
        self.p_hat = np.linalg.qr(p_reduced)[0].astype(self.matrix.dtype)
        q_local = self.matrix.T @ self.p_hat
        if not np.isfinite(q_local).all():
            raise PMetalValueError(f"PowerSGD's Q for {self.name!r} overflowed: the gradient is"
                                   f" too large for {q_local.dtype}; clip it first")
        self.q_local = q_local
        # A copy: the caller all-reduces it in place, and the sum must not
        # replace this rank's own Q, which its error feedback needs.
        return q_local.copy()

    def finish(self, q_reduced: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The approximation of the reduced gradient, the local one (for
        error feedback) and this step's matrix; ``q_reduced`` becomes the
        next step's warm start."""
        if self.p_hat is None or self.q_local is None or self.matrix is None:
            raise PMetalValueError(
                f"powersgd_finish({self.name!r}) called before powersgd_q for this step")
        q_reduced = self._check("Q", q_reduced, self.q.shape)
        approx = self.p_hat @ q_reduced.T
        local = self.p_hat @ self.q_local.T
        matrix = self.matrix
        self.q = q_reduced.copy()
        self.matrix, self.p_hat, self.q_local = None, None, None
        return approx, local, matrix

    def _check(self, what: str, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        array = np.asarray(array)
        if array.shape != shape:
            raise PMetalValueError(
                f"PowerSGD {what} for {self.name!r} has shape {array.shape}, expected {shape}:"
                " every rank must reduce the factors of the same tensor with the same rank")
        if not np.isfinite(array).all():
            raise PMetalValueError(
                f"PowerSGD {what} for {self.name!r} contains NaN or inf after the reduction")
        return array.astype(self.q.dtype, copy=False)
