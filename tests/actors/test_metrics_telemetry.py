"""/metrics of what workers and drivers ran (pmetal.node.telemetry,
docs/observability.md): calls and their duration histogram, collective
operations by strategy, a pipeline's tokens, steps and hop bytes, objects
owned and borrowed, the workers' CPU and memory, and the strangers that
ZeroMQ's CURVE refuses before pmetal's handshake.

One embedded node on loopback with ``metrics.port`` 0 and a short
``metrics.report_interval`` (the driver's pushes); each scrape is an HTTP
GET parsed with prometheus_client's parser, and each value is checked
against what the test did.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

import pmetal
from pmetal import api, collective
from pmetal.config import load_config
from pmetal.pipeline.llama import LlamaConfig
from pmetal.pipeline.pipeline import Pipeline
from pmetal.tally import TALLY

from .actor_classes import Counter
from .conftest import WAIT, shutdown_quietly, wait_until
from .telemetry_classes import Lender, Member
from .test_metrics import SECRET, scrape, value, wait_status

TINY = LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def node() -> Iterator[dict[str, Any]]:
    """An embedded node with metrics on a free port, whose driver reports
    every 50 ms; its status."""
    if pmetal.is_initialized():
        shutdown_quietly()
    pmetal.init(num_workers=3, psk=SECRET, config=load_config(
        env={}, metrics={"port": 0, "report_interval": 0.05}))
    try:
        yield wait_status(api.client().status, lambda st: st["metrics"]["state"] == "on")
    finally:
        shutdown_quietly()


def counted(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    """``value``, or 0 when the series has no such sample yet."""
    found = [s.value for s in samples.get(name, ()) if all(s.labels.get(k) == v
                                                           for k, v in labels.items())]
    assert len(found) <= 1, f"{name}{labels}: {found}"
    return float(found[0]) if found else 0.0


def test_200_calls_are_200_in_the_duration_histogram(node: dict[str, Any]) -> None:
    address = node["metrics"]["address"]
    before = scrape(address)
    actor = Counter.remote()
    assert pmetal.get([actor.inc.remote() for _ in range(200)], timeout=WAIT)[-1] == 200
    after = scrape(address)
    calls = value(after, "pmetal_actor_calls_total") - value(before, "pmetal_actor_calls_total")
    count = (value(after, "pmetal_actor_call_duration_seconds_count")
             - value(before, "pmetal_actor_call_duration_seconds_count"))
    assert calls == count == 200
    buckets = [(float(s.labels["le"]), s.value)
               for s in after["pmetal_actor_call_duration_seconds_bucket"]]
    assert [le for le, _ in buckets][-1] == float("inf") and len(buckets) <= 10
    counts = [n for _, n in buckets]
    assert counts == sorted(counts), "buckets are cumulative"
    assert counts[-1] == value(after, "pmetal_actor_call_duration_seconds_count")
    assert value(after, "pmetal_actor_call_duration_seconds_sum") > \
        value(before, "pmetal_actor_call_duration_seconds_sum")
    pmetal.kill(actor)


def test_an_all_reduce_is_counted_under_its_strategy(node: dict[str, Any]) -> None:
    address = node["metrics"]["address"]
    members = [Member.remote() for _ in range(3)]
    collective.create_group(members, name="telemetry")
    try:
        before = scrape(address)
        n = 1000   # float64: 8000 bytes on each rank
        for strategy, rounds in (("ring", 2), ("tree", 1)):
            for _ in range(rounds):
                assert pmetal.get([m.all_reduce.remote("telemetry", n, strategy)
                                   for m in members], timeout=WAIT) == [3.0] * 3
        after = scrape(address)
        def grew(name: str, strategy: str) -> float:
            return (counted(after, name, strategy=strategy)
                    - counted(before, name, strategy=strategy))
        for strategy, rounds in (("ring", 2), ("tree", 1), ("naive", 0)):
            # Every rank counts its own operation and buffer: 3 ranks here.
            assert grew("pmetal_collective_operations_total", strategy) == 3 * rounds
            assert grew("pmetal_collective_bytes_total", strategy) == 3 * rounds * n * 8
            assert (grew("pmetal_collective_seconds_total", strategy) > 0) == (rounds > 0)
    finally:
        collective.destroy_group("telemetry")
        for m in members:
            pmetal.kill(m)


def test_a_pipeline_run_counts_its_tokens_steps_and_hops(node: dict[str, Any]) -> None:
    address = node["metrics"]["address"]
    # This process's counts since it started (another test file may have
    # run a "random" pipeline in it before, as a parallel worker does).
    earlier = {row[0]: row for row in TALLY.report()["pipelines"]}.get("random")
    tokens_before, steps_before = (earlier[2], earlier[3]) if earlier else (0, 0)
    with Pipeline.from_pretrained(random_model=TINY, seed=1, stages=2, max_len=64,
                                  threads=1) as pipe:
        results = pipe.generate([[1, 2, 3], [4, 5]], max_tokens=6)
        tokens = sum(len(r.tokens) for r in results)
        hops = pipe.loop.hops
    assert tokens == 12
    # Closed, and no scrape came while it ran: the driver pushes its counts
    # (within report_interval); the stages' workers gave their last report
    # when the node killed them.
    seen: list[float] = []

    def all_tokens() -> dict[str, list[Any]] | None:
        s = scrape(address)
        seen.append(counted(s, "pmetal_pipeline_tokens_total", pipeline="random"))
        return s if seen[-1] == tokens_before + tokens else None
    try:
        samples = wait_until(all_tokens, WAIT, what="the driver's tokens at the node")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: expected {tokens_before} + {tokens}, last seen "
                             f"{seen[-1:]}") from None
    assert value(samples, "pmetal_pipeline_steps_total", pipeline="random") \
        == steps_before + hops
    assert value(samples, "pmetal_pipeline_stages", pipeline="random") == 2
    assert value(samples, "pmetal_pipeline_step_seconds_total", pipeline="random") > 0
    for stage in ("0", "1"):
        assert value(samples, "pmetal_pipeline_stage_steps_total", pipeline="random",
                     stage=stage) == hops
        assert value(samples, "pmetal_pipeline_stage_seconds_total", pipeline="random",
                     stage=stage) > 0
    for hop in ("driver", "0", "1"):
        assert value(samples, "pmetal_pipeline_hop_bytes_total", pipeline="random",
                     hop=hop) > 0
        assert value(samples, "pmetal_pipeline_hop_send_seconds_total", pipeline="random",
                     hop=hop) > 0


def test_objects_owned_by_a_worker_and_borrowed_by_the_driver(node: dict[str, Any]) -> None:
    address = node["metrics"]["address"]
    before = scrape(address)
    lender = Lender.remote()
    borrowed = pmetal.get(lender.lend.remote(), timeout=WAIT)
    assert list(pmetal.get(borrowed[0], timeout=WAIT)) == [0, 1, 2, 3]
    def lent() -> bool:
        s = scrape(address)
        return (value(s, "pmetal_objects_owned") == value(before, "pmetal_objects_owned") + 1
                and value(s, "pmetal_objects_borrowed")
                == value(before, "pmetal_objects_borrowed") + 1)
    wait_until(lent, WAIT, what="the lent object counted owned (worker) and borrowed (driver)")
    del borrowed
    pmetal.kill(lender)


def test_the_workers_cpu_and_memory_by_role(node: dict[str, Any]) -> None:
    samples = scrape(node["metrics"]["address"])
    for role in ("actor", "task"):
        assert value(samples, "pmetal_worker_resident_memory_bytes", role=role) > 1 << 20
        assert value(samples, "pmetal_worker_cpu_seconds_total", role=role) >= 0
    roles = {s.labels["role"] for s in samples["pmetal_worker_cpu_seconds_total"]}
    assert roles <= {"actor", "task", "lent"}


def test_strangers_refused_by_curve_are_counted(node: dict[str, Any]) -> None:
    """Two strangers dial the node's port: one with CURVE keys of its own
    (it does not know the PSK the node's keys come from), one without
    CURVE. ZeroMQ refuses both in the handshake that follows the
    connection, before pmetal's own; each dials once (no reconnection), so
    each counts once, and pmetal's handshake counter does not move.

    The reason a refusal is counted under depends on who hangs up first:
    ``protocol`` when the node reads the stranger's greeting or HELLO and
    refuses it, ``no_detail`` when the stranger saw the mismatch first and
    its close reset the connection before the node read it (about one in
    three NULL strangers on a loaded machine). Both are refusals; neither
    is an authenticator's ``auth``."""
    address = node["metrics"]["address"]

    def refused() -> dict[str, float]:
        s = scrape(address)
        return {x.labels["reason"]: x.value
                for x in s.get("pmetal_curve_handshakes_refused_total", ())}
    before = refused()
    ours_before = value(scrape(address), "pmetal_handshakes_refused_total")
    ctx = zmq.Context()
    try:
        for curve in (True, False):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, -1)   # one attempt: one refusal
            if curve:
                public, secret = zmq.curve_keypair()
                sock.setsockopt(zmq.CURVE_SERVERKEY, zmq.curve_keypair()[0])
                sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            # The ZMTP greeting and the mechanism's handshake run on connect;
            # no message is needed (a send could find no pipe yet and fail).
            sock.connect(node["address"])
        wait_until(lambda: sum(refused().values()) >= sum(before.values()) + 2, WAIT,
                   what="two refused strangers")
        after = refused()
        added = {r: after[r] - before.get(r, 0) for r in after if after[r] != before.get(r, 0)}
        assert sum(added.values()) == 2, added
        assert set(added) <= {"protocol", "no_detail"}, added
        assert value(scrape(address), "pmetal_handshakes_refused_total") == ours_before
        assert api.client().status()["node_id"] == node["node_id"]      # still serving
    finally:
        ctx.destroy(linger=0)   # closes every socket made, so it cannot wait on one


# ------------------------------------------- the node's sums (no processes)

class _NoWorkers:
    """A worker pool with no workers: NodeTelemetry then holds only what
    drivers push, which is what these tests feed it."""

    def __init__(self) -> None:
        self.workers: dict[str, Any] = {}


def test_reports_add_up_and_a_gone_driver_keeps_its_counts() -> None:
    import os

    from pmetal.node.telemetry import MAX_DRIVERS, NodeTelemetry
    from pmetal.tally import OTHER
    from pmetal.wire import Ack, Failure, Telemetry
    hub = NodeTelemetry(_NoWorkers())  # type: ignore[arg-type]
    me = os.getpid()
    rows = (["g", "ring", 2, 800, 0.5], ["g", 7, 1, 1, 1], ["bad"])   # two malformed rows
    assert isinstance(hub.accept("a", Telemetry(me, "driver", collectives=rows, owned=1)), Ack)
    assert isinstance(hub.accept("a", Telemetry(me, "driver", collectives=(
        ["g", "ring", 3, 1200, 0.75],), pipelines=(["m", 2, 10, 11, 1.1, 99, 88, 0.01],))), Ack)
    assert isinstance(hub.accept("b", Telemetry(me, "worker")), Failure)   # workers are asked
    seen = hub.snapshot()
    assert [(c.group, c.strategy, c.operations, c.bytes) for c in seen.collectives] == \
        [("g", "ring", 3, 1200)]                      # the newest report replaced the first
    assert seen.pipelines[0].tokens == 10 and seen.pipelines[0].seconds_per_step == 0.1
    assert seen.objects_owned == 0 and seen.reporters == 1
    # A driver whose process is gone is retired at the next refresh: its
    # counts stay, added to the retired totals.
    gone = 2 ** 22 + 12345   # above Linux's pid_max: no such process
    hub.accept("a", Telemetry(gone, "driver", collectives=(["g", "ring", 4, 1600, 1.0],)),
               pid=gone)
    hub.accept("far", Telemetry(gone, "driver"))   # pid not proved: another machine's
    hub._retire()
    assert list(hub.drivers) == ["far"] and hub.snapshot().collectives[0].operations == 4
    hub.drivers.clear()
    hub._pids.clear()
    # Bounded: past MAX_DRIVERS the oldest is retired, counted all the same.
    for n in range(MAX_DRIVERS + 1):
        hub.accept(f"d{n}", Telemetry(me, "driver", collectives=([f"g{n}", "tree", 1, 8, 0.1],)))
    assert len(hub.drivers) == MAX_DRIVERS
    groups = {c.group for c in hub.snapshot().collectives}
    assert OTHER in groups and len(groups) <= 33   # MAX_KEYS names, then "(other)"
    assert sum(c.operations for c in hub.snapshot().collectives) == 4 + MAX_DRIVERS + 1


def test_links_are_probed_on_a_schedule(tmp_path: Any) -> None:
    """Two node daemons with ``metrics.probe_interval`` 0.2 s: each link's
    bandwidth appears in /metrics without ``pmetal status --probe``."""
    from .conftest import free_port, stop_process
    from .test_metrics import started
    ports = [free_port(), free_port()]
    env = {"PMETAL_METRICS_PORT": "0", "PMETAL_ELECTION_BOOTSTRAP": "0.3",
           "PMETAL_METRICS_PROBE_INTERVAL": "0.2"}
    a = started(tmp_path / "a", env, ports[0], ports[1])
    b = started(tmp_path / "b", env, ports[1], ports[0])
    try:
        with a as (_, sa), b as (_, sb):
            both = [wait_status(s, lambda x: len(x["cluster"]["members"]) == 2
                                and x["metrics"]["state"] == "on") for s in (sa, sb)]
            def probed(mine: dict[str, Any], other: dict[str, Any]) -> bool:
                return counted(scrape(mine["metrics"]["address"]),
                               "pmetal_link_bandwidth_bytes_per_second",
                               peer=other["node_id"][:16]) > 0
            for mine, other in zip(both, reversed(both)):
                wait_until(lambda m=mine, o=other: probed(m, o), WAIT,
                           what="a link probed on schedule")
    finally:
        for n in (a, b):
            stop_process(n.proc)


def test_a_driver_s_last_counts_reach_its_node_at_shutdown(node: dict[str, Any]) -> None:
    """Another driver joins the node with a report interval of a minute and
    counts two collective operations in a row: the first is pushed at once,
    the second only by pmetal.shutdown(). Both are counted, and stay
    counted once that process has ended."""
    import subprocess
    import sys
    address = node["metrics"]["address"]
    before = counted(scrape(address), "pmetal_collective_operations_total", strategy="naive")
    script = (
        "import pmetal\n"
        "from pmetal.config import load_config\n"
        "from pmetal.tally import TALLY\n"
        f"pmetal.init(address={node['address']!r}, psk={SECRET!r},\n"
        "            config=load_config(metrics={'report_interval': 60.0}))\n"
        "TALLY.collective('elsewhere', 'naive', 800, 0.01)\n"
        "TALLY.collective('elsewhere', 'naive', 800, 0.01)\n"
        "pmetal.shutdown()\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    after = scrape(address)
    assert counted(after, "pmetal_collective_operations_total", strategy="naive") == before + 2
    assert counted(after, "pmetal_collective_bytes_total", strategy="naive") >= 1600
