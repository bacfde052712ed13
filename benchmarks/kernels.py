"""Quantized kernel throughput: GB/s of quantized weight bytes read per second.

    python -m benchmarks kernels            # every format, R = 1 and 4, 1 and 2 threads
    python -m benchmarks kernels --quick    # shorter timings

With the default model stored (``pmetal models fetch``), a last table times a
whole decode step's products over that model's weights (:func:`measure_model`).

A decode step reads every weight once, so GB/s of quantized bytes is the
figure to compare with llama.cpp (about 10 GB/s with 2 threads on this kind
of machine) and with the numpy fallback (dequantize a slice, then a GEMM).
The shapes are SmolLM2-135M's: K=576 with N=1536 (MLP up), K=1536 with N=576
(MLP down) and K=576 with N=49152 (the vocabulary projection).  K-quants need
K to be a multiple of 256, so llama.cpp stores K=576 matrices of a K-quant
model in another format; their K=576 cells are empty.

:func:`measure` is the reusable piece (the pipeline bench may call it); each
figure is the median (and the best) of repeated timed calls on the same
weights, which stay in cache for the two smaller shapes and stream from
memory for N=49152.  On a shared machine the two differ a lot: the load
average is printed with the tables.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks.common import table
from pmetal.model import kernels as kn

FORMATS = {"Q4_0": kn.Q4_0, "Q4_1": kn.Q4_1, "Q5_0": kn.Q5_0, "Q5_1": kn.Q5_1, "Q8_0": kn.Q8_0,
           "Q4_K": kn.Q4_K, "Q5_K": kn.Q5_K, "Q6_K": kn.Q6_K, "F16": kn.F16, "BF16": kn.BF16, "F32": kn.F32}
SHAPES = [(576, 1536), (1536, 576), (576, 49152)]
# Where each format keeps its fp16 scales: offset within the block.
_SCALES = {kn.Q4_0: (0,), kn.Q4_1: (0, 2), kn.Q5_0: (0,), kn.Q5_1: (0, 2), kn.Q8_0: (0,),
           kn.Q4_K: (0, 2), kn.Q5_K: (0, 2), kn.Q6_K: (208,)}


def random_matrix(ggml_type: int, rows: int, cols: int, seed: int = 0) -> kn.QMatrix:
    """Random valid blocks: random quant bits, small finite fp16 scales."""
    rng = np.random.default_rng(seed)
    per_block, nbytes = kn.block_shape(ggml_type)
    if ggml_type in (kn.F32, kn.F16):
        values = rng.standard_normal((rows, cols)).astype(np.float32 if ggml_type == kn.F32 else np.float16)
        return kn.QMatrix(values.view(np.uint8), ggml_type, rows, cols)
    if ggml_type == kn.BF16:
        values = rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16
        return kn.QMatrix(values.astype(np.uint16).view(np.uint8), ggml_type, rows, cols)
    blocks = rng.integers(0, 256, (rows * cols // per_block, nbytes), dtype=np.uint8)
    for offset in _SCALES[ggml_type]:
        scales = rng.uniform(0.001, 0.01, len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return kn.QMatrix(blocks.reshape(rows, -1), ggml_type, rows, cols)


@dataclass(frozen=True)
class Rate:
    """GB/s of quantized bytes: the median call, and the fastest (what the
    code does when the machine leaves it alone)."""

    median: float
    best: float


def _rate(nbytes: int, call: Callable[[], object], budget: float) -> Rate:
    call()   # warm: pool threads, caches, page faults
    times: list[float] = []
    end = time.perf_counter() + budget
    while len(times) < 5 or (time.perf_counter() < end and len(times) < 2000):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return Rate(nbytes / statistics.median(times) / 1e9, nbytes / min(times) / 1e9)


def measure(ggml_type: int, K: int, N: int, R: int, threads: int, *, budget: float = 0.3,
            numpy_fallback: bool = False) -> Rate:
    """GB/s of quantized bytes for one matmul of R rows against a K x N matrix
    (``numpy_fallback``: gguf's dequantize of the whole matrix plus a numpy
    product, the path without the extension, single-threaded dequantization)."""
    w = random_matrix(ggml_type, N, K)
    x = np.random.default_rng(1).standard_normal((R, K)).astype(np.float32)
    if numpy_fallback:
        import gguf.quants

        def call() -> object:
            return x @ gguf.quants.dequantize(w.data, ggml_type).T
    else:
        out = [np.empty((R, N), np.float32)]

        def call() -> object:
            return kn.matmul(x, [w], threads=threads, out=out)
    return _rate(w.nbytes, call, budget)


def measure_dequantize(ggml_type: int, K: int, N: int, threads: int, *, budget: float = 0.3) -> Rate:
    """GB/s of quantized bytes turned into float32 rows by :func:`kn.dequantize`."""
    w = random_matrix(ggml_type, N, K)
    out = np.empty((N, K), np.float32)
    return _rate(w.nbytes, lambda: kn.dequantize(w, out=out, threads=threads), budget)


def measure_model(path: str | os.PathLike[str], R: int, threads: int, *, budget: float = 1.0) -> Rate:
    """GB/s of quantized bytes for one decode step's products over every
    layer of a Llama-style GGUF model (q,k,v together, o, gate+up together,
    down, then the vocabulary projection), the weights left in the file's
    memory map: the figure that includes streaming the whole model from
    memory and the per-call overheads."""
    from pmetal.pipeline.gguf_file import GGUFFile

    info = GGUFFile(path).tensors
    raw = np.memmap(path, np.uint8, mode="r")

    def matrix(name: str) -> kn.QMatrix:
        t = info[name]
        rows, cols = t.shape
        per_block, nbytes = kn.block_shape(t.ggml_type)
        data = raw[t.offset:t.offset + t.nbytes].reshape(rows, cols // per_block * nbytes)
        return kn.QMatrix(data, t.ggml_type, rows, cols)

    blocks = sorted({int(n.split(".")[1]) for n in info if n.startswith("blk.")})
    layers = [{part: matrix(f"blk.{b}.{part}.weight") for part in
               ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
              for b in blocks]
    head = matrix("output.weight" if "output.weight" in info else "token_embd.weight")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((R, head.cols)).astype(np.float32)
    h = rng.standard_normal((R, layers[0]["ffn_down"].cols)).astype(np.float32)

    def step() -> object:
        for m in layers:
            kn.matmul(x, [m["attn_q"], m["attn_k"], m["attn_v"]], threads=threads)
            kn.matmul(x, [m["attn_output"]], threads=threads)
            kn.matmul(x, [m["ffn_gate"], m["ffn_up"]], threads=threads)
            kn.matmul(h, [m["ffn_down"]], threads=threads)
        return kn.matmul(x, [head], threads=threads)

    nbytes = sum(w.nbytes for m in layers for w in m.values()) + head.nbytes
    return _rate(nbytes, step, budget)


def _cells(rates: list[Rate]) -> list[object]:
    return [c for r in rates for c in (r.median, r.best)]


def main(quick: bool = False) -> int:
    budget = 0.05 if quick else 0.4
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nquantized kernels: isa={kn.isa()}, extension {'loaded' if kn.available() else 'MISSING'}, "
          f"{os.cpu_count()} CPUs, load average {load:.2f} at the start")
    header = ["format", "K x N", "R", "1 thread median", "best", "2 threads median", "best"]
    rows = []
    for name, ggml_type in FORMATS.items():
        per_block = kn.block_shape(ggml_type)[0]
        for K, N in SHAPES:
            if K % per_block:
                continue
            for R in (1, 4):
                rates = [measure(ggml_type, K, N, R, t, budget=budget) for t in (1, 2)]
                rows.append([name, f"{K} x {N}", R, *_cells(rates)])
    print(table("matmul (decode): GB/s of quantized bytes", header, rows))
    rows = []
    for name in ("Q4_1", "Q8_0", "F16"):
        rate = measure(FORMATS[name], 576, 1536, 1, 1, budget=budget, numpy_fallback=True)
        rows.append([name, "576 x 1536", 1, rate.median, rate.best, "-", "-"])
    print(table("numpy fallback: gguf dequantize + numpy product, GB/s", header, rows))
    rows = []
    for name, ggml_type in FORMATS.items():
        K, N = (576, 1536) if kn.block_shape(ggml_type)[0] <= 32 else (1536, 576)
        rates = [measure_dequantize(ggml_type, K, N, t, budget=budget) for t in (1, 2)]
        rows.append([name, f"{K} x {N}", "-", *_cells(rates)])
    print(table("dequantize (prefill tiles): GB/s of quantized bytes", header, rows))
    from pmetal.errors import PMetalError
    from pmetal.pipeline.models import resolve_model

    try:
        model = resolve_model(fetch=False)
    except PMetalError as exc:
        print(f"\n(no whole-model figures: {exc})")
    else:
        rows = [[model.name, "all layers + head", R,
                 *_cells([measure_model(model, R, t, budget=4 * budget) for t in (1, 2)])]
                for R in (1, 4)]
        print(table("a whole decode step, weights streamed from the memory map: GB/s", header, rows))
    if hasattr(os, "getloadavg"):
        print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main(quick="--quick" in sys.argv))
