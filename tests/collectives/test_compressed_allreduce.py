"""Compressed all-reduce over real TCP links: every rank a thread of this
process with its own group, its own sockets on 127.0.0.1 and its own
compressor. Results are compared bit for bit with what the compression
module computes from the same gradients in one process."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import pmetal
from pmetal.collectives import (
    CompressionConfig,
    CompressionStrategy,
    GradientCompressor,
    ReduceOp,
    aggregate,
    all_reduce_compressed,
    all_reduce_compressed_many,
    chunk_bounds,
    decompress,
    traffic,
)
from pmetal.collectives.group import Group
from pmetal.config import CollectiveConfig
from pmetal.errors import CollectiveError, PMetalTypeError, PMetalValueError

S = CompressionStrategy
GATHERED = [s for s in S if s not in (S.NONE, S.POWERSGD)]
DEADLINE = 30.0
"""Seconds for a whole world's run; each takes well under one."""


def free_ports(count: int) -> list[int]:
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run_world(world: int, body: Callable[[Group], Any]) -> list[Any]:
    """``body(group)`` on every rank of a fresh world; its results in rank
    order, or the first rank's exception re-raised."""
    nodes = [f"127.0.0.1:{p}" for p in free_ports(world)]
    collectives = CollectiveConfig(timeout=5.0, connect_timeout=10.0)
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def rank_main(rank: int) -> None:
        config = pmetal.DistributedConfig(nodes=nodes, rank=rank, collectives=collectives)
        try:
            with pmetal.DistributedContext(pmetal.RingBackend(config)) as ctx:
                results[rank] = body(ctx.group)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test thread below
            errors[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
        assert not t.is_alive(), "a rank did not finish within the deadline"
    for error in errors:
        if error is not None:
            raise error
    return results


def gradients(rank: int, step: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([rank, step])
    return {"w": rng.standard_normal((48, 33)).astype(np.float32),
            "b": rng.standard_normal(7).astype(np.float32),
            "empty": np.zeros(0, np.float32)}


def config(strategy: CompressionStrategy) -> CompressionConfig:
    return CompressionConfig(strategy=strategy, ratio=0.05, chunk_size=256)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("strategy", GATHERED, ids=lambda s: s.name)
def test_every_rank_gets_the_sum_of_decompressed_gradients_bit_for_bit(
        world: int, strategy: CompressionStrategy) -> None:
    steps = 3

    def body(group: Group) -> list[dict[str, np.ndarray]]:
        compressor = GradientCompressor(config(strategy))
        out = []
        for step in range(steps):
            grads = gradients(group.rank, step)
            returned = all_reduce_compressed_many(group, grads, compressor, ReduceOp.SUM)
            assert all(returned[k] is grads[k] for k in grads)  # numpy: in place
            out.append(grads)
        return out

    results = run_world(world, body)
    expected = reference(strategy, world, steps)
    for step in range(steps):
        for name in ("w", "b", "empty"):
            for rank in range(world):
                got = results[rank][step][name]
                want = expected[step][name]
                assert got.dtype == np.float32 and got.shape == want.shape
                assert np.array_equal(got, want), (strategy, world, rank, step, name)


def reference(strategy: CompressionStrategy, world: int,
              steps: int) -> list[dict[str, np.ndarray]]:
    """The same compressors and gradients, reduced in one process: sparse
    strategies (and any strategy with 2 ranks) all-gathered and summed;
    quantizers with 3 ranks or more reduced block-wise, rank j summing
    block j and compressing it again under ``name[j/world]:reduced``."""
    compressors = [GradientCompressor(config(strategy)) for _ in range(world)]
    out = []
    for step in range(steps):
        sums = {}
        for name in ("w", "b", "empty"):
            grads = [gradients(r, step)[name] for r in range(world)]
            if strategy.quantization is None or world <= 2:
                sums[name] = aggregate([compressors[r].compress(name, grads[r])
                                        for r in range(world)])
                continue
            blocks = []
            for j, (lo, hi) in enumerate(chunk_bounds(grads[0].size, world)):
                label = f"{name}[{j}/{world}]"
                pieces = [compressors[r].compress(label, grads[r].reshape(-1)[lo:hi])
                          for r in range(world)]
                reduced = compressors[j].compress(f"{label}:reduced", aggregate(pieces))
                blocks.append(decompress(reduced))
            sums[name] = np.concatenate(blocks).reshape(grads[0].shape)
        out.append(sums)
    return out


def test_error_feedback_delivers_every_gradient_over_the_wire() -> None:
    """Over many steps of TopK at 5%, what the ranks received plus what the
    compressors still hold back is exactly what the ranks contributed."""
    world, steps = 3, 40

    def body(group: Group) -> tuple[np.ndarray, np.ndarray]:
        compressor = GradientCompressor(config(S.TOPK))
        received = np.zeros((48, 33), np.float64)
        for step in range(steps):
            g = gradients(group.rank, step)["w"]
            received += all_reduce_compressed(group, g, compressor, name="w")
        return received, compressor.residual("w").reshape(48, 33)

    results = run_world(world, body)
    sent = sum(gradients(r, s)["w"].astype(np.float64) for r in range(world) for s in range(steps))
    held_back = sum(results[r][1] for r in range(world))
    for received, _ in results:
        assert np.array_equal(received, results[0][0])
        assert np.allclose(received + held_back, sent, atol=1e-3)
    assert np.abs(held_back).max() > 0.1  # TopK at 5% did hold some back


def test_error_feedback_on_both_sides_of_a_block_wise_reduction() -> None:
    """1-bit with 3 ranks: each rank's blocks keep their residuals, and so
    does each block's reducer; together they hold back exactly what the
    ranks did not receive."""
    world, steps = 3, 40

    def body(group: Group) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        compressor = GradientCompressor(config(S.ONE_BIT))
        received = np.zeros(48 * 33, np.float64)
        for step in range(steps):
            g = gradients(group.rank, step)["w"]
            received += all_reduce_compressed(group, g, compressor, name="w").reshape(-1)
        mine = [compressor.residual(f"w[{j}/{world}]") for j in range(world)]
        reducer = compressor.residual(f"w[{group.rank}/{world}]:reduced")
        return received, mine, reducer

    results = run_world(world, body)
    sent = sum(gradients(r, s)["w"].astype(np.float64).reshape(-1)
               for r in range(world) for s in range(steps))
    held_back = np.concatenate([sum(results[r][1][j] for r in range(world)) + results[j][2]
                                for j in range(world)])
    for received, _, _ in results:
        assert np.array_equal(received, results[0][0])
        assert np.allclose(received + held_back, sent, atol=1e-3)
    assert np.abs(held_back).max() > 0.1


def test_powersgd_error_feedback_keeps_each_ranks_own_approximation() -> None:
    """Over many steps, the reduced approximations plus every rank's
    residual add up to every gradient sent: each rank's residual is its
    matrix minus its own approximation, not minus the group's (which an
    in-place all-reduce of Q once made it)."""
    world, steps = 2, 12

    def body(group: Group) -> tuple[np.ndarray, np.ndarray]:
        compressor = GradientCompressor(CompressionConfig(strategy=S.POWERSGD, rank=2))
        received = np.zeros((48, 33), np.float64)
        for step in range(steps):
            g = gradients(group.rank, step)["w"]
            received += all_reduce_compressed(group, g, compressor, name="w")
        return received, compressor.residual("w")

    results = run_world(world, body)
    sent = sum(gradients(r, s)["w"].astype(np.float64) for r in range(world) for s in range(steps))
    held_back = sum(r[1] for r in results)
    for received, _ in results:
        assert np.array_equal(received, results[0][0])
        assert np.allclose(received + held_back, sent, atol=1e-3)


@pytest.mark.parametrize("strategy", [S.TOPK, S.ONE_BIT, S.NONE, S.POWERSGD],
                         ids=lambda s: s.name)
def test_mean_is_the_sum_divided_by_the_world(strategy: CompressionStrategy) -> None:
    def body(group: Group) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        sums = all_reduce_compressed_many(group, gradients(group.rank),
                                          GradientCompressor(config(strategy)), ReduceOp.SUM)
        means = all_reduce_compressed_many(group, gradients(group.rank),
                                           GradientCompressor(config(strategy)), "mean")
        return sums, means

    for sums, means in run_world(3, body):
        for name in sums:
            assert np.allclose(means[name], sums[name] / 3, rtol=1e-6, atol=1e-7)


def test_powersgd_reduces_factors_and_recovers_a_low_rank_sum() -> None:
    """Each rank's matrix is u_r v^T (one shared v), so the sum has rank 1
    and PowerSGD at rank 2 recovers it; the vector bias is all-reduced
    uncompressed. Every rank gets the same bits."""
    world = 3
    v = np.random.default_rng(99).standard_normal(40)

    def tensors(rank: int) -> dict[str, np.ndarray]:
        u = np.random.default_rng(rank).standard_normal(64)
        return {"w": np.outer(u, v).astype(np.float32),
                "b": np.full(5, rank + 1.0, np.float32)}

    def body(group: Group) -> tuple[dict[str, np.ndarray], Any]:
        compressor = GradientCompressor(CompressionConfig(strategy=S.POWERSGD, rank=2))
        out = all_reduce_compressed_many(group, tensors(group.rank), compressor)
        return out, compressor.statistics()

    results = run_world(world, body)
    exact = {k: sum(tensors(r)[k] for r in range(world)) for k in ("w", "b")}
    for out, stats in results:
        assert np.array_equal(out["w"], results[0][0]["w"])
        assert np.allclose(out["w"], exact["w"], rtol=1e-4, atol=1e-4)
        assert np.array_equal(out["b"], exact["b"])
        # P (64 x 2) and Q (40 x 2) in float32 for w, the bias uncompressed.
        assert stats.uncompressed == 1
        assert stats.bytes_out == (64 + 40) * 2 * 4 + 5 * 4


def test_links_carry_the_encoded_bytes_and_sixteen_more() -> None:
    def body(group: Group) -> tuple[int, int, int]:
        compressor = GradientCompressor(CompressionConfig(strategy=S.ONE_BIT))
        g = np.random.default_rng(group.rank).standard_normal(10_000).astype(np.float32)
        before = traffic(group)
        all_reduce_compressed(group, g, compressor, ReduceOp.MEAN, name="g")
        after = traffic(group)
        return (after.bytes_sent - before.bytes_sent,
                after.bytes_received - before.bytes_received, compressor.statistics().bytes_out)

    for sent, received, encoded in run_world(2, body):
        # 1250 bytes of signs and 3 float32 scales; 16 bytes of size and fingerprint.
        assert encoded == 1250 + 3 * 4
        assert sent == received == encoded + 16


def test_three_ranks_reduce_quantized_blocks_instead_of_gathering_everything() -> None:
    """1-bit over 3 ranks: each rank sends the 2 blocks it does not reduce
    and then its reduced block to the 2 others, about 4/3 of one
    compressed gradient, where an all-gather would send 2."""
    def body(group: Group) -> int:
        compressor = GradientCompressor(CompressionConfig(strategy=S.ONE_BIT))
        g = np.random.default_rng(group.rank).standard_normal(10_000).astype(np.float32)
        before = traffic(group).bytes_sent
        all_reduce_compressed(group, g, compressor, name="g")
        return traffic(group).bytes_sent - before

    # Blocks of 3334, 3333 and 3333 elements: 417 bytes of signs and one
    # scale each. Every rank's 16 bytes of agreement, its 2 blocks and its
    # reduced block each reach the 2 other ranks.
    block = 417 + 4
    assert sum(run_world(3, body)) == 3 * 2 * (16 + block + block)


def test_mlx_arrays_come_back_as_mlx_arrays() -> None:
    mx = pytest.importorskip("mlx.core")

    def body(group: Group) -> Any:
        x = mx.array(np.arange(100, dtype=np.float32) * (group.rank + 1))
        return all_reduce_compressed(group, x, GradientCompressor(config(S.FP16)), name="x")

    for out in run_world(2, body):
        assert type(out).__module__.startswith("mlx")
        assert np.array_equal(np.array(out), np.arange(100, dtype=np.float32) * 3)


def test_ranks_with_different_configurations_all_raise_at_once() -> None:
    """Same payload size, different seed: caught by the fingerprint on
    every rank, before any gradient bytes are exchanged."""
    def body(group: Group) -> str:
        compressor = GradientCompressor(CompressionConfig(strategy=S.RANDOM_K,
                                                          seed=group.rank))
        with pytest.raises(CollectiveError, match=r"rank\(s\) \[1\] compress differently"):
            all_reduce_compressed(group, np.ones(1000, np.float32), compressor, name="g")
        # The group is still usable: nothing else was sent.
        return str(group.all_reduce(np.ones(3, np.float32)).tolist())

    assert run_world(2, body) == ["[2.0, 2.0, 2.0]"] * 2


def test_ranks_sending_different_sizes_all_raise_at_once() -> None:
    def body(group: Group) -> None:
        compressor = GradientCompressor(CompressionConfig(strategy=S.TOPK,
                                                          ratio=0.01 * (group.rank + 1)))
        with pytest.raises(CollectiveError, match=r"buffer sizes \[80, 160\]"):
            all_reduce_compressed(group, np.ones(1000, np.float32), compressor, name="g")

    run_world(2, body)


def test_refusals_name_what_to_do_instead() -> None:
    def body(group: Group) -> None:
        compressor = GradientCompressor(config(S.TOPK))
        with pytest.raises(PMetalValueError, match="SUM or MEAN, not MAX.*uncompressed"):
            all_reduce_compressed(group, np.ones(4, np.float32), compressor, "max", name="g")
        with pytest.raises(PMetalTypeError, match="float16, float32 or float64"):
            all_reduce_compressed(group, np.ones(4, np.int32), compressor, name="i")
        with pytest.raises(PMetalTypeError, match="needs a GradientCompressor"):
            all_reduce_compressed(group, np.ones(4, np.float32), "topk", name="g")  # type: ignore[arg-type]
        with pytest.raises(PMetalValueError, match="NaN or inf"):
            all_reduce_compressed(group, np.full(4, np.nan, np.float32), compressor, name="g")

    run_world(1, body)
