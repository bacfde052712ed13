"""``pmetal dashboard``: the URL (with the token beyond loopback) and the token.

``pmetal start`` on a lab host with ``metrics.host`` on the host's lab
address; ``pmetal dashboard`` there prints a URL that, opened, leaves the
token as a cookie; ``--token`` is the namespace's token (the one derived
from the PSK file ``pmetal start`` made).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.lab import ROOT
from netlab import NetLab, lab_available
from pmetal.dashboard import dashboard_token
from pmetal.security import NetworkNamespace

pytestmark = pytest.mark.skipif(lab_available() is not None,
                                reason=lab_available() or "")

OPEN = r"""
import sys, urllib.request
class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None
try:
    urllib.request.build_opener(NoRedirect).open(sys.argv[1], timeout=5)
except urllib.error.HTTPError as e:
    print(e.code, e.headers["Set-Cookie"])
"""


def test_the_printed_url_carries_the_token_and_signs_the_browser_in(tmp_path: Path) -> None:
    with NetLab(1) as lab:
        address = lab.host(1).address
        env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
        env.update(PMETAL_HOME=str(tmp_path), PMETAL_METRICS_HOST=address,
                   PMETAL_METRICS_PORT="8265", PYTHONPATH=str(ROOT))

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
                                                     (tmp_path / "psk").read_bytes().strip()))
            assert pmetal("dashboard", "--token") == token
            url = pmetal("dashboard")
            assert url == f"http://{address}:8265/?token={token}"
            opened = lab.python(1, OPEN, url, stdout=subprocess.PIPE, text=True, env=env)
            out, _ = opened.communicate(timeout=30)
            assert out.startswith(f"303 pmetal_dashboard={token};"), out
        finally:
            pmetal("stop")
