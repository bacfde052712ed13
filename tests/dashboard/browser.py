"""Headless Chromium for browser tests, driven by selenium.

:func:`open_browser` starts Debian's ``chromium`` through the system
``chromedriver`` (``/usr/bin/chromedriver``; selenium-manager never runs,
so nothing is downloaded) with a private, temporary profile, and always
quits it. The ``browser`` fixture of ``tests/dashboard/conftest.py`` is a
factory over it: ``browser()`` for a page on this machine's loopback,
``browser(netns="pm...-h1")`` for a browser *inside* a network namespace of
a lab (tests/netlab.py), where it reaches that host's loopback and the lab's
addresses, as a program on that host would.

How the namespace works: chromedriver stays in the root namespace (the test
talks to it over loopback), and starts Chromium through a two-line wrapper
that runs ``ip netns exec NS chromium ...``. Chromium then speaks DevTools to
chromedriver over a pipe (``--remote-debugging-pipe``, file descriptors 3
and 4, which ``ip netns exec`` passes on), not over a TCP port, so nothing
has to cross the namespace's boundary.

Flags: ``--headless=new``; ``--no-sandbox`` (CI runs as root, where
Chromium's sandbox refuses to start); ``--disable-gpu``;
``--disable-dev-shm-usage`` (small /dev/shm in containers); a temporary
``--user-data-dir``. Every wait has a deadline: :func:`wait_for` polls the
page (the page changes in the browser; there is no event to wait on from
here) every 50 ms until a deadline.

Screenshots go to :func:`artifacts` (``$PMETAL_ARTIFACTS``, else
``tests/artifacts/``, which git ignores): CI keeps that folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

CHROMIUM = os.environ.get("PMETAL_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("PMETAL_CHROMEDRIVER", "/usr/bin/chromedriver")
ROOT = Path(__file__).resolve().parents[2]
COMMAND_TIMEOUT = 30   # s any one command to chromedriver may take

__all__ = ["CHROMEDRIVER", "CHROMIUM", "artifacts", "attribute", "browser_available",
           "open_browser", "require_browser", "screenshot", "text", "texts", "wait_for"]


def browser_available() -> str | None:
    """None when a headless Chromium can be driven here, else why not."""
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return (f"browser tests need {path} (apt-get install chromium chromium-driver; "
                    f".ci/run installs them, or set PMETAL_CHROMIUM / PMETAL_CHROMEDRIVER)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "browser tests need selenium (pip install -e '.[test]')"
    return None


def require_browser() -> None:
    reason = browser_available()
    if reason is not None:
        pytest.skip(reason)


@contextlib.contextmanager
def open_browser(*, netns: str | None = None, width: int = 1280,
                 height: int = 900) -> Iterator[Any]:
    """A selenium ``webdriver.Chrome``, quit (with its chromedriver) on exit
    whatever happened; ``netns``: run Chromium in that network namespace."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    # selenium-manager must never run (it would try to download a driver).
    os.environ["SE_OFFLINE"] = "true"
    profile = Path(tempfile.mkdtemp(prefix="pmetal-chromium-"))
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--user-data-dir={profile / 'profile'}", f"--window-size={width},{height}",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--remote-debugging-pipe"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    if netns is not None:
        wrapper = profile / "chromium-in-netns"
        wrapper.write_text(f"#!/bin/sh\nexec ip netns exec {netns} {CHROMIUM} \"$@\"\n")
        wrapper.chmod(0o700)
        options.binary_location = str(wrapper)
    service = Service(CHROMEDRIVER, log_output=str(profile / "chromedriver.log"))
    driver = None
    try:
        driver = webdriver.Chrome(service=service, options=options)
        # Every command to chromedriver (quit included) gives up after 30 s,
        # not selenium's 120: a hung browser fails the test instead of the suite.
        driver.command_executor.client_config.timeout = COMMAND_TIMEOUT
        driver.set_page_load_timeout(15)
        driver.set_script_timeout(10)
        yield driver
    finally:
        try:
            if driver is not None:
                driver.quit()
            else:
                service.stop()
        finally:
            shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver: Any, condition: Callable[[Any], T], timeout: float, what: str) -> T:
    """The first truthy ``condition(driver)`` within ``timeout`` seconds;
    AssertionError naming ``what`` (and the page's text) after that."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = condition(driver)
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - a page mid-update; retried until the deadline
            last_error = exc
        if time.monotonic() >= deadline:
            try:
                text = driver.find_element("tag name", "body").text[:2000]
            except Exception:  # noqa: BLE001 - the page is gone too
                text = "(no page)"
            raise AssertionError(f"{what}: not within {timeout:g} s (last error: "
                                 f"{last_error!r}); the page reads:\n{text}")
        time.sleep(0.05)


# The pages redraw what they show at every update (server-sent events, or a
# poll), so an element found in one call may be gone by the next
# (StaleElementReferenceException, seen on a quiet machine). These read in
# one script, between two redraws.

def texts(driver: Any, selector: str) -> list[str]:
    """The rendered text of every element matching ``selector``, read at once."""
    return list(driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])]"
        ".map(e => e.innerText ?? e.textContent)", selector))   # (SVG has no innerText)


def text(driver: Any, selector: str) -> str:
    """The rendered text of the first element matching ``selector``;
    AssertionError if there is none."""
    found = texts(driver, selector)
    assert found, f"no element matches {selector!r}"
    return found[0]


def attribute(driver: Any, selector: str, name: str) -> str | None:
    """Attribute ``name`` of the first element matching ``selector``;
    AssertionError if there is none."""
    found = driver.execute_script(
        "const e = document.querySelector(arguments[0]);"
        "return e ? [e.getAttribute(arguments[1])] : null", selector, name)
    assert found is not None, f"no element matches {selector!r}"
    return found[0]


def artifacts() -> Path:
    """The folder screenshots go to (created)."""
    folder = Path(os.environ.get("PMETAL_ARTIFACTS") or ROOT / "tests" / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def screenshot(driver: Any, name: str, *, full_page: bool = False) -> Path:
    """Save the page as ``<artifacts>/<name>.png`` (``full_page``: the
    whole page, not just the window); the path."""
    path = artifacts() / f"{name}.png"
    size = driver.get_window_size()
    try:
        if full_page:
            height = driver.execute_script("return document.documentElement.scrollHeight")
            driver.set_window_size(size["width"], max(size["height"], int(height) + 100))
        driver.save_screenshot(str(path))
    finally:
        if full_page:
            driver.set_window_size(size["width"], size["height"])
    return path
