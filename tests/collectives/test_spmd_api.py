"""The SPMD API's surface in one process: what a careless user gets for a
typo or a wrong type, and a world of one (no sockets) behaving like any
other world. The multi-process behaviour is in test_spmd_processes.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import pmetal
from pmetal.errors import ConfigError, PMetalTypeError, PMetalValueError


def world_of_one() -> pmetal.DistributedContext:
    config = pmetal.DistributedConfig(nodes=["127.0.0.1:1"], rank=0)
    return pmetal.DistributedContext(pmetal.RingBackend(config))


def test_nodes_may_be_a_comma_separated_string() -> None:
    config = pmetal.DistributedConfig(nodes="127.0.0.1:29500, 127.0.0.1:29501", rank=1)
    assert config.nodes == ("127.0.0.1:29500", "127.0.0.1:29501")
    assert config.world_size == 2


@pytest.mark.parametrize(("nodes", "rank", "message"), [
    ([], 0, "empty"),
    (["127.0.0.1"], 0, "is not host:port"),
    (["127.0.0.1:70000"], 0, "is not host:port"),
    (["a:1", "b:2"], 2, "must be 0 to 1"),
    (["a:1", "a:1"], 0, "lists an address twice"),
])
def test_a_bad_world_is_refused_with_what_to_do(nodes: list[str], rank: int,
                                                message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        pmetal.DistributedConfig(nodes=nodes, rank=rank)


def test_ranks_off_loopback_need_a_psk(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PMETAL_PSK", "PMETAL_PSK_HEX"):
        monkeypatch.delenv(name, raising=False)
    config = pmetal.DistributedConfig(nodes=["10.9.9.1:29500", "10.9.9.2:29500"], rank=0)
    with pytest.raises(ConfigError, match="PMETAL_PSK"):
        pmetal.DistributedContext(pmetal.RingBackend(config)).connect_blocking(timeout=1.0)


def test_a_context_needs_a_backend() -> None:
    with pytest.raises(PMetalValueError, match="DistributedBackend"):
        pmetal.DistributedContext("127.0.0.1:29500")  # type: ignore[arg-type]


def test_a_world_of_one_returns_its_own_values() -> None:
    with world_of_one() as ctx:
        assert (ctx.rank, ctx.world_size) == (0, 1)
        x = np.arange(5, dtype=np.float32)
        assert ctx.all_reduce_blocking(x, "mean") is x
        assert np.array_equal(x, np.arange(5))
        assert ctx.all_gather_blocking(np.ones(3)).shape == (1, 3)
        assert np.array_equal(ctx.reduce_scatter_blocking(np.arange(4)), np.arange(4))
        ctx.barrier_blocking()
        assert asyncio.run(ctx.all_reduce(np.ones(2)))[0] == 1.0


def test_typos_and_wrong_types_get_clear_errors() -> None:
    with world_of_one() as ctx:
        with pytest.raises(PMetalValueError, match="unknown reduce op 'summ'"):
            ctx.all_reduce_blocking(np.ones(2), "summ")
        with pytest.raises(PMetalValueError, match="unknown strategy 'rign'"):
            ctx.all_reduce_blocking(np.ones(2), strategy="rign")
        with pytest.raises(PMetalTypeError, match="not object"):
            ctx.all_reduce_blocking(np.array([object()]))
        with pytest.raises(PMetalTypeError, match="numpy or MLX arrays"):
            ctx.all_reduce_blocking({"a": 1})
        with pytest.raises(PMetalValueError, match="root 3"):
            ctx.broadcast_blocking(np.ones(2), root=3)
        with pytest.raises(PMetalValueError, match="not another rank"):
            ctx.send_blocking(np.ones(2), 0)


def test_a_closed_group_says_so() -> None:
    ctx = world_of_one()
    group = ctx.group
    ctx.close()
    with pytest.raises(pmetal.CollectiveError, match="closed"):
        group.all_reduce(np.ones(2))


def test_a_read_only_array_gets_a_new_result() -> None:
    with world_of_one() as ctx:
        x = np.ones(3)
        x.flags.writeable = False
        out = ctx.all_reduce_blocking(x)
        assert out is not x and np.array_equal(out, x)


# ----------------------------------------------------- scheduled compression

def test_the_schedule_compresses_only_large_float_sums() -> None:
    from pmetal.collectives.group import Schedule
    from pmetal.collectives.ops import ReduceOp
    schedule = Schedule.from_config("g", 2, pmetal.CollectiveConfig(
        compression="topk", compression_min_bytes=1024))
    f32, i64 = np.dtype("float32"), np.dtype("int64")
    assert schedule.compression_for(ReduceOp.SUM, f32, 4096) == "topk"
    assert schedule.compression_for(ReduceOp.MEAN, f32, 4096) == "topk"
    assert schedule.compression_for(ReduceOp.MAX, f32, 4096) == "none"
    assert schedule.compression_for(ReduceOp.SUM, i64, 4096) == "none"
    assert schedule.compression_for(ReduceOp.SUM, f32, 1000) == "none"


def test_auto_compression_is_the_masters_choice_from_the_slowest_link() -> None:
    from pmetal.collectives.group import Schedule
    from pmetal.collectives.ops import ReduceOp
    from pmetal.collectives.rendezvous import slowest_link
    auto = Schedule.from_config("g", 3, pmetal.CollectiveConfig(compression="auto"))
    f32 = np.dtype("float32")
    assert auto.compression_for(ReduceOp.SUM, f32, 1 << 30) == "none"  # not decided yet
    topology = {"links": [{"a": "A", "b": "B", "bandwidth": 100e6},
                          {"a": "B", "b": "C", "bandwidth": 5e6},
                          {"a": "C", "b": "A", "bandwidth": None}]}
    assert slowest_link(["A", "B", "C"], topology) == 5e6
    assert slowest_link(["A", "A", "A"], topology) is None
    assert slowest_link(["A", "C"], topology) is None  # not probed
    assert auto.with_links(5e6).compression == "topk"   # Wi-Fi-like
    assert auto.with_links(100e6).compression == "none"
    assert auto.with_links(None).compression == "none"


def test_a_group_configured_to_compress_sends_fewer_bytes_and_stays_identical() -> None:
    import socket
    from concurrent.futures import ThreadPoolExecutor
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    nodes = [f"127.0.0.1:{p}" for p in ports]
    config = pmetal.CollectiveConfig(compression="topk", compression_ratio=0.01,
                                     compression_min_bytes=4096, shared_memory=False,
                                     connect_timeout=20.0, timeout=20.0)
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(100_000).astype(np.float32) for _ in range(2)]

    def rank(r: int) -> tuple[np.ndarray, np.ndarray, dict]:
        ctx = pmetal.DistributedContext(pmetal.RingBackend(
            pmetal.DistributedConfig(nodes=nodes, rank=r, collectives=config)))
        with ctx:
            g = ctx.all_reduce_blocking(grads[r].copy(), "sum")
            exact = ctx.all_reduce_blocking(np.arange(10_000, dtype=np.int64) * (r + 1))
            return g, exact, ctx.group.statistics()

    with ThreadPoolExecutor(2) as pool:
        (g0, e0, s0), (g1, e1, s1) = pool.map(rank, [0, 1], timeout=60)
    assert s1["compression"] == s0["compression"]
    assert g0.tobytes() == g1.tobytes(), "every rank gets the same bytes"
    assert np.count_nonzero(g0) <= 2 * 1000, "TopK 1% of each rank's gradient"
    assert np.array_equal(e0, np.arange(10_000) * 3) and np.array_equal(e1, e0)
    assert s0["compression"]["strategy"] == "topk"
    assert s0["compression"]["bytes_in"] >= 30 * s0["compression"]["bytes_out"]
