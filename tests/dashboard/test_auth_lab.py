"""Beyond loopback the dashboard (and /metrics) asks for the namespace's token.

One node on a lab host (its own network namespace; started with ``pmetal
start``) with ``metrics.host`` set to the host's lab address, not loopback. Requests come from a client
on that host: without the token, or with a wrong one, every route is a 401;
with it (as a bearer header, as the cookie the login form or the printed
URL sets) they are served. Then a browser on the host signs in through the
form, as the owner would, and sees the cluster; ``pmetal dashboard`` on the
host prints the URL that signs a browser in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from cluster.lab import ROOT
from netlab import NetLab, lab_available

from dashboard.browser import attribute, screenshot, wait_for
from pmetal.dashboard import dashboard_token
from pmetal.security import NetworkNamespace

pytestmark = pytest.mark.skipif(lab_available() is not None,
                                reason=lab_available() or "")

PORT = 8265

# Runs on the lab host: each request of argv[2] (a JSON list of [method,
# path, headers, body]) against argv[1]; prints [status, headers, body
# prefix] for each. Redirects are not followed (their cookie is the point).
CLIENT = r"""
import json, sys, time, urllib.error, urllib.request
base, requests = sys.argv[1], json.loads(sys.argv[2])
class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None
opener = urllib.request.build_opener(NoRedirect)
deadline = time.monotonic() + 15
while True:   # the listener opens just after the node's ready line
    try:
        opener.open(base + "/login", timeout=2).read()
        break
    except urllib.error.HTTPError:
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
out = []
for method, path, headers, body in requests:
    req = urllib.request.Request(base + path, method=method, headers=headers,
                                 data=body.encode() if body is not None else None)
    try:
        r = opener.open(req, timeout=5)
        out.append([r.status, dict(r.headers), r.read(3000).decode(errors="replace")])
    except urllib.error.HTTPError as e:
        out.append([e.code, dict(e.headers), e.read(3000).decode(errors="replace")])
print(json.dumps(out))
"""


@dataclass
class Exposed:
    lab: NetLab
    base: str            # http://address:port of the dashboard
    token: str
    node_id: str
    pmetal: Callable[..., str]   # runs 'pmetal ARGS' on the host; its stdout


@pytest.fixture(scope="module")
def exposed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exposed]:
    """A node started with ``pmetal start`` on a lab host, serving its
    dashboard on the host's lab address; shared by the module's tests (they
    only read)."""
    home = tmp_path_factory.mktemp("exposed")
    with NetLab(1) as lab:
        address = lab.host(1).address
        env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
        env.update(PMETAL_HOME=str(home), PMETAL_METRICS_HOST=address,
                   PMETAL_METRICS_PORT=str(PORT), PYTHONPATH=str(ROOT))

        def pmetal(*args: str) -> str:
            proc = lab.run(1, [sys.executable, "-m", "pmetal", *args], env=env, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            return out.strip()

        pmetal("start", "--host", address, "--port", "7100", "--no-discovery")
        try:
            # The PSK file's text is the key (as NetworkNamespace.resolve reads it).
            token = dashboard_token(NetworkNamespace("default",
                                                     (home / "psk").read_bytes().strip()))
            node_id = json.loads((home / "node.json").read_text())["node_id"]
            exposed = Exposed(lab, f"http://{address}:{PORT}", token, node_id, pmetal)
            ask(exposed, [])   # waits for the listener, which opens after the ready line
            yield exposed
        finally:
            pmetal("stop")


def ask(e: Exposed, requests: list[tuple[str, str, dict[str, str], str | None]]
        ) -> list[tuple[int, dict[str, str], str]]:
    proc = e.lab.python(1, CLIENT, e.base, json.dumps(requests), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, cwd=ROOT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    return [tuple(r) for r in json.loads(out)]  # type: ignore[misc]


def test_without_the_token_or_with_a_wrong_one_everything_is_refused(exposed: Exposed) -> None:
    wrong = dashboard_token(NetworkNamespace("default", b"another-psk-of-32-bytes-or-more!"))
    html = {"Accept": "text/html"}
    answers = ask(exposed, [
        ("GET", "/api/cluster", {}, None),
        ("GET", "/api/cluster", {"Authorization": f"Bearer {wrong}"}, None),
        ("GET", "/api/events", {"Cookie": f"pmetal_dashboard={wrong}"}, None),
        ("GET", "/metrics", {}, None),
        ("GET", "/", html, None),
        ("GET", f"/?token={wrong}", html, None),
        ("GET", "/static/dashboard.js", {}, None),
        ("POST", "/login", {"Content-Type": "application/x-www-form-urlencoded"},
         f"token={wrong}"),
    ])
    assert [a[0] for a in answers] == [401] * 8, answers
    assert answers[0][1]["WWW-Authenticate"] == 'Bearer realm="pmetal"'
    assert "no token" in answers[0][2] and "a wrong token" in answers[1][2]
    assert 'name="token"' in answers[4][2]          # the login form
    assert "not this namespace" in answers[5][2]
    assert all("Set-Cookie" not in a[1] for a in answers)


def test_with_the_token_everything_is_served(exposed: Exposed) -> None:
    token = exposed.token
    cookie = {"Cookie": f"pmetal_dashboard={token}"}
    answers = ask(exposed, [
        ("GET", "/api/cluster", {"Authorization": f"Bearer {token}"}, None),
        ("GET", "/metrics", {"Authorization": f"Bearer {token}"}, None),
        ("GET", f"/?token={token}", {}, None),
        ("GET", "/", cookie, None),
        ("GET", "/static/dashboard.js", cookie, None),
        ("POST", "/login", {"Content-Type": "application/x-www-form-urlencoded"},
         f"token={token}"),
    ])
    assert [a[0] for a in answers] == [200, 200, 303, 200, 200, 303], answers
    assert answers[0][2].startswith('{"at"')
    assert "pmetal_cluster_members" in answers[1][2]
    # The printed URL and the form leave the token as an HttpOnly cookie,
    # and the address bar without it.
    for redirect in (answers[2], answers[5]):
        assert redirect[1]["Location"] == "/"
        assert f"pmetal_dashboard={token}" in redirect[1]["Set-Cookie"]
        assert "HttpOnly" in redirect[1]["Set-Cookie"]
    assert "<title>pmetal dashboard</title>" in answers[3][2]


def test_the_owner_signs_in_with_the_form_in_a_browser(
        exposed: Exposed, browser: Callable[..., Any]) -> None:
    driver = browser(netns=exposed.lab.host(1).name)
    driver.get(exposed.base + "/")
    field = wait_for(driver, lambda d: d.find_element("id", "token"), 15.0, "the login form")
    screenshot(driver, "dashboard-login")
    field.send_keys(exposed.token)
    field.submit()
    drawn = wait_for(driver, lambda d: d.execute_script(
        "return [...document.querySelectorAll('#topology g.machine')].map(g => g.dataset.node)"),
        10.0, "the dashboard after signing in")
    assert drawn == [exposed.node_id]
    assert attribute(driver, "#conn", "data-mode") == "live"


def test_pmetal_dashboard_prints_the_url_with_the_token(exposed: Exposed) -> None:
    assert exposed.pmetal("dashboard", "--token") == exposed.token
    url = exposed.pmetal("dashboard")
    assert url == f"{exposed.base}/?token={exposed.token}"
    [(status, headers, _)] = ask(exposed, [("GET", url.removeprefix(exposed.base), {}, None)])
    assert status == 303 and headers["Set-Cookie"].startswith(
        f"pmetal_dashboard={exposed.token};")
