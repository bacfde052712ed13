"""The dashboard's routes on the node's HTTP listener (the ``/metrics`` app).

:func:`install` adds, to the aiohttp application of
:class:`pmetal.node.metrics.MetricsServer` (same host and port):

=====================  ==========================================================
``/``                  the page (``static/index.html``); ``/static/...`` its CSS
                       and JS, shipped in the package: no build step, no CDN
``/api/cluster``       one snapshot (:mod:`pmetal.dashboard.snapshot`), JSON
``/api/events``        server-sent events: a ``snapshot`` event with the same JSON
                       at once, then at every change of the cluster (a member, a
                       death, a master) and otherwise every :data:`TICK` seconds if
                       anything moved (round trips, counters); a comment line every
                       :data:`KEEPALIVE` seconds of calm
``/login``             the token form, when bound beyond loopback
=====================  ==========================================================

and the guard of :mod:`pmetal.dashboard.auth` in front of every route,
``/metrics`` included.

What other members' machines host (actors, pipeline stages, memory, free
resources) comes from a :class:`~pmetal.wire.MachineRequest` to each
(answered with :func:`pmetal.dashboard.snapshot.hosted`), asked by a task of the
dashboard's own every :data:`REMOTE_EVERY` seconds while a page is open
(:data:`REMOTE_WAIT` at most each), never on a snapshot's path: a snapshot
must not wait on a member that may have just died. The same way, the node's
telemetry (``node.telemetry``, where it has one) is refreshed from its
workers every :data:`TELEMETRY_EVERY` seconds while a page is open (a
scrape of ``/metrics`` refreshes it too). :meth:`Dashboard.close` (the node
stopping) cancels those tasks and ends every open event stream, so the
listener's shutdown never waits on a browser.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from pmetal.dashboard.auth import guard
from pmetal.dashboard.snapshot import cluster_snapshot
from pmetal.wire import Machine, MachineRequest

__all__ = [
    "KEEPALIVE",
    "REMOTE_EVERY",
    "REMOTE_WAIT",
    "STATIC",
    "TELEMETRY_EVERY",
    "TICK",
    "Dashboard",
    "install",
]

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
TICK = 1.0           # s between snapshots of a calm cluster (an event stream)
KEEPALIVE = 15.0     # s of identical snapshots before a comment line keeps the stream open
REMOTE_EVERY = 2.0   # s between asks of the other members' machines, while a page is open
REMOTE_WAIT = 0.5    # s a member may take to answer
TELEMETRY_EVERY = 1.0   # s between asks of this node's workers for their telemetry


class Dashboard:
    """The routes' state: machines seen, members' last answers, the tasks
    (open streams, background asks) that :meth:`close` ends."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.known: dict[str, dict[str, Any]] = {}
        self.remote: dict[str, dict[str, Any]] = {}
        self._started: dict[str, float] = {}          # background ask -> when it last began
        self._running: dict[str, asyncio.Task[Any]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def snapshot(self) -> dict[str, Any]:
        self._refresh("members", REMOTE_EVERY, self._refresh_members)
        telemetry = getattr(self.node, "telemetry", None)
        if telemetry is not None and hasattr(telemetry, "refresh"):
            self._refresh("telemetry", TELEMETRY_EVERY, telemetry.refresh)
        return cluster_snapshot(self.node, self.known, self.remote)

    # ------------------------------------------------------------- routes

    async def index(self, request: Any) -> Any:
        from aiohttp import web
        return web.FileResponse(STATIC / "index.html",
                                headers={"Cache-Control": "no-cache"})

    async def api_cluster(self, request: Any) -> Any:
        from aiohttp import web
        return web.json_response(self.snapshot(), headers={"Cache-Control": "no-store"})

    async def api_events(self, request: Any) -> Any:
        from aiohttp import web
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-store",
            "X-Accel-Buffering": "no"})
        await response.prepare(request)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        cluster = self.node.cluster
        last = ""
        quiet_since = time.monotonic()
        try:
            await response.write(b"retry: 1000\n\n")
            while not self._closed:
                version = cluster.version
                snapshot = self.snapshot()
                at = snapshot.pop("at")   # a new time alone is not news
                body = json.dumps(snapshot, separators=(",", ":"), default=str)
                if body != last:
                    last = body
                    snapshot["at"] = at
                    data = json.dumps(snapshot, separators=(",", ":"), default=str)
                    await response.write(f"event: snapshot\ndata: {data}\n\n".encode())
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > KEEPALIVE:
                    await response.write(b": keepalive\n\n")
                    quiet_since = time.monotonic()
                if cluster.version == version:
                    try:
                        await asyncio.wait_for(cluster.changed(), TICK)
                    except TimeoutError:
                        pass
        except (ConnectionResetError, asyncio.CancelledError):
            pass   # the page went away, or the node stops
        finally:
            self._tasks.discard(task)
        return response

    # --------------------------------------------------------- background

    def _refresh(self, what: str, every: float, ask: Any) -> None:
        """Start ``ask()`` as a task of the dashboard's own when the last one
        began ``every`` seconds ago or more and is over."""
        now = time.monotonic()
        running = self._running.get(what)
        if self._closed or (running is not None and not running.done()) \
                or now - self._started.get(what, float("-inf")) < every:
            return
        self._started[what] = now
        task = asyncio.get_running_loop().create_task(ask())
        self._running[what] = task
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(what, t))

    def _done(self, what: str, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("the dashboard could not refresh the %s: %r", what, task.exception())

    async def _refresh_members(self) -> None:
        node = self.node
        dead = node.cluster.dead()
        members = [m for m in node.membership.members.values() if m.node_id not in dead]
        answers = await asyncio.gather(
            *(asyncio.wait_for(node.membership.ask(m, MachineRequest()), REMOTE_WAIT)
              for m in members), return_exceptions=True)
        for member, answer in zip(members, answers):
            if isinstance(answer, Machine):
                self.remote[member.node_id] = dataclasses.asdict(answer)

    def close(self) -> None:
        """End every open stream and the members' asks (the node stops)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()


def install(app: Any, node: Any, host: str) -> Dashboard:
    """Add the dashboard's routes and the guard to ``app`` (an aiohttp
    application not yet started) of a listener bound to ``host``."""
    from pmetal.dashboard.auth import dashboard_token
    dashboard = Dashboard(node)
    middleware, login = guard(host, dashboard_token(node.namespace))
    app.middlewares.append(middleware)
    app.router.add_get("/", dashboard.index)
    app.router.add_get("/api/cluster", dashboard.api_cluster)
    app.router.add_get("/api/events", dashboard.api_events)
    app.router.add_route("*", "/login", login)
    app.router.add_static("/static/", STATIC, follow_symlinks=False)
    return dashboard
