"""``pmetal dashboard``: where this machine's node serves its dashboard.

Prints the URL of the running node's dashboard (its metrics listener,
``/`` of ``metrics.host:metrics.port``). When the node listens beyond
loopback, the URL carries the namespace's dashboard token
(``?token=...``, :mod:`pmetal.dashboard.auth`): opening it once leaves the
token as a cookie in that browser. ``--token`` prints the token alone (for
the login form, or Prometheus' ``authorization`` setting). The token is
derived from the namespace's PSK; whoever holds it can read the dashboard
and ``/metrics``, nothing more.
"""

from __future__ import annotations

import argparse

from pmetal.cli.basic import _fail
from pmetal.cli.status import _client_of_recorded_node
from pmetal.dashboard import dashboard_token
from pmetal.dashboard.auth import is_loopback
from pmetal.node.process import routable_address


def _dashboard_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--url", action="store_true",
                      help="print the dashboard's URL, with the token when the node serves "
                           "beyond loopback (the default)")
    what.add_argument("--token", action="store_true",
                      help="print only the namespace's dashboard token")


def _run_dashboard(args: argparse.Namespace) -> int:
    client = _client_of_recorded_node()
    try:
        metrics = client.status()["metrics"]
        token = dashboard_token(client.namespace)
    finally:
        client.close()
    if args.token:
        print(token)
        return 0
    if metrics.get("state") != "on":
        return _fail(args, f"the node serves no dashboard ({metrics.get('state')}: "
                           f"{metrics.get('reason') or 'not yet'}); see metrics.enabled, "
                           f"metrics.host and metrics.port in 'pmetal config'")
    url = routable_address(metrics["address"])
    host = url.partition("://")[2].rpartition(":")[0]
    print(url + "/" if is_loopback(host) else f"{url}/?token={token}")
    return 0
