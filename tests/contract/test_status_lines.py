"""Every status line of a live server carries the standard reason phrase:
Twisted's table has none for 429, which went out as "429 Unknown Status"
(server.reason_phrases)."""

from __future__ import annotations

import http.client
import json
from http import HTTPStatus
from urllib.parse import urlsplit

import httpx
import pytest

from orbit.models import SCOPES
from server.reason_phrases import install
from tests.support.contract import fresh_key
from tests.support.factories import NamespaceFactory, make_credential
from tests.support.live import LiveServer

pytestmark = pytest.mark.django_db(transaction=True)


def status_line(server: LiveServer, method: str, path: str, token: str | None, body: object = None) -> tuple[int, str]:
    address = urlsplit(server.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
    headers = {"Content-Type": "application/json", "Idempotency-Key": fresh_key()}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status, response.reason
    finally:
        connection.close()


def test_install_gives_twisted_every_standard_phrase():
    from twisted.web import http as twisted_http

    install()
    install()  # idempotent
    assert twisted_http.RESPONSES[429] == b"Too Many Requests"
    assert all(twisted_http.RESPONSES[status.value] == status.phrase.encode() for status in HTTPStatus)


def test_queue_full_goes_out_as_429_too_many_requests(orbit_server):
    token = make_credential(NamespaceFactory(), scopes=list(SCOPES)).token
    queue = {"name": "full", "max_concurrency": 1, "rate_per_second": 1, "max_unfinished_tasks": 1}
    assert status_line(orbit_server, "POST", "/v1/queues", token, queue) == (201, "Created")
    listed = httpx.get(f"{orbit_server.url}/v1/queues", headers={"Authorization": f"Bearer {token}"})
    queue_id = listed.json()["data"]["items"][0]["id"]
    task = {"queue_id": queue_id, "handler": "h", "handler_version": "1", "payload_version": "1", "payload": {}}
    assert status_line(orbit_server, "POST", "/v1/tasks", token, task) == (201, "Created")
    assert status_line(orbit_server, "POST", "/v1/tasks", token, task) == (429, "Too Many Requests")
    # And the other statuses the API answers, by their standard phrases.
    for status, (method, path, credential, body) in {
        400: ("POST", "/v1/queues", token, {"name": ""}),
        401: ("GET", "/v1/queues", None, None),
        404: ("GET", "/v1/queues/0123456789abcdef0123456789abcdef", token, None),
    }.items():
        assert status_line(orbit_server, method, path, credential, body) == (status, HTTPStatus(status).phrase)
