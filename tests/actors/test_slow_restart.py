"""A call to an actor whose restart is under way waits for it past
``actors.restart_wait`` (its node says "restarting"; the restart ends by its
own creation deadline), instead of failing with ActorDiedError while the
restart is only slow. Real node and worker processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pmetal
from pmetal.config import load_config

from .actor_classes import SlowRestart
from .conftest import WAIT, assert_all_exit, shutdown_quietly

RESTART_WAIT = 0.2   # s: far less than the restart below takes
DELAY = 1.0          # s the restarted constructor takes


@pytest.fixture
def quick_to_give_up() -> Iterator[None]:
    if pmetal.is_initialized():
        shutdown_quietly()
    pmetal.init(num_workers=2, config=load_config(actors={"restart_wait": RESTART_WAIT}))
    yield
    shutdown_quietly()


def test_a_call_waits_for_a_restart_its_node_says_is_under_way(quick_to_give_up: None,
                                                                tmp_path: Path) -> None:
    slow: Any = SlowRestart.remote(str(tmp_path / "marker"), DELAY)
    first = pmetal.get(slow.pid.remote(), timeout=WAIT)
    os.kill(first, signal.SIGKILL)
    assert_all_exit([first], what="the killed actor")
    # Asked while the restarted constructor runs (DELAY > RESTART_WAIT).
    assert pmetal.get(slow.pid.remote(), timeout=WAIT) not in (first, None)
    pmetal.kill(slow)
