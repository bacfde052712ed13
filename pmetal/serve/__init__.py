"""``pmetal serve``: an OpenAI-compatible HTTP server over a pipeline.

:class:`OpenAIServer` answers ``/v1/models``, ``/v1/chat/completions`` and
``/v1/completions`` (streamed as server-sent events or whole) from a
:class:`~pmetal.pipeline.Pipeline`, concurrent requests sharing its decode
steps through a :class:`~pmetal.pipeline.batching.ContinuousBatcher`;
:mod:`pmetal.serve.protocol` holds the API's rules and objects. aiohttp is
imported with this package only. See docs/serving.md."""

from pmetal.serve.protocol import APIError
from pmetal.serve.server import (
    OpenAIServer,
    ServerThread,
    check_binding,
    is_loopback,
    serve_forever,
    served_name,
)

__all__ = ["APIError", "OpenAIServer", "ServerThread", "check_binding", "is_loopback",
           "serve_forever", "served_name"]
