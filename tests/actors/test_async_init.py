"""``async def __init__`` on an actor, as in Ray: awaited on the actor's
event loop before any call, its errors raised at creation."""

from __future__ import annotations

from typing import Any

import pytest

import pmetal

from .async_init_classes import Refused, Warmed
from .conftest import WAIT

NUM_WORKERS = 2


def test_the_constructor_is_awaited_on_the_actors_loop(cluster: dict[str, Any],
                                                       reap: list[Any]) -> None:
    actor = Warmed.remote(7)
    reap.append(actor)
    assert pmetal.get(actor.get.remote(), timeout=WAIT) == 7   # its task ran on that loop
    assert pmetal.get(actor.same_loop.remote(), timeout=WAIT) is True


def test_a_constructor_that_raises_fails_the_creation(cluster: dict[str, Any],
                                                      reap: list[Any]) -> None:
    with pytest.raises(ValueError, match="no table"):
        Refused.remote("no table")
    # the worker that refused hosts nothing: the node goes on creating actors
    actor = Warmed.remote(1)
    reap.append(actor)
    assert pmetal.get(actor.get.remote(), timeout=WAIT) == 1
