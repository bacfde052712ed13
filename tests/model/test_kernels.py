"""The quantized kernels of pmetal.model.kernels against float64 products.

Every supported format is checked against ``x @ W.T`` computed in float64
from ``gguf.quants.dequantize`` of the same bytes, with the error bound of the
module docstring (derived in docs/kernels.md), u = 2**-24:

* quantized weights: ``|y - y64| <= sum_b delta_b sum_{i in b} |c_i|
  + gamma(n_b + 8) sum_i mag_i (|x_i| + delta_b) + u sum_i |w_i x_i|``,
  ``delta_b = max_b |x| / 254 (1 + 2**-14)``; the last term is the rounding of
  gguf's own float32 dequantization (Q4_1, Q5_1, the K-quants);
* float weights: ``|y - y64| <= gamma(ceil(K/8) + 12) sum_i |w_i x_i|``.

gguf can quantize F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 but not the K-quants:
their matrices are random valid blocks (random quant bits and scale bytes,
sane random fp16 super-scales).  Every ISA this machine can run is checked.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from gguf.quants import Q4_K as GQ4_K
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pmetal.errors import PMetalValueError
from pmetal.model import kernels as kn
from pmetal.model.kernels import QMatrix

U = 2.0 ** -24
ALL = [kn.F32, kn.F16, kn.BF16, kn.Q4_0, kn.Q4_1, kn.Q5_0, kn.Q5_1, kn.Q8_0, kn.Q4_K, kn.Q5_K,
       kn.Q6_K]
NAMES = {kn.F32: "F32", kn.F16: "F16", kn.BF16: "BF16", kn.Q4_0: "Q4_0", kn.Q4_1: "Q4_1",
         kn.Q5_0: "Q5_0", kn.Q5_1: "Q5_1", kn.Q8_0: "Q8_0", kn.Q4_K: "Q4_K", kn.Q5_K: "Q5_K", kn.Q6_K: "Q6_K"}
K_QUANTS = (kn.Q4_K, kn.Q5_K, kn.Q6_K)
FLOATS = (kn.F32, kn.F16, kn.BF16)
needs_c = pytest.mark.skipif(not kn.available(), reason="the C extension did not build")


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def random_matrix(ggml_type: int, rows: int, cols: int, seed: int = 0) -> QMatrix:
    """A (rows, cols) QMatrix of random weights: gguf-quantized when gguf can,
    else random valid K-quant blocks."""
    rng = np.random.default_rng(seed)
    per_block, nbytes = kn.block_shape(ggml_type)
    if ggml_type not in K_QUANTS:
        w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 1.0, (rows, 1))).astype(np.float32)
        data = gguf_quantize(w, ggml_type).view(np.uint8).reshape(rows, -1)
        return QMatrix(np.ascontiguousarray(data), ggml_type, rows, cols)
    nb = rows * cols // per_block
    blocks = rng.integers(0, 256, (nb, nbytes), dtype=np.uint8)

    def fp16(scale: float) -> np.ndarray:
        return (rng.uniform(0.2, 1.0, nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)

    if ggml_type == kn.Q6_K:
        blocks[:, 208:210] = fp16(0.002)
    else:
        blocks[:, 0:2] = fp16(0.01)
        blocks[:, 2:4] = fp16(0.005)
    return QMatrix(blocks.reshape(rows, -1), ggml_type, rows, cols)


def random_x(rows: int, cols: int, seed: int = 1) -> np.ndarray:
    """Rows of varied scale, one of them zero and one with an outlier."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * rng.uniform(0.1, 3.0, (rows, 1))
    if rows > 2:
        x[1] = 0.0
        x[2, cols // 2] = 50.0
    return x.astype(np.float32)


def parts(w: QMatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(w, c, mag) in float64, each (rows, cols): the dequantized weights, the
    part of each weight that multiplies the quantized x, and the sum of the
    magnitudes of a weight's scale and min parts."""
    full = gguf_dequantize(w.data, w.ggml_type).astype(np.float64).reshape(w.rows, w.cols)
    if w.ggml_type in (kn.Q4_1, kn.Q5_1):
        blocks = w.data.reshape(-1, kn.block_shape(w.ggml_type)[1])
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
        m = np.repeat(m.reshape(-1), 32).reshape(w.rows, w.cols)
        c = full - m
        return full, c, np.abs(c) + np.abs(m)
    if w.ggml_type in (kn.Q4_K, kn.Q5_K):
        nbytes = kn.block_shape(w.ggml_type)[1]
        blocks = w.data.reshape(-1, nbytes)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
        _, mins = GQ4_K.get_scale_min(blocks[:, 4:16].copy())
        m = np.repeat((dmin * mins.astype(np.float64)).reshape(-1), 32).reshape(w.rows, w.cols)
        return full, full, np.abs(full + m) + np.abs(m)
    return full, full, np.abs(full)


def bound(w: QMatrix, x: np.ndarray) -> np.ndarray:
    """(R, rows) error bound of matmul(x, [w]) against float64."""
    full, c, mag = parts(w)
    x64 = x.astype(np.float64)
    ax = np.abs(x64)
    wx = ax @ np.abs(full).T
    if w.ggml_type in FLOATS:
        return gamma(math.ceil(w.cols / 8) + 12) * wx
    per = 256 if w.ggml_type in K_QUANTS else 32
    R, K = x.shape
    delta = ax.reshape(R, K // per, per).max(axis=2) / 254 * (1 + 2.0 ** -14)
    delta_i = np.repeat(delta, per, axis=1)
    quant = delta_i @ np.abs(c).T
    rounding = gamma(K // per + 8) * ((ax + delta_i) @ mag.T)
    return quant + rounding + U * wx


def reference(w: QMatrix, x: np.ndarray) -> np.ndarray:
    full = gguf_dequantize(w.data, w.ggml_type).astype(np.float64).reshape(w.rows, w.cols)
    return x.astype(np.float64) @ full.T


def isas() -> list[str]:
    if not kn.available():
        return ["numpy"]
    found = []
    for name in ("scalar", "avx2", "neon"):
        try:
            kn._qk.select_isa(name)
        except ValueError:
            continue
        found.append(name)
    kn._qk.select_isa(os.environ.get("PMETAL_KERNEL_ISA", "auto"))
    return found


@pytest.fixture(params=isas())
def each_isa(request: pytest.FixtureRequest):
    """Runs a test once per instruction set this machine and build have."""
    if request.param != "numpy":
        kn._qk.select_isa(request.param)
    yield request.param
    if request.param != "numpy":
        kn._qk.select_isa(os.environ.get("PMETAL_KERNEL_ISA", "auto"))


def ks(ggml_type: int) -> list[int]:
    per = kn.block_shape(ggml_type)[0]
    if per == 1:
        return [1, 7, 40, 576]
    if per == 32:
        return [32, 96, 576]
    return [256, 768, 1536]


CASES = [(t, k) for t in ALL for k in ks(t)]


# ----------------------------------------------------------- accuracy

@pytest.mark.parametrize("ggml_type,K", CASES, ids=[f"{NAMES[t]}-K{k}" for t, k in CASES])
def test_matmul_is_within_the_error_bound(each_isa: str, ggml_type: int, K: int) -> None:
    if each_isa == "numpy":
        pytest.skip("the numpy fallback does not quantize x; see test_the_numpy_fallback")
    x = random_x(9, K)
    for N in (1, 67):
        w = random_matrix(ggml_type, N, K, seed=N)
        y = kn.matmul(x, [w], threads=2)[0]
        err = np.abs(y - reference(w, x))
        limit = bound(w, x)
        worst = np.unravel_index(np.argmax(err - limit), err.shape)
        assert (err <= limit).all(), (f"{NAMES[ggml_type]} K={K} N={N} isa={each_isa}: error "
                                      f"{err[worst]:.3g} > bound {limit[worst]:.3g} at {worst}")
        assert (y[1] == 0).all()   # a zero x row gives exact zeros


@pytest.mark.parametrize("ggml_type", ALL, ids=[NAMES[t] for t in ALL])
def test_dequantize_and_take_rows_match_gguf_bit_for_bit(each_isa: str, ggml_type: int) -> None:
    K = ks(ggml_type)[1]
    w = random_matrix(ggml_type, 70, K)
    expected = gguf_dequantize(w.data, ggml_type).reshape(70, K)
    assert np.array_equal(kn.dequantize(w, threads=2), expected)
    assert np.array_equal(kn.dequantize(w, 3, 68, threads=3), expected[3:68])
    out = np.full((0, K), 7, np.float32)
    assert kn.dequantize(w, 5, 5, out=out) is out
    ids = np.array([69, 0, 5, 5, 33])
    assert np.array_equal(kn.take_rows(w, ids), expected[ids])
    assert np.array_equal(kn.dequantize(w.rows_view(10, 20)), expected[10:20])


@pytest.mark.parametrize("ggml_type", [kn.Q5_0, kn.Q5_1], ids=["Q5_0", "Q5_1"])
def test_q5_blocks_of_random_bytes(each_isa: str, ggml_type: int) -> None:
    """Every fifth-bit pattern and sign of d and m, not only what gguf's
    quantizer writes: random block bytes with sane fp16 scales."""
    rows, K = 37, 160
    rng = np.random.default_rng(ggml_type)
    nbytes = kn.block_shape(ggml_type)[1]
    blocks = rng.integers(0, 256, (rows * K // 32, nbytes), dtype=np.uint8)
    for offset in (0, 2) if ggml_type == kn.Q5_1 else (0,):
        scales = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    blocks[0, 2 + 2 * (ggml_type == kn.Q5_1):][:4] = 255   # all fifth bits set
    blocks[1, 2 + 2 * (ggml_type == kn.Q5_1):][:4] = 0     # none
    w = QMatrix(blocks.reshape(rows, -1), ggml_type, rows, K)
    expected = gguf_dequantize(w.data, ggml_type).reshape(rows, K)
    assert np.array_equal(kn.dequantize(w, threads=2), expected)
    assert np.array_equal(kn.take_rows(w, np.array([36, 0])), expected[[36, 0]])
    if each_isa == "numpy":
        return
    x = random_x(6, K)
    y = kn.matmul(x, [w], threads=2)[0]
    assert (np.abs(y - reference(w, x)) <= bound(w, x)).all()


@needs_c
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ggml_type=st.sampled_from(ALL), blocks=st.integers(1, 6), rows=st.integers(1, 90),
       R=st.integers(1, 9), seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-3, 1e3))
def test_random_shapes_stay_within_the_bound(ggml_type: int, blocks: int, rows: int, R: int,
                                             seed: int, scale: float) -> None:
    K = blocks * max(8, kn.block_shape(ggml_type)[0])
    w = random_matrix(ggml_type, rows, K, seed)
    x = (random_x(R, K, seed + 1) * scale).astype(np.float32)
    y = kn.matmul(x, [w], threads=1 + seed % 3)[0]
    assert (np.abs(y - reference(w, x)) <= bound(w, x)).all()


# -------------------------------------------------------- determinism

@needs_c
@pytest.mark.parametrize("ggml_type", ALL, ids=[NAMES[t] for t in ALL])
def test_bits_of_a_row_depend_only_on_its_x_row_and_weights(ggml_type: int) -> None:
    K = ks(ggml_type)[-1]
    mats = [random_matrix(ggml_type, n, K, seed=n) for n in (67, 1, 130)]
    x = random_x(40, K)
    alone = [kn.matmul(x[r:r + 1], mats, threads=1) for r in range(9)]
    for threads in (1, 2, 3):
        together = kn.matmul(x, mats, threads=threads)
        for r in range(9):
            for a, b in zip(alone[r], together):
                assert np.array_equal(a[0], b[r]), (threads, r)
        for R in range(1, 10):
            part = kn.matmul(x[:R], mats, threads=threads)
            assert all(np.array_equal(p, t[:R]) for p, t in zip(part, together))
        separate = [kn.matmul(x, [m], threads=threads)[0] for m in mats]
        assert all(np.array_equal(s, t) for s, t in zip(separate, together))
    # a row's bits do not depend on where a rows_view starts either
    view = mats[2].rows_view(3, 100)
    assert np.array_equal(kn.matmul(x, [view])[0], together[2][:, 3:100])


@needs_c
def test_one_call_mixes_formats_and_large_R() -> None:
    K = 768
    mats = [random_matrix(t, 50, K, seed=t) for t in ALL]
    x = random_x(70, K)
    ys = kn.matmul(x, mats, threads=2)
    for w, y in zip(mats, ys):
        assert y.shape == (70, 50)
        assert (np.abs(y - reference(w, x)) <= bound(w, x)).all(), NAMES[w.ggml_type]


def test_the_output_arrays_are_filled_in_place() -> None:
    K = 64
    mats = [random_matrix(kn.Q8_0, 10, K), random_matrix(kn.Q4_1, 20, K)]
    x = random_x(3, K)
    outs = [np.full((3, 10), np.nan, np.float32), np.full((3, 20), np.nan, np.float32)]
    ys = kn.matmul(x, mats, out=outs)
    assert ys[0] is outs[0] and ys[1] is outs[1]
    assert np.isfinite(outs[0]).all() and np.isfinite(outs[1]).all()
    assert kn.matmul(x, []) == []
    assert kn.matmul(np.zeros((0, K), np.float32), mats)[1].shape == (0, 20)


@needs_c
def test_concurrent_callers_get_the_same_bits() -> None:
    """Two Python threads (the GIL is released) calling with threads=2 at once:
    one runs on the pool, the other computes alone; both get the one answer."""
    w = random_matrix(kn.Q4_1, 700, 576)
    x = random_x(3, 576)
    expected = kn.matmul(x, [w])[0]
    results: list[bool] = []

    def hammer() -> None:
        results.append(all(np.array_equal(kn.matmul(x, [w], threads=2)[0], expected)
                           for _ in range(40)))

    workers = [threading.Thread(target=hammer) for _ in range(3)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in workers)
    assert results == [True, True, True]


# ---------------------------------------------- fallback, scalar, fork

def test_the_numpy_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    K = 256
    mats = [random_matrix(t, 33, K, seed=t) for t in ALL]
    x = random_x(4, K)
    monkeypatch.setattr(kn, "_qk", None)
    monkeypatch.setattr(kn, "_FALLBACK_BYTES", 4 * K * 10)   # several slices per matrix
    assert not kn.available() and kn.isa() == "numpy"
    for w, y in zip(mats, kn.matmul(x, mats, threads=2)):
        assert np.allclose(y, reference(w, x), rtol=1e-5, atol=1e-4 * np.abs(x).max())
        expected = gguf_dequantize(w.data, w.ggml_type).reshape(33, K)
        assert np.array_equal(kn.dequantize(w, 2, 31), expected[2:31])
        assert np.array_equal(kn.take_rows(w, np.array([3, 0])), expected[[3, 0]])


@needs_c
def test_the_scalar_build_is_chosen_by_environment_and_agrees(tmp_path: Path) -> None:
    """PMETAL_KERNEL_ISA=scalar, read at import, in a fresh process; its
    results obey the same bound as the vector kernels'."""
    K = 512
    x = random_x(5, K)
    np.save(tmp_path / "x.npy", x)
    code = ("import sys, numpy as np\n"
            "from pmetal.model import kernels as kn\n"
            "from tests.model.test_kernels import ALL, random_matrix\n"
            "x = np.load(sys.argv[1])\n"
            "ys = kn.matmul(x, [random_matrix(t, 40, x.shape[1], seed=t) for t in ALL], threads=2)\n"
            "np.savez(sys.argv[2], *ys)\n"
            "print(kn.isa())\n")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PMETAL_KERNEL_ISA": "scalar",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.npy"), str(tmp_path / "y.npz")],
                          capture_output=True, text=True, timeout=60, env=env, cwd=root, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "scalar"
    scalar = np.load(tmp_path / "y.npz")
    mats = [random_matrix(t, 40, K, seed=t) for t in ALL]
    for i, (w, y) in enumerate(zip(mats, kn.matmul(x, mats))):
        limit = bound(w, x)
        assert (np.abs(scalar[f"arr_{i}"] - reference(w, x)) <= limit).all(), NAMES[w.ggml_type]
        assert (np.abs(scalar[f"arr_{i}"] - y) <= 2 * limit).all(), NAMES[w.ggml_type]


def test_an_unknown_isa_in_the_environment_is_a_config_error() -> None:
    env = {**os.environ, "PMETAL_KERNEL_ISA": "sse9"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", "import pmetal.model.kernels"], capture_output=True,
                          text=True, timeout=60, env=env, check=False)
    if kn.available():
        assert done.returncode != 0 and "ConfigError" in done.stderr and "sse9" in done.stderr
    else:
        assert done.returncode == 0


def _in_child(queue: multiprocessing.Queue) -> None:   # type: ignore[type-arg]
    w = random_matrix(kn.Q4_1, 300, 576)
    x = random_x(4, 576)
    queue.put(kn.matmul(x, [w], threads=3)[0])


@needs_c
def test_the_pool_works_in_a_forked_child() -> None:
    w = random_matrix(kn.Q4_1, 300, 576)
    x = random_x(4, 576)
    expected = kn.matmul(x, [w], threads=3)[0]   # the parent's pool now has workers
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(queue,))
    child.start()
    try:
        got = queue.get(timeout=60)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert np.array_equal(got, expected)


# ----------------------------------------------------------- bad input

def test_block_shape() -> None:
    assert kn.block_shape(kn.Q4_1) == (32, 20)
    assert kn.block_shape(kn.Q6_K) == (256, 210)
    assert kn.SUPPORTED == frozenset(ALL)
    assert kn.block_shape(kn.Q5_0) == (32, 22) and kn.block_shape(kn.Q5_1) == (32, 24)
    with pytest.raises(kn.KernelError, match="ggml type 10 is not supported"):
        kn.block_shape(10)
    assert issubclass(kn.KernelError, PMetalValueError) and issubclass(kn.KernelError, ValueError)


def test_bad_matrices_are_refused_with_the_reason() -> None:
    good = random_matrix(kn.Q8_0, 4, 64).data
    cases = [
        (lambda: QMatrix(good, 10, 4, 64), "not supported"),
        (lambda: QMatrix(good, kn.Q8_0, 4, 48), "multiple of the block size 32"),
        (lambda: QMatrix(good, kn.Q8_0, 5, 64), r"shape \(4, 68\), expected \(5, 68\)"),
        (lambda: QMatrix(good.view(np.int8), kn.Q8_0, 4, 64), "uint8"),
        (lambda: QMatrix(good.reshape(-1), kn.Q8_0, 4, 64), "shape"),
        (lambda: QMatrix(np.asfortranarray(np.zeros((4, 68), np.uint8)), kn.Q8_0, 4, 64),
         "C-contiguous"),
        (lambda: QMatrix(good, kn.Q8_0, -1, 64), "rows must be an int >= 0"),
        (lambda: QMatrix(good, kn.Q8_0, 4, 64).rows_view(3, 5), r"rows \[3, 5\)"),
    ]
    for make, message in cases:
        with pytest.raises(kn.KernelError, match=message):
            make()


def test_bad_arguments_are_refused_with_the_reason() -> None:
    w = random_matrix(kn.Q4_1, 10, 64)
    x = random_x(2, 64)
    cases = [
        (lambda: kn.matmul(x.astype(np.float64), [w]), "x must be a float32"),
        (lambda: kn.matmul(x[0], [w]), "x must be 2-D"),
        (lambda: kn.matmul(np.asfortranarray(random_x(3, 64)), [w]), "x must be C-contiguous"),
        (lambda: kn.matmul(random_x(2, 96), [w]), "has 64 columns but x has K=96"),
        (lambda: kn.matmul(x, w), "sequence of QMatrix"),
        (lambda: kn.matmul(x, [w.data]), r"weights\[0\] must be a QMatrix"),
        (lambda: kn.matmul(x, [w], threads=0), "threads must be an int >= 1"),
        (lambda: kn.matmul(x, [w], out=[np.empty((2, 9), np.float32)]),
         r"out\[0\] has shape \(2, 9\), expected \(2, 10\)"),
        (lambda: kn.matmul(x, [w], out=[np.empty((2, 10))]), r"out\[0\] must be a float32"),
        (lambda: kn.matmul(x, [w], out=[]), "out has 0 arrays for 1 matrices"),
        (lambda: kn.dequantize(w, 4, 2), r"rows \[4, 2\)"),
        (lambda: kn.dequantize(w, 0, 11), r"rows \[0, 11\)"),
        (lambda: kn.dequantize(w, out=np.empty((10, 64), np.float32)[:, ::2].copy()), "shape"),
        (lambda: kn.take_rows(w, np.array([0, 10])), r"ids\[1\] = 10 is out of range"),
        (lambda: kn.take_rows(w, np.array([-1])), r"ids\[0\] = -1"),
        (lambda: kn.take_rows(w, np.array([0.5])), "integer"),
    ]
    for call, message in cases:
        with pytest.raises(kn.KernelError, match=message):
            call()


def _helper_cpu_ns() -> int:
    """CPU time used so far by every thread of this process but the main one
    (Linux schedstat: nanoseconds on the CPU)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == os.getpid():
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:   # the thread ended meanwhile
            continue
    return total


@needs_c
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_an_idle_pool_burns_no_cpu() -> None:
    """Workers spin for ~50 us after a job, then sleep: over a quiet 300 ms
    window they use well under 10 ms of CPU (a spinning pool would use 300)."""
    w = random_matrix(kn.Q4_1, 600, 576)
    x = random_x(1, 576)
    for _ in range(50):
        kn.matmul(x, [w], threads=3)
    before = _helper_cpu_ns()
    threading.Event().wait(0.3)   # the measurement window, not a synchronisation
    assert _helper_cpu_ns() - before < 10_000_000
