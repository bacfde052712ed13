"""Who may read a node's HTTP listener (the dashboard, its APIs, ``/metrics``).

Two rules, chosen by where the listener is bound (``metrics.host``):

* **Loopback** (127.0.0.0/8, ::1, localhost): open, as on Ray and every
  local tool: whoever runs programs on the machine can already ask the node
  everything (``pmetal status``). One check remains: the request's ``Host``
  header must name a loopback host, so that a web page the owner visits
  cannot reach the dashboard by pointing its own domain at 127.0.0.1 (DNS
  rebinding).
* **Any other address**: every request needs the namespace's dashboard
  token, :func:`dashboard_token`: an HMAC-SHA256 of the namespace's PSK, so
  the PSK never travels and the token proves its holder knew the PSK (or
  was given the token by someone who did). It is accepted as
  ``Authorization: Bearer TOKEN`` (Prometheus' ``authorization`` setting, a
  script), as the cookie :data:`COOKIE` (a browser: set by the login form at
  ``/login``, where the owner pastes the token, or by opening
  ``/?token=TOKEN``, the URL ``pmetal dashboard --url`` prints), and compared
  in constant time. Anything else is a 401 (a browser asking for a page gets
  the login form with it).

The token is a bearer credential over plain HTTP: anyone who can watch the
network between the browser and the node can replay it, and read what the
dashboard shows (it changes nothing in the cluster). docs/observability.md
says so.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
from typing import Any
from urllib.parse import parse_qs

__all__ = ["COOKIE", "dashboard_token", "guard", "is_loopback", "token_matches"]

COOKIE = "pmetal_dashboard"
_PURPOSE = b"pmetal dashboard token v1\x00"


def dashboard_token(namespace: Any) -> str:
    """The dashboard token of a :class:`~pmetal.security.NetworkNamespace`
    (64 hex digits), derived from its name and PSK."""
    return hmac.new(namespace.psk, _PURPOSE + namespace.name.encode(),
                    hashlib.sha256).hexdigest()


def is_loopback(host: str) -> bool:
    """``host`` (an address or ``localhost``, with or without brackets) is loopback."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_matches(given: str | None, token: str) -> bool:
    return bool(given) and hmac.compare_digest(given.strip().encode(), token.encode())


def _host_of(header: str) -> str:
    """The host of a ``Host`` header (``[::1]:8265``, ``127.0.0.1:8265``)."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def _presented(request: Any) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:]
    return request.cookies.get(COOKIE) or request.query.get("token")


def _cookie(response: Any, token: str) -> None:
    response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/")


def _redirect(location: str) -> Any:
    from aiohttp import web
    return web.Response(status=303, headers={"Location": location})


def _login_page(message: str = "") -> str:
    note = f'<p class="error">{html.escape(message)}</p>' if message else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pmetal dashboard: sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="/static/dashboard.css"></head>
<body class="login"><main><h1>pmetal dashboard</h1>
<p>This node serves its dashboard beyond loopback, so it asks for the namespace's
dashboard token. On a machine of the cluster, <code>pmetal dashboard --url</code> prints it
(in the URL) and <code>pmetal dashboard --token</code> alone.</p>{note}
<form method="post" action="/login"><label>Token
<input id="token" name="token" type="password" autocomplete="off" autofocus></label>
<button type="submit">Sign in</button></form></main></body></html>"""


def guard(bound_host: str, token: str) -> Any:
    """The aiohttp middleware enforcing the module's rules for a listener
    bound to ``bound_host``, and the ``/login`` handler (GET, POST)."""
    from aiohttp import web

    open_ = is_loopback(bound_host)

    @web.middleware
    async def middleware(request: Any, handler: Any) -> Any:
        if open_:
            if not is_loopback(_host_of(request.headers.get("Host", ""))):
                return web.Response(status=403, text="this dashboard is bound to loopback and "
                                    "answers only requests addressed to a loopback host\n")
            return await handler(request)
        if request.path == "/login" or request.path == "/static/dashboard.css":
            return await handler(request)
        given = _presented(request)
        if token_matches(given, token):
            if "token" in request.query and request.method == "GET":
                # From the printed URL: keep it as a cookie, drop it from the address bar.
                response = _redirect(str(request.rel_url.with_query(
                    {k: v for k, v in request.query.items() if k != "token"})))
                _cookie(response, token)
                return response
            return await handler(request)
        why = "a wrong token" if given else "no token"
        if request.method == "GET" and "text/html" in request.headers.get("Accept", ""):
            return web.Response(status=401, text=_login_page(
                "That token is not this namespace's." if given else ""),
                content_type="text/html")
        return web.json_response(
            {"error": f"401: {why}. This listener is bound beyond loopback and needs the "
                      f"namespace's dashboard token (pmetal dashboard --token) as "
                      f"'Authorization: Bearer TOKEN' or the {COOKIE} cookie"},
            status=401, headers={"WWW-Authenticate": 'Bearer realm="pmetal"'})

    async def login(request: Any) -> Any:
        if request.method == "GET":
            if open_:
                return _redirect("/")
            return web.Response(text=_login_page(), content_type="text/html")
        form = parse_qs((await request.read()).decode("utf-8", "replace"))
        given = (form.get("token") or [""])[0]
        if open_ or token_matches(given, token):
            response = _redirect("/")
            if not open_:
                _cookie(response, token)
            return response
        return web.Response(status=401, text=_login_page(
            "That token is not this namespace's." if given else "Paste the token."),
            content_type="text/html")

    return middleware, login
