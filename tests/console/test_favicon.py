"""/favicon.ico answers the console's icon, never a 404."""

from django.test import Client


def test_favicon_is_the_consoles_icon():
    answer = Client().get("/favicon.ico")
    assert answer.status_code == 200
    assert answer["Content-Type"] == "image/svg+xml"
    assert answer.content.startswith(b"<svg") and b"circle" in answer.content
