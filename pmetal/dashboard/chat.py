"""The dashboard's chat page: ``/chat``, and the two calls its script makes,
``/api/serve`` (where ``pmetal serve`` runs on this machine, how fast it
answered lately, its pipeline's stages) and ``/api/chat`` (a conversation
sent to it, the answer streamed back as it is generated).

What it owns: finding the servers (the records :mod:`pmetal.served` keeps in
this node's ``PMETAL_HOME``, each asked for ``/health``, ``/stats`` and
``/pipeline``) and forwarding the page's requests to one of them. It runs in
the node's event loop, on the node's HTTP app (:mod:`pmetal.node.metrics`
adds the routes).

Why the node forwards rather than the page calling ``pmetal serve`` itself
(CORS): the page stays same-origin, so the dashboard's own access rule
covers the chat as it covers every other page; the server's API key never
reaches the browser (the node reads it from the record, mode 0600); and
``pmetal serve`` need not know about browsers. The node forwards only to an
address taken from a record, never to one a page names. The dashboard's
guard (:mod:`pmetal.dashboard.auth`: loopback Host names only on loopback,
the namespace's token beyond) stands in front of these routes as of every
other.

``POST /api/chat`` takes ``{"messages": [...], "temperature": T,
"max_tokens": N, "server": URL}`` (all but ``messages`` optional; ``server``
must be a recorded server's url, default the oldest) and sends serve's
``/v1/chat/completions`` a streamed request (with usage) for the server's
model. serve's refusals (400 for a context too long, 503 busy, ...) come
back with their status and OpenAI error object. Once the answer streams,
its server-sent events pass through as they come, one whole event at a
time. If the server goes away before ``data: [DONE]`` (killed, connection
lost), the page gets one last error event (``code: serve_gone``) and
``[DONE]``, as serve itself ends a stream that failed. A page that stops
(its stop button closes the connection) makes the node's next write fail;
the node then closes its connection to serve, which cancels the sequence.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from pmetal.served import ServeRecord, running_servers, serve_folder

__all__ = ["PROBE_TIMEOUT", "START_HINT", "add_chat_routes", "serve_status"]

STATIC = Path(__file__).with_name("static")
PROBE_TIMEOUT = 2.0
"""Seconds a server has to answer each of ``/health``, ``/stats`` and
``/pipeline`` for ``/api/serve``."""
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 300.0     # serve ends a stalled request itself (--token-timeout, 60 s)
START_HINT = ("start it with `pmetal serve` (`--model PATH` for another model than the "
              "default, `--address auto` to put its stages on this node's cluster), with the "
              "same PMETAL_HOME as this node; this page finds it within seconds")
_FIELDS = {"messages", "temperature", "max_tokens", "server"}


def add_chat_routes(app: web.Application) -> None:
    """The chat page's routes on the node's app."""
    app.router.add_get("/chat", _page)       # its script and style: /static/chat.*
    app.router.add_get("/api/serve", _serve)
    app.router.add_post("/api/chat", _chat)


async def _page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "chat.html", headers={"Cache-Control": "no-cache"})


# --------------------------------------------------------------- /api/serve

async def serve_status(home: Path | None = None) -> dict[str, Any]:
    """What ``/api/serve`` answers: ``running`` (a recorded server answers
    ``/health``), ``servers`` (each record without its key, with ``health``:
    ok, broken or unreachable, ``error``, and serve's ``stats`` and
    ``pipeline``: its ``/stats`` and ``/pipeline``, None when they did not
    come), and ``message`` for a person."""
    records = await asyncio.to_thread(running_servers, home)
    servers = await asyncio.gather(*(_probe(r) for r in records))
    running = any(s["health"] == "ok" for s in servers)
    if not records:
        message = (f"pmetal serve is not running on this machine (no record in "
                   f"{serve_folder(home)}): {START_HINT}.")
    elif running:
        ok = next(s for s in servers if s["health"] == "ok")
        message = f"pmetal serve answers with {ok['model']} at {ok['url']}."
    else:
        first = servers[0]
        why = ("its pipeline is broken" if first["health"] == "broken"
               else "it does not answer")
        message = (f"pmetal serve (pid {first['pid']}) at {first['url']} cannot chat: {why} "
                   f"({first['error']}). Restart it: {START_HINT}.")
    return {"running": running, "servers": servers, "message": message}


async def _serve(request: web.Request) -> web.Response:
    return web.json_response(await serve_status())


async def _probe(record: ServeRecord) -> dict[str, Any]:
    out: dict[str, Any] = {**record.describe(), "health": "unreachable", "error": None,
                           "stats": None, "pipeline": None}
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(f"{record.url}/health") as response:
                health = await response.json(content_type=None)
                out["health"] = "ok" if response.status == 200 else "broken"
                if response.status != 200:
                    out["error"] = str(health.get("error") or health)
            for path in ("stats", "pipeline"):
                async with session.get(f"{record.url}/{path}",
                                       headers=_auth(record)) as response:
                    if response.status == 200:
                        out[path] = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
        if out["health"] == "unreachable":
            out["error"] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return out


def _auth(record: ServeRecord) -> dict[str, str]:
    return {} if record.api_key is None else {"Authorization": f"Bearer {record.api_key}"}


# ---------------------------------------------------------------- /api/chat

def _error(status: int, message: str, *, code: str, param: str | None = None,
           kind: str = "invalid_request_error") -> web.Response:
    """An error as serve's are (OpenAI's object), so the page shows both alike."""
    return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                        "code": code}}, status=status)


def _error_event(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


async def _chat(request: web.Request) -> web.StreamResponse:
    # JSON only: a form of another site cannot post here without a
    # preflight that this app never grants.
    if request.content_type != "application/json":
        return _error(415, f"send the conversation as JSON (Content-Type: application/json), "
                      f"not {request.content_type or 'no type'}", code="unsupported_media_type")
    try:
        raw = await request.read()          # at most the app's client_max_size
    except web.HTTPRequestEntityTooLarge as exc:
        return _error(413, f"the conversation is larger than the {exc.max_size} bytes the "
                      "dashboard takes: clear it and start again", code="request_too_large")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return _error(400, f"the body is not JSON ({exc})", code="invalid_json")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object with 'messages'",
                      code="invalid_json")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        return _error(400, f"unknown fields {', '.join(unknown)}: the chat takes "
                      f"{', '.join(sorted(_FIELDS))}", code="unknown_field", param=unknown[0])
    records = await asyncio.to_thread(running_servers)
    if not records:
        return _error(503, f"pmetal serve is not running on this machine: {START_HINT}.",
                      code="serve_not_running", kind="server_error")
    wanted = body.get("server")
    record = next((r for r in records if wanted in (None, r.url)), None)
    if record is None:
        return _error(404, f"no pmetal serve runs at {wanted!r}; running: "
                      f"{', '.join(r.url for r in records)}", code="unknown_server",
                      param="server")
    upstream = {"model": record.model, "messages": body.get("messages"), "stream": True,
                "stream_options": {"include_usage": True}}
    upstream.update({k: body[k] for k in ("temperature", "max_tokens")
                     if body.get(k) is not None})
    return await _forward(request, record, upstream)


async def _forward(request: web.Request, record: ServeRecord,
                   upstream: dict[str, Any]) -> web.StreamResponse:
    timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT,
                                    sock_read=READ_TIMEOUT)
    # A session per request: leaving it closes the connection to serve,
    # which is how serve learns that the page stopped.
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            answer = await session.post(f"{record.url}/v1/chat/completions", json=upstream,
                                        headers=_auth(record))
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _error(502, f"pmetal serve (pid {record.pid}) at {record.url} does not "
                          f"answer ({type(exc).__name__}: {exc}); is it still starting, or "
                          f"stuck? Restart it, or {START_HINT}.", code="serve_unreachable",
                          kind="server_error")
        async with answer:
            if answer.status != 200:
                return web.Response(body=await answer.read(), status=answer.status,
                                    content_type="application/json")
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache",
                                                   "X-Accel-Buffering": "no"})
            await response.prepare(request)
            try:
                await _relay(answer, response, record)
            except ConnectionResetError:
                return response      # the page left (stop): leaving closes serve's side
            await response.write_eof()
            return response


async def _relay(answer: aiohttp.ClientResponse, response: web.StreamResponse,
                 record: ServeRecord) -> None:
    """serve's events to the page, whole, until ``[DONE]``; an error event
    when serve's stream breaks before it."""
    pending = b""
    chunks = answer.content.iter_any().__aiter__()
    while True:
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            why = "it closed the connection"
            break
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            break
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            await response.write(event + b"\n\n")   # ConnectionResetError: the page left
            if event == b"data: [DONE]":
                return
    await response.write(_error_event(
        f"pmetal serve (pid {record.pid}) at {record.url} went away in the middle of the "
        f"answer ({why}); the text above is all it sent. Is it still running?",
        "serve_gone"))
