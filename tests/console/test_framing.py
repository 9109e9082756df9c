"""Issue 35 (5): a page on another port framed the console's user delete page,
and one click on it deleted the user. The attack again, in Chromium: the
operator logged in, the attacker's page framing the delete confirmation."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from tests.support.operators import make_user

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def attacker_site() -> Iterator[dict[str, Any]]:
    """A web server on another port; `page["html"]` is what it answers."""
    page: dict[str, Any] = {"html": ""}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = page["html"].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    page["url"] = f"http://127.0.0.1:{server.server_address[1]}/"
    yield page
    server.shutdown()
    server.server_close()


def test_another_site_cannot_frame_the_delete_confirmation(operator_page, orbit_server, attacker_site):
    victim = make_user("victim", "v@example.com", "pw")
    delete_url = f"{orbit_server.url}/admin/auth/user/{victim.pk}/delete/"
    # the operator's own tab shows the confirmation (the page works, unframed)
    operator_page.goto(delete_url)
    assert operator_page.locator("input[type=submit]").count() == 1
    attacker_site["html"] = (
        f'<html><body><iframe id="bait" src="{delete_url}" width="800" height="600"></iframe></body></html>'
    )
    operator_page.goto(attacker_site["url"])
    operator_page.wait_for_load_state("load")
    framed = [frame for frame in operator_page.frames if frame is not operator_page.main_frame]
    assert len(framed) == 1
    # Chromium refused to render the console inside the frame: no form to click
    assert framed[0].locator("input[type=submit]").count() == 0
    assert "Are you sure" not in framed[0].content()
    assert get_user_model().objects.filter(pk=victim.pk).exists()
