"""The console across cells in Chromium: every page shows one cell with a
picker for the others, a list shows only that cell's rows, and a task's page
opened by id finds the cell that holds it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests.console.conftest import CHROMIUM, launch_chromium, log_in, screenshot
from tests.support.cells import MARKS, Installation

pytestmark = MARKS
OPERATOR = ("cells-operator", "cells-pw-1")


@pytest.fixture(scope="module")
def operator_page(installation: Installation) -> Iterator[Any]:
    playwright_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists() and shutil.which("chromium") is None:
        pytest.fail("no /usr/bin/chromium: scripts/test installs it with apt (apt-get install chromium)")
    # The operator is the directory's (Django's users live there with cells).
    installation.manage(
        "shell", "-c",
        "from django.contrib.auth import get_user_model; "
        f"get_user_model().objects.create_superuser({OPERATOR[0]!r}, 'op@example.com', {OPERATOR[1]!r})",
    )  # fmt: skip
    assert installation.server is not None
    with playwright_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        context = browser.new_context(base_url=installation.server.url, viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page.set_default_timeout(15_000)
        log_in(page, OPERATOR)
        yield page
        context.close()
        browser.close()


def picked(page: Any) -> str:
    return page.locator(".orbit-cells strong[aria-current=true]").inner_text()


def test_each_page_shows_one_cell_and_the_picker_switches(installation: Installation, operator_page: Any) -> None:
    in_a = installation.submit("alpha", f"console-a-{os.getpid()}").json()["data"]["task"]["id"]
    in_b = installation.submit("beta", f"console-b-{os.getpid()}").json()["data"]["task"]["id"]
    page = operator_page
    page.goto("/admin/")
    assert picked(page) == "a"
    assert page.locator(".orbit-cells a").all_inner_texts() == ["b"]
    # A search by id finds a task of the cell shown, and no other cell's.
    page.goto(f"/admin/tasks/task/?q={in_a}")
    assert page.locator(f"text={in_a[:8]}").count() >= 1
    screenshot(page, "cells-tasks-a.png")
    page.goto(f"/admin/tasks/task/?q={in_b}")
    assert page.locator(f"text={in_b[:8]}").count() == 0

    page.click(".orbit-cells a:text('b')")
    page.wait_for_url(f"**/admin/tasks/task/?q={in_b}")
    assert picked(page) == "b"
    assert page.locator(f"text={in_b[:8]}").count() >= 1
    page.goto(f"/admin/tasks/task/?q={in_a}")
    assert page.locator(f"text={in_a[:8]}").count() == 0
    page.goto("/admin/queues/queue/")
    assert picked(page) == "b"  # kept for the rest of the session

    # Cell b is shown; alpha's task (cell a) opened by its id is found there.
    page.goto(f"/admin/tasks/task/{in_a}/change/")
    assert picked(page) == "a"
    assert in_a in page.content()
    screenshot(page, "cells-task-by-id.png")


def test_a_frozen_cell_answers_503_and_the_other_cells_pages_still_open(
    installation: Installation, operator_page: Any
) -> None:
    in_a = installation.submit("alpha", f"frozen-console-a-{os.getpid()}").json()["data"]["task"]["id"]
    page = operator_page
    page.goto("/admin/?cell=b")
    assert picked(page) == "b"
    installation.private.freeze()
    try:
        # The frozen cell's pages say so (503), not an internal error.
        answer = page.goto("/admin/tasks/task/")
        assert answer is not None and answer.status == 503, answer and answer.status
        assert "cell b does not answer" in page.content()
        assert page.locator(".orbit-cells a:text('a')").count() == 1  # the way to another cell
        # A task of cell a opened by its id is found there, past the frozen cell it is picked in.
        answer = page.goto(f"/admin/tasks/task/{in_a}/change/")
        assert answer is not None and answer.status == 200
        assert picked(page) == "a" and in_a in page.content()
    finally:
        installation.private.thaw()
