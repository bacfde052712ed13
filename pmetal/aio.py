"""asyncio with uvloop where it is installed.

pmetal's own event loops (node daemon, async actors) start through
:func:`run`; user code may use it too. uvloop is optional: on platforms
without it the standard loop is used and nothing else changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["has_uvloop", "new_event_loop", "run"]

T = TypeVar("T")


def has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when available, else asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh loop (uvloop when available)."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
