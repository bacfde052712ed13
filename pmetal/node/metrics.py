"""A node's Prometheus metrics: ``/metrics`` on an aiohttp app in its loop.

Every node serves its own series (docs/observability.md has the list); no
``node`` label is needed, since each node is a target of its own. Nothing is
counted for metrics on the hot paths: a scrape reads the counters and
states the node's components already keep (their ``statistics()``, the
actor table, the health monitor), through a custom collector on a
:class:`~prometheus_client.CollectorRegistry` of the node's own (never the
process-global default registry). The one thing a scrape asks over the wire
is each worker's calls served and failed (a ``StatusRequest``, as ``pmetal
status`` does), before rendering.

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

__all__ = ["EMBEDDED_DELAY", "MetricsServer"]

log = logging.getLogger(__name__)

_PEER = 16            # characters of a node id in a label
_ACTOR_STATES = ("pending", "alive", "restarting", "dead")
_HEALTH_STATES = ("healthy", "degraded", "suspect", "dead")
EMBEDDED_DELAY = 2.0
"""Seconds after it is ready that an embedded node opens its metrics port."""


def _imports() -> None:
    import aiohttp.web  # noqa: F401
    import prometheus_client  # noqa: F401


class _CallTotals:
    """Calls (served, or failed) by this node's workers, as a counter that never goes
    back: a worker's count is remembered from the scrape that last saw it,
    and kept once the worker is gone (calls it served after that scrape
    are lost)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.retired = 0

    def update(self, counts: dict[str, int], live: set[str]) -> None:
        for worker_id, calls in counts.items():
            self.seen[worker_id] = max(calls, self.seen.get(worker_id, 0))
        for worker_id in [w for w in self.seen if w not in live]:
            self.retired += self.seen.pop(worker_id)

    @property
    def total(self) -> int:
        return self.retired + sum(self.seen.values())


class _NodeCollector:
    """Reads the node at scrape time (prometheus_client's custom collector)."""

    def __init__(self, node: NodeDaemon, calls: _CallTotals, failed: _CallTotals) -> None:
        self.node = node
        self.calls = calls
        self.failed = failed

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
        yield Counter("pmetal_actor_calls", "Calls served by this node's workers "
                      "(actor methods and tasks), as of each scrape.",
                      value=self.calls.total)
        yield Counter("pmetal_actor_calls_failed", "Calls served by this node's workers "
                      "whose code raised, as of each scrape.", value=self.failed.total)

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
        yield Counter("pmetal_messages_unauthenticated", "Messages dropped for coming "
                      "from a peer without a session.",
                      value=listener.dropped_unauthenticated)
        yield Gauge("pmetal_sessions", "Authenticated sessions of the node's listener.",
                    value=listener.sessions)

        # --- shared memory made by this node and its workers
        from pmetal import shm
        pids = (os.getpid(), *(w.proc.pid for w in node.pool.workers.values()
                               if w.proc.pid is not None))
        yield Gauge("pmetal_shm_objects", "Shared-memory objects (/dev/shm) made by this "
                    "node and its workers and not yet unlinked.",
                    value=len(shm.objects(creators=pids)))


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
        self._calls = _CallTotals()
        self._failed = _CallTotals()
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
        self.registry.register(_NodeCollector(self.node, self._calls, self._failed))
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

    async def _refresh_calls(self) -> None:
        pool = self.node.pool
        described = pool.describe()
        # Bounded by the asks' own deadlines (0.5 s each, side by side); not
        # cancelled from here: the channels are shared with actor creation.
        await pool.add_calls(described)
        live = set(pool.workers)
        for totals, key in ((self._calls, "calls"), (self._failed, "calls_failed")):
            totals.update({w["worker_id"]: w[key] for w in described
                           if isinstance(w.get(key), int)}, live)

    async def _metrics(self, request: Any) -> Any:
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        self.scrapes += 1
        await self._refresh_calls()
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
