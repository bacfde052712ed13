"""The ``browser`` fixture: ``browser(netns=None)`` opens a headless
Chromium (tests/dashboard/browser.py); every browser a test opened is quit
at teardown, also when the test failed. Skips when Chromium, chromedriver
or selenium is missing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dashboard.browser import open_browser, require_browser


@pytest.fixture
def browser() -> Iterator[Callable[..., Any]]:
    require_browser()
    with contextlib.ExitStack() as stack:
        def make(netns: str | None = None, **size: int) -> Any:
            return stack.enter_context(open_browser(netns=netns, **size))
        yield make
