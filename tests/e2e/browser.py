"""A headless Chromium page for the console tests: Debian's Chromium through Playwright."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
# NOTES.md: the flags Debian's Chromium needs here; never `playwright install` (it downloads).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000


@pytest.fixture
def browser_log() -> list[str]:
    """What the page printed to its console, and its uncaught errors."""
    return []


@contextmanager
def open_page(log: list[str]):
    """A fresh headless Chromium page, logging into `log`. Playwright's sync API runs an event
    loop in this thread while the page is open, so Django's ORM refuses to run here meanwhile:
    read the database before or after."""
    from playwright.sync_api import sync_playwright

    assert CHROMIUM.exists(), (
        "Debian's chromium is not at /usr/bin/chromium: `apt-get install -y chromium` "
        "(.ci/run does it)"
    )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        tab = browser.new_page(viewport={"width": 1400, "height": 800})
        tab.set_default_timeout(TIMEOUT_MS)
        tab.on("console", lambda message: log.append(f"{message.type}: {message.text}"))
        tab.on("pageerror", lambda error: log.append(f"pageerror: {error}"))
        try:
            yield tab
        finally:
            browser.close()


@pytest.fixture
def page(browser_log):
    """`open_page` for a test's whole run."""
    with open_page(browser_log) as tab:
        yield tab


def sign_in(page, base_url: str, path: str, username: str, password: str) -> None:
    """Open a console page signed out: it sends the browser to the login form; sign in there
    and land back on `path`."""
    page.goto(f"{base_url}{path}")
    assert "/console/login" in page.url
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("#login-form button[type=submit]")
    page.wait_for_url(f"{base_url}{path}")


@contextmanager
def recorded(page, screenshot: Path, log: list[str], output) -> Iterator[None]:
    """Run a browser test's steps: on failure print the page's console log and `output()` (the
    server's), and in any case save a full-page screenshot to `screenshot`."""
    try:
        yield
    except BaseException:
        print("--- browser console\n" + "\n".join(log))
        print(f"--- server output\n{output()}")
        raise
    finally:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot), full_page=True)
