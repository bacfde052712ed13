"""A node's Prometheus metrics: ``/metrics`` on an aiohttp app in its loop.

Every node serves its own series (docs/observability.md has the list); no
``node`` label is needed, since each node is a target of its own. A scrape
reads the counters and states the node's components already keep (their
``statistics()``, the actor table, the health monitor, the refusals its
listening socket counted), through a custom collector on a
:class:`~prometheus_client.CollectorRegistry` of the node's own (never the
process-global default registry), and what its workers and drivers ran
(:mod:`pmetal.node.telemetry`): before rendering, it asks each worker for
its report (``TelemetryRequest``). The one count kept for metrics on a hot
path is a call's duration, in the worker (about 0.5 us of a 160 us round
trip: docs/performance.md).

The listener is an aiohttp application in the node's event loop; the
dashboard (:mod:`pmetal.dashboard`) adds its routes, and the guard that
asks for the namespace's token beyond loopback, to it. It listens on
``metrics.host:metrics.port`` (127.0.0.1:8265 by default, Ray's dashboard
port; 0 takes a free one). A port already taken leaves the node running:
one warning names the port and the setting to change (at INFO for the
node a script's ``pmetal.init()`` embeds: its stderr is the script's), and
the node's status says metrics are off. aiohttp and prometheus_client are imported in
a thread after the node is ready (about 0.3-0.5 s of CPU that the first
actor must not wait for); the node a script's ``pmetal.init()`` embeds
starts them :data:`EMBEDDED_DELAY` seconds later still, past the script's
own start.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pmetal.config import MetricsConfig

if TYPE_CHECKING:
    from pmetal.node.daemon import NodeDaemon
    from pmetal.node.telemetry import TelemetrySnapshot

__all__ = ["EMBEDDED_DELAY", "MetricsServer"]

log = logging.getLogger(__name__)

_PEER = 16            # characters of a node id in a label
_ACTOR_STATES = ("pending", "alive", "restarting", "dead")
_HEALTH_STATES = ("healthy", "degraded", "suspect", "dead")
EMBEDDED_DELAY = 2.0
"""Seconds after it is ready that an embedded node opens its metrics port."""


def _sizes(names: list[str], folder: str = "/dev/shm") -> int:
    """Bytes of the shared-memory objects ``names`` (those gone meanwhile: 0)."""
    total = 0
    for name in names:
        try:
            total += os.stat(folder + name).st_size
        except OSError:
            pass
    return total


def _imports() -> None:
    import aiohttp.web  # noqa: F401
    import prometheus_client  # noqa: F401


class _NodeCollector:
    """Reads the node at scrape time (prometheus_client's custom collector)."""

    def __init__(self, node: NodeDaemon) -> None:
        self.node = node

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily as Counter
        from prometheus_client.core import GaugeMetricFamily as Gauge
        node = self.node
        cluster = node.cluster
        state = cluster.state

        # --- cluster
        yield Gauge("pmetal_cluster_members", "Nodes in the cluster, this one included "
                    "(the master's member list, as this node holds it).",
                    value=node.membership.statistics().members)
        master = Gauge("pmetal_cluster_master", "1 for the master this node follows, "
                       "labelled with its node id (prefix); no sample without a master.",
                       labels=["master"])
        if state.master:
            master.add_metric([state.master[:_PEER]], 1)
        yield master
        yield Gauge("pmetal_cluster_is_master", "1 when this node is the master.",
                    value=int(cluster.is_master()))
        yield Gauge("pmetal_cluster_term", "The election term this node is in.",
                    value=state.term)
        yield Gauge("pmetal_cluster_epoch", "Version of the member list.", value=state.epoch)
        election = cluster.election.statistics()
        yield Counter("pmetal_elections", "Elections this node started as a candidate.",
                      value=election.elections)
        yield Counter("pmetal_elections_won", "Elections this node won (it became master).",
                      value=election.won)
        yield Counter("pmetal_peer_deaths", "Times this node's failure detector declared a "
                      "peer dead.", value=cluster.health.statistics().deaths)
        stats = cluster.statistics()
        yield Counter("pmetal_fenced", "Times this node was fenced (declared dead by the "
                      "cluster, or unsure it was not) and ended or restarted its actors.",
                      value=stats.fenced)

        # --- peers, as this node's failure detector sees them
        health = Gauge("pmetal_peer_health", "1 for the state each peer is in, 0 for the "
                       "others (healthy, degraded, suspect, dead).", labels=["peer", "state"])
        rtt = Gauge("pmetal_peer_rtt_seconds", "Median of the recent heartbeat round trips "
                    "to each peer.", labels=["peer"])
        for summary in cluster.health.summary():
            peer = summary.node_id[:_PEER]
            for name in _HEALTH_STATES:
                health.add_metric([peer, name], int(summary.status.value == name))
            if summary.rtt is not None:
                rtt.add_metric([peer], summary.rtt)
        yield health
        yield rtt
        bandwidth = Gauge("pmetal_link_bandwidth_bytes_per_second", "Bandwidth of the link "
                          "to each peer, as last probed from this node (pmetal status "
                          "--probe); absent until probed.", labels=["peer"])
        topology = cluster.topology
        if node.node_id in topology:
            for peer in topology.nodes():
                link = topology.link(node.node_id, peer) if peer != node.node_id else None
                if link is not None and link.bandwidth:
                    bandwidth.add_metric([peer[:_PEER]], link.bandwidth)
        yield bandwidth

        # --- actors hosted here
        by_state = dict.fromkeys(_ACTOR_STATES, 0)
        for record in node.actors.actors.values():
            by_state[record.state] = by_state.get(record.state, 0) + 1
        actors = Gauge("pmetal_actors", "Actors hosted on this node, by state (dead: the "
                       "last 200 only).", labels=["state"])
        for name, count in by_state.items():
            actors.add_metric([name], count)
        yield actors
        yield Gauge("pmetal_actors_queued", "Actor creations waiting for resources on "
                    "this node.", value=len(node.actors.queue))
        yield Counter("pmetal_actors_created", "Actors constructed on this node.",
                      value=node.actors.created)
        yield Counter("pmetal_actor_restarts", "Actor restarts on this node.",
                      value=node.actors.restarts)
        seen = node.telemetry.snapshot()
        yield Counter("pmetal_actor_calls", "Calls served by this node's workers "
                      "(actor methods and tasks), as of each scrape.", value=seen.calls)
        yield Counter("pmetal_actor_calls_failed", "Calls served by this node's workers "
                      "whose code raised, as of each scrape.", value=seen.calls_failed)
        yield from _telemetry(seen)

        # --- workers and requests
        pool = node.pool.statistics()
        yield Gauge("pmetal_workers", "Worker processes alive.", value=pool.workers)
        yield Gauge("pmetal_workers_idle", "Actor workers ready and free.", value=pool.idle)
        yield Counter("pmetal_workers_started", "Worker processes started.",
                      value=pool.started)
        yield Counter("pmetal_workers_exited", "Worker processes that exited.",
                      value=pool.exited)
        counts = node.statistics()
        yield Counter("pmetal_node_requests", "Requests the node received.",
                      value=counts.requests)
        yield Counter("pmetal_node_requests_failed", "Requests the node answered with an "
                      "error.", value=counts.requests_failed)

        # --- security
        listener = node.listener.statistics()
        yield Counter("pmetal_handshakes_refused", "Handshakes refused: peers without "
                      "the namespace's PSK, or that broke the protocol.",
                      value=listener.refused_handshakes)
        curve = Counter("pmetal_curve_handshakes_refused", "Connections to the node's "
                        "port refused inside ZeroMQ before pmetal's handshake, by reason: "
                        "protocol (no CURVE, or keys of another PSK or namespace), auth, "
                        "no_detail.", labels=["reason"])
        for reason, count in sorted(node.socket.refused.items()):
            curve.add_metric([reason], count)
        yield curve
        yield Counter("pmetal_messages_unauthenticated", "Messages dropped for coming "
                      "from a peer without a session.",
                      value=listener.dropped_unauthenticated)
        yield Gauge("pmetal_sessions", "Authenticated sessions of the node's listener.",
                    value=listener.sessions)

        # --- shared memory made by this node and its workers
        from pmetal import shm
        pids = (os.getpid(), *(w.proc.pid for w in node.pool.workers.values()
                               if w.proc.pid is not None))
        names = shm.objects(creators=pids)
        yield Gauge("pmetal_shm_objects", "Shared-memory objects (/dev/shm) made by this "
                    "node and its workers and not yet unlinked.", value=len(names))
        yield Gauge("pmetal_shm_bytes", "Their size in bytes.", value=_sizes(names))


def _telemetry(seen: TelemetrySnapshot) -> Iterator[Any]:
    """The series of what this node's workers and drivers ran
    (pmetal.node.telemetry)."""
    from prometheus_client.core import CounterMetricFamily as Counter
    from prometheus_client.core import GaugeMetricFamily as Gauge
    from prometheus_client.core import HistogramMetricFamily as Histogram
    from prometheus_client.utils import floatToGoString
    latency, total = seen.latency, 0
    buckets = []
    for bound, count in zip((*latency.bounds, float("inf")), latency.counts, strict=True):
        total += count
        buckets.append((floatToGoString(bound), total))
    yield Histogram("pmetal_actor_call_duration_seconds", "Time this node's workers took "
                    "to run each call (the method or task and packing its result; a "
                    "stream: until its end).", buckets=buckets, sum_value=latency.seconds)

    by_strategy: dict[str, list[float]] = {}
    for c in seen.collectives:
        row = by_strategy.setdefault(c.strategy, [0, 0, 0.0])
        row[0] += c.operations
        row[1] += c.bytes
        row[2] += c.seconds
    families = [Counter("pmetal_collective_operations", "Collective operations run by "
                        "this node's processes, by strategy.", labels=["strategy"]),
                Counter("pmetal_collective_bytes", "Bytes of the buffers of those "
                        "operations (each rank's own).", labels=["strategy"]),
                Counter("pmetal_collective_seconds", "Seconds those operations took.",
                        labels=["strategy"])]
    for strategy, values in sorted(by_strategy.items()):
        for family, v in zip(families, values, strict=True):
            family.add_metric([strategy], v)
    yield from families

    stages = Gauge("pmetal_pipeline_stages", "Stages of each pipeline driven from this "
                   "node.", labels=["pipeline"])
    tokens = Counter("pmetal_pipeline_tokens", "Tokens generated by each pipeline "
                     "driven from this node.", labels=["pipeline"])
    steps = Counter("pmetal_pipeline_steps", "Hops of each pipeline's driver round its "
                    "ring of stages.", labels=["pipeline"])
    step_seconds = Counter("pmetal_pipeline_step_seconds", "Their round trips, summed.",
                           labels=["pipeline"])
    hop_bytes = Counter("pmetal_pipeline_hop_bytes", "Bytes sent on each hop of a "
                        "pipeline from this node: hop \"driver\" is the driver's to the "
                        "first stage, hop \"i\" stage i's to the next (the last's: back to "
                        "the driver).", labels=["pipeline", "hop"])
    hop_seconds = Counter("pmetal_pipeline_hop_send_seconds", "Seconds the sender of "
                          "each of those hops spent handing them to its link (queueing and "
                          "backpressure; not their flight).", labels=["pipeline", "hop"])
    stage_steps = Counter("pmetal_pipeline_stage_steps", "Steps of the pipeline stages "
                          "hosted on this node.", labels=["pipeline", "stage"])
    stage_seconds = Counter("pmetal_pipeline_stage_seconds", "Compute seconds of those "
                            "steps.", labels=["pipeline", "stage"])
    for p in seen.pipelines:
        if p.steps:
            stages.add_metric([p.name], p.stages)
            tokens.add_metric([p.name], p.tokens)
            steps.add_metric([p.name], p.steps)
            step_seconds.add_metric([p.name], p.seconds)
            hop_bytes.add_metric([p.name, "driver"], p.bytes_sent)
            hop_seconds.add_metric([p.name, "driver"], p.send_seconds)
        for st in p.stage_rows:
            hop_bytes.add_metric([p.name, str(st.index)], st.hop_bytes)
            hop_seconds.add_metric([p.name, str(st.index)], st.hop_seconds)
            stage_steps.add_metric([p.name, str(st.index)], st.steps)
            stage_seconds.add_metric([p.name, str(st.index)], st.seconds)
    yield from (stages, tokens, steps, step_seconds, hop_bytes, hop_seconds, stage_steps,
                stage_seconds)

    yield Gauge("pmetal_objects_owned", "ObjectRefs this node's workers and drivers own "
                "and hold for borrowers in other processes.", value=seen.objects_owned)
    yield Gauge("pmetal_objects_borrowed", "ObjectRefs they borrow from other processes.",
                value=seen.objects_borrowed)
    cpu = Counter("pmetal_worker_cpu_seconds", "CPU seconds of this node's worker "
                  "processes by role (actor, task, lent), exited ones included.",
                  labels=["role"])
    rss = Gauge("pmetal_worker_resident_memory_bytes", "Resident memory of this node's "
                "live worker processes by role.", labels=["role"])
    for proc in seen.processes:
        cpu.add_metric([proc.role], proc.cpu_seconds)
        rss.add_metric([proc.role], proc.resident_bytes)
    yield cpu
    yield rss


class MetricsServer:
    """The node's HTTP listener: ``/metrics`` and the dashboard.

    :meth:`start` binds (or warns and stays off); :meth:`close` stops.
    :meth:`describe` is what ``pmetal status`` shows.
    """

    def __init__(self, config: MetricsConfig, node: NodeDaemon) -> None:
        self.config = config
        self.node = node
        self.address = ""          # http://host:port once bound
        self.state = "starting" if config.enabled else "disabled"
        self.reason = "" if config.enabled else "metrics.enabled is false"
        self.scrapes = 0
        self.registry: Any = None
        self._runner: Any = None
        self.dashboard: Any = None

    def describe(self) -> dict[str, Any]:
        return {"enabled": self.state == "on", "state": self.state, "address": self.address,
                "reason": self.reason, "scrapes": self.scrapes}

    async def start(self, delay: float = 0.0, stopping: asyncio.Event | None = None) -> None:
        """Bind, after ``delay`` seconds unless ``stopping`` is set first (an
        embedded node waits, so that its ~0.5 s of imports do not compete
        with the script that just started it for the CPU)."""
        if not self.config.enabled:
            return
        if delay > 0:
            try:
                await asyncio.wait_for((stopping or asyncio.Event()).wait(), delay)
                return   # the node stops
            except TimeoutError:
                pass
        try:
            await asyncio.to_thread(_imports)
        except ImportError as exc:
            self.state, self.reason = "off", f"cannot import {exc.name}"
            log.warning("metrics are off on this node: %s (pip install prometheus-client "
                        "aiohttp)", exc)
            return
        from aiohttp import web
        from prometheus_client import CollectorRegistry, ProcessCollector
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_NodeCollector(self.node))
        ProcessCollector(registry=self.registry)
        app = web.Application()
        from pmetal.dashboard import install
        self.dashboard = install(app, self.node, self.config.host)
        app.router.add_get("/metrics", self._metrics)
        from pmetal.dashboard.chat import add_chat_routes
        add_chat_routes(app)       # /chat, and /api/serve and /api/chat it calls
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            self.state = "off"
            self.reason = (f"{self.config.host}:{self.config.port} is taken or refused "
                           f"({exc.strerror or exc})")
            # An embedded node (pmetal.init()) is a script's own: its stderr
            # is the user's terminal, and another node holding the port is
            # the usual case there, not a fault.
            level = logging.INFO if self.node.embedded else logging.WARNING
            log.log(level, "metrics are off on this node: could not listen on %s:%d (%s); "
                        "another node on this machine may hold it. Set metrics.port "
                        "(PMETAL_METRICS_PORT; 0: any free port) to serve them",
                        self.config.host, self.config.port, exc.strerror or exc)
            return
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.address = f"http://{host}:{port}"
        self.state = "on"
        log.info("metrics at %s/metrics", self.address)

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if self.dashboard is not None:
            self.dashboard.close()
        if runner is not None:
            await runner.cleanup()
        if self.state == "on":
            self.state = "off"
            self.reason = "the node stopped"

    async def _metrics(self, request: Any) -> Any:
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        self.scrapes += 1
        await self.node.telemetry.refresh()
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
