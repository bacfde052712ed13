"""The node's web dashboard, served at ``/`` of its metrics listener.

The page and its scripts are plain files in ``static/`` (no build step, no
CDN); :mod:`pmetal.dashboard.server` adds its routes and JSON APIs to the
node's aiohttp application (:mod:`pmetal.node.metrics`),
:mod:`pmetal.dashboard.snapshot` reads the node for them, and
:mod:`pmetal.dashboard.auth` decides who may read them (open on loopback;
the namespace's dashboard token beyond). :mod:`pmetal.dashboard.chat` is the
chat page at ``/chat``, which talks to ``pmetal serve``. docs/observability.md
describes what the pages show and the APIs.
"""

from __future__ import annotations

from pmetal.dashboard.auth import dashboard_token
from pmetal.dashboard.server import Dashboard, install

__all__ = ["Dashboard", "dashboard_token", "install"]
