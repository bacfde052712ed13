"""Fixtures for the Ray compatibility checks: workers import the test
classes by reference, so they get this folder's parent on ``PYTHONPATH``."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from . import checklist_classes


def _import_root() -> str:
    parts = checklist_classes.__name__.count(".")
    return str(Path(checklist_classes.__file__).resolve().parents[parts])


@pytest.fixture(scope="session", autouse=True)
def worker_pythonpath() -> Iterator[None]:
    """Node daemons and workers inherit the environment."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_import_root(), old) if p)
    yield
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` (state held by other processes, with no event to
    wait on from here) until it is truthy; fail after ``timeout`` seconds."""
    pause = threading.Event()
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        pause.wait(0.02)
    return value
