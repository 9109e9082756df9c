"""The console in a real browser: Playwright for Python driving Debian's
Chromium (/usr/bin/chromium, installed by scripts/test with apt when missing;
Playwright never downloads a browser here) against a live server on the test
database. Screenshots go to .local/console-screenshots/."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.live import ROOT, LiveServer
from tests.support.suite_cells import show_the_tests_cell

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = ROOT / ".local" / "console-screenshots"
OPERATOR = ("console-operator", "console-pw-1")


@pytest.fixture(scope="module")
def browser(orbit_server: LiveServer) -> Iterator[Any]:
    """Chromium for this module's tests. Playwright's sync API runs an asyncio
    loop on this thread, which Django's ORM takes for an async context: the
    tests' own database calls are allowed while it runs (they are sync code
    on the main thread), and only then."""
    playwright_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists() and shutil.which("chromium") is None:
        pytest.fail("no /usr/bin/chromium: scripts/test installs it with apt (apt-get install chromium)")
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with playwright_api.sync_playwright() as playwright:
            launched = launch_chromium(playwright)
            yield launched
            launched.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def operator_page(browser: Any, orbit_server: LiveServer, transactional_db: None) -> Iterator[Any]:
    """A page logged in to the live server's console as a superuser made in the test database."""
    from tests.support.operators import make_user

    make_user(OPERATOR[0], "operator@example.com", OPERATOR[1], superuser=True)
    context = browser.new_context(base_url=orbit_server.url, viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(15_000)
    log_in(page, OPERATOR)
    show_the_tests_cell(page.goto)
    yield page
    context.close()


def log_in(page: Any, operator: tuple[str, str]) -> None:
    """Through the console's login form, to the dashboard."""
    page.goto("/admin/login/?next=/admin/")
    page.fill("#id_username", operator[0])
    page.fill("#id_password", operator[1])
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/")


def launch_chromium(playwright: Any) -> Any:
    return playwright.chromium.launch(
        executable_path=str(CHROMIUM if CHROMIUM.exists() else shutil.which("chromium")),
        args=CHROMIUM_ARGS,
        headless=True,
    )


def screenshot(page: Any, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path
