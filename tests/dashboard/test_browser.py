"""The browser fixture itself: a page is rendered, its script runs, and a
screenshot is kept (tests/dashboard/browser.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dashboard.browser import screenshot, wait_for

PAGE = ("data:text/html,<title>t</title><div id=out></div>"
        "<script>setTimeout(() => document.getElementById('out').textContent = "
        "'rendered by script', 50)</script>")


def test_headless_chromium_renders_a_page_and_keeps_a_screenshot(
        browser: Callable[..., Any]) -> None:
    driver = browser()
    driver.get(PAGE)
    text = wait_for(driver, lambda d: d.find_element("id", "out").text, 5.0, "the script ran")
    assert text == "rendered by script"
    path = screenshot(driver, "browser-fixture")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
