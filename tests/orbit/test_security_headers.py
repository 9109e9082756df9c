"""Issue 35 (5 and the TLS settings): no answer of a live server may be framed,
whichever handler made it, and ORBIT_TLS turns on Secure cookies and HSTS.

Black box: plain HTTP requests to real server processes, as a browser or an
attacker's page would send them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.support.api import make_queue
from tests.support.keys import task_body
from tests.support.live import ROOT, LiveServer, server_env

pytestmark = pytest.mark.django_db(transaction=True)

NO_FRAMING = {"X-Frame-Options": "DENY", "Content-Security-Policy": "frame-ancestors 'none'"}


def assert_not_frameable(response: requests.Response) -> None:
    for name, value in NO_FRAMING.items():
        assert response.headers.get(name) == value, (response.request.method, response.url, dict(response.headers))


def test_no_answer_of_the_live_server_may_be_framed(tenant, orbit_server):
    queue = make_queue(tenant.client, "framed", rate_per_second=1000)
    bearer = {"Authorization": f"Bearer {tenant.token}"}
    answers = [
        # the console: Django's full handler (the page the attack framed, and its login)
        requests.get(f"{orbit_server.url}/admin/auth/user/2/delete/", allow_redirects=False, timeout=10),
        requests.get(f"{orbit_server.url}/admin/login/", timeout=10),
        requests.get(f"{orbit_server.url}/static/admin/css/base.css", timeout=10),
        requests.get(f"{orbit_server.url}/healthz", timeout=10),
        # the API's handler, refusing and answering
        requests.get(f"{orbit_server.url}/v1/queues", timeout=10),
        requests.get(f"{orbit_server.url}/v1/queues", headers=bearer, timeout=10),
        # the submit route that answers from the ASGI scope (tasks/submit_route.py)
        requests.post(
            f"{orbit_server.url}/v1/tasks",
            json=task_body(queue["id"]),
            headers={**bearer, "Idempotency-Key": "framed-1"},
            timeout=10,
        ),
    ]
    assert [answer.status_code for answer in answers] == [302, 200, 200, 200, 401, 200, 201]
    for answer in answers:
        assert_not_frameable(answer)
        # each header once: the console's own X-Frame-Options is not doubled
        assert answer.raw.headers.getlist("X-Frame-Options") == ["DENY"]


def test_the_console_refuses_framing_under_any_entry_point(admin_client):
    """Django's handler alone (the test client, any other ASGI/WSGI server): its
    clickjacking middleware still refuses the delete page to a frame."""
    response = admin_client.get("/admin/auth/user/")
    assert response.status_code == 200 and response["X-Frame-Options"] == "DENY"


# ----------------------------------------------------------------------------- TLS settings


def settings_under(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """server.settings as a process started with `env` reads it."""
    names = (
        "SESSION_COOKIE_SECURE",
        "CSRF_COOKIE_SECURE",
        "SECURE_HSTS_SECONDS",
        "SECURE_HSTS_INCLUDE_SUBDOMAINS",
        "SECURE_PROXY_SSL_HEADER",
    )
    code = f"import server.settings as s; print([getattr(s, n, None) for n in {names!r}])"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ORBIT_TLS", "ORBIT_HSTS", "ORBIT_TRUST"))}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, [False, False, 0, False, None]),
        ({"ORBIT_TLS": "1"}, [True, True, 31_536_000, False, None]),
        ({"ORBIT_TLS": "1", "ORBIT_HSTS_SECONDS": "0"}, [True, True, 0, False, None]),
        (
            {"ORBIT_TLS": "1", "ORBIT_HSTS_SECONDS": "600", "ORBIT_HSTS_INCLUDE_SUBDOMAINS": "1"},
            [True, True, 600, True, None],
        ),
        # HSTS seconds mean nothing without TLS: a plain-HTTP server never pins browsers
        ({"ORBIT_HSTS_SECONDS": "600"}, [False, False, 0, False, None]),
        ({"ORBIT_TRUST_X_FORWARDED_PROTO": "1"}, [False, False, 0, False, ("HTTP_X_FORWARDED_PROTO", "https")]),
    ],
)
def test_the_tls_settings_read_from_the_environment(env, expected):
    read = settings_under(env)
    assert read.returncode == 0, read.stderr
    assert read.stdout.strip() == repr(expected)


@pytest.mark.parametrize(
    ("env", "named"),
    [({"ORBIT_TLS": "yes"}, "ORBIT_TLS"), ({"ORBIT_TLS": "1", "ORBIT_HSTS_SECONDS": "1y"}, "ORBIT_HSTS_SECONDS")],
)
def test_a_malformed_tls_setting_stops_the_start_naming_it(env, named):
    read = settings_under(env)
    assert read.returncode != 0 and named in read.stderr


@pytest.fixture(scope="module")
def tls_server(django_db_blocker: Any) -> Iterator[LiveServer]:
    """A live server configured as behind a TLS-terminating proxy."""
    with django_db_blocker.unblock():
        env = server_env({"ORBIT_TLS": "1", "ORBIT_HSTS_SECONDS": "600", "ORBIT_TRUST_X_FORWARDED_PROTO": "1"})
    server = LiveServer(env)
    yield server
    server.stop()


def test_behind_tls_the_cookies_are_secure_and_hsts_is_sent(tls_server, orbit_server):
    proxied = {"X-Forwarded-Proto": "https"}
    login = requests.get(f"{tls_server.url}/admin/login/", headers=proxied, timeout=10)
    assert login.status_code == 200
    assert "secure" in login.headers["Set-Cookie"].lower()  # the CSRF cookie
    assert login.headers["Strict-Transport-Security"] == "max-age=600"
    assert_not_frameable(login)
    # a client reaching the TLS server without the proxy's word gets no HSTS over plain HTTP
    assert "Strict-Transport-Security" not in requests.get(f"{tls_server.url}/admin/login/", timeout=10).headers
    # the default server (plain HTTP, development): neither
    plain = requests.get(f"{orbit_server.url}/admin/login/", headers=proxied, timeout=10)
    assert "secure" not in plain.headers["Set-Cookie"].lower()
    assert "Strict-Transport-Security" not in plain.headers
