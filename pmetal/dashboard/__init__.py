"""The node's web dashboard: pages and their JSON calls on the node's HTTP
app (the one that serves ``/metrics``, see :mod:`pmetal.node.metrics`); the
pages' files are in ``static/``, plain HTML, CSS and JavaScript shipped in
the package (no build step, no CDN). :mod:`pmetal.dashboard.chat` is the
chat page that talks to ``pmetal serve``. See docs/observability.md."""

__all__: list[str] = []
