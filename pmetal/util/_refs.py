"""``get`` and ``wait`` for the ``pmetal.util`` helpers, at the actors layer.

``pmetal.util`` sits below the facade (``pmetal.api``) and may not import it;
these do what ``pmetal.get`` and ``pmetal.wait`` do for the refs the helpers
hold: wait through the client that made a pending ref.
"""

from __future__ import annotations

from typing import Any

from pmetal.actors import context
from pmetal.actors.refs import ObjectRef

__all__ = ["get", "wait"]


def _client_for(refs: list[ObjectRef]) -> Any:
    for r in refs:
        if not r.done() and r._client is not None:
            return r._client
    return context.current()


def get(ref: ObjectRef, timeout: float | None = None) -> Any:
    """``pmetal.get(ref, timeout=timeout)`` for one ref."""
    if ref.done():
        return ref.result()
    return _client_for([ref]).get_one(ref, timeout)


def wait(refs: list[ObjectRef], num_returns: int = 1,
         timeout: float | None = None) -> tuple[list[ObjectRef], list[ObjectRef]]:
    """``pmetal.wait(refs, num_returns=..., timeout=...)``."""
    done = [r for r in refs if r.done()]
    if len(done) >= num_returns:
        chosen = set(map(id, done[:num_returns]))
        return done[:num_returns], [r for r in refs if id(r) not in chosen]
    return _client_for(refs).wait(refs, num_returns, timeout)
