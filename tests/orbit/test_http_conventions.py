"""SPEC §3: envelopes, request ids, JSON bodies, Idempotency-Key, size limit."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.db import OperationalError

from orbit.models import IdempotencyRecord
from queues.models import Queue
from tests.conftest import api_client, post_json
from tests.support.api import HEX32, assert_error, assert_invalid, assert_ok
from tests.support.queues import SEED_CREATE, create_queue


def test_every_response_has_a_fresh_request_id_in_header_and_body(tenant):
    ids = set()
    for response in [
        post_json(tenant.client, "/v1/queues", SEED_CREATE, key="k"),
        post_json(tenant.client, "/v1/queues", SEED_CREATE, key="k"),
        tenant.client.get("/v1/queues"),
        tenant.client.get("/v1/queues/" + "0" * 32),
        api_client(None).get("/v1/queues"),
        tenant.client.get("/v1/nowhere"),
    ]:
        request_id = response.json()["request_id"]
        assert HEX32.fullmatch(request_id)
        assert response["X-Request-Id"] == request_id
        ids.add(request_id)
    assert len(ids) == 6


@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b'{"name": "images",}',
        b"{'name': 'images'}",
        b'{"name": images}',
        b'{"max_concurrency": NaN, "name": "a", "rate_per_second": 1}',
        b'{"max_concurrency": Infinity, "name": "a", "rate_per_second": 1}',
        b'{"max_concurrency": -Infinity, "name": "a", "rate_per_second": 1}',
        b'{"name": "a"} trailing',
        b"\xef\xbb\xbf{}",  # a UTF-8 byte order mark is not JSON
    ],
    ids=[
        "truncated",
        "trailing-comma",
        "single-quotes",
        "bare-word",
        "nan",
        "infinity",
        "minus-infinity",
        "trailing",
        "bom",
    ],
)
def test_malformed_json_is_invalid_argument(tenant, raw):
    assert_error(post_json(tenant.client, "/v1/queues", raw, key="k"), 400, "INVALID_ARGUMENT")
    assert Queue.objects.count() == 0 and IdempotencyRecord.objects.count() == 0


@pytest.mark.parametrize(
    "raw",
    [
        b'{"name": "\xff\xfe", "max_concurrency": 8, "rate_per_second": 100}',
        b'{"name": "images\xc3", "max_concurrency": 8, "rate_per_second": 100}',
        b'{"name": "\xed\xa0\x80", "max_concurrency": 8, "rate_per_second": 100}',  # encoded surrogate
        b'{"name": "\xc0\xaf", "max_concurrency": 8, "rate_per_second": 100}',  # overlong
        b"\x80",
    ],
)
def test_invalid_utf8_is_invalid_argument(tenant, raw):
    message = assert_error(post_json(tenant.client, "/v1/queues", raw, key="k"), 400, "INVALID_ARGUMENT")
    assert "UTF-8" in message
    assert Queue.objects.count() == 0


@pytest.mark.parametrize(
    "raw", [b"[]", b'[{"name": "images"}]', b'"images"', b"42", b"null", b"true"], ids=lambda r: r.decode()
)
def test_body_must_be_a_json_object(tenant, raw):
    assert_error(post_json(tenant.client, "/v1/queues", raw, key="k"), 400, "INVALID_ARGUMENT")


def test_deeply_nested_json_is_invalid_argument_not_internal(tenant):
    raw = b'{"name": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_error(post_json(tenant.client, "/v1/queues", raw, key="k"), 400, "INVALID_ARGUMENT")


def test_lone_surrogate_escapes_never_cause_an_internal_error(tenant):
    # Valid JSON grammar, but no Unicode text: neither the field rules nor the
    # error message that echoes an unknown field's name may break on them.
    for raw in [
        r'{"name": "\ud800", "max_concurrency": 8, "rate_per_second": 100}',
        r'{"name": "images", "max_concurrency": 8, "rate_per_second": 100, "\udfff": 1}',
    ]:
        response = post_json(tenant.client, "/v1/queues", raw, key="k")
        assert_error(response, 400, "INVALID_ARGUMENT")
    queue = create_queue(tenant.client, "images")
    raw = r'{"expected_revision": "1", "reason": "\ud800", "paused": false, "max_concurrency": 1, '
    raw += r'"rate_per_second": 1, "max_unfinished_tasks": 1}'
    assert_invalid(post_json(tenant.client, f"/v1/queues/{queue['id']}:configure", raw, key="c"), "reason")


def test_wrong_content_type_is_invalid_argument(tenant):
    response = tenant.client.post("/v1/queues", data="name=images", content_type="text/plain", HTTP_IDEMPOTENCY_KEY="k")
    assert_error(response, 400, "INVALID_ARGUMENT")
    assert Queue.objects.count() == 0


def test_empty_body_is_a_request_with_every_field_missing(tenant):
    response = tenant.client.post("/v1/queues", data=b"", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k")
    assert_invalid(response, "name")


def test_missing_idempotency_key_is_invalid_argument(tenant):
    message = assert_error(post_json(tenant.client, "/v1/queues", SEED_CREATE, key=None), 400, "INVALID_ARGUMENT")
    assert "Idempotency-Key" in message
    assert Queue.objects.count() == 0


@pytest.mark.parametrize(
    "key",
    ["", "k" * 256, "k" * 1000, "tab\there", "new\nline", "nul\x00", "del\x7f", "bell\x07", "é", "队列"],
    ids=["empty", "256", "1000", "tab", "newline", "nul", "del", "bell", "latin1", "cjk"],
)
def test_bad_idempotency_key_is_invalid_argument(tenant, key):
    message = assert_error(post_json(tenant.client, "/v1/queues", SEED_CREATE, key=key), 400, "INVALID_ARGUMENT")
    assert "Idempotency-Key" in message
    assert Queue.objects.count() == 0 and IdempotencyRecord.objects.count() == 0


@pytest.mark.parametrize("key", ["k", "k" * 255, " ", "a b", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", "0"])
def test_printable_ascii_idempotency_keys_up_to_255_are_accepted(tenant, key):
    assert_ok(post_json(tenant.client, "/v1/queues", SEED_CREATE, key=key), 201)
    assert IdempotencyRecord.objects.get().key == key


@pytest.mark.parametrize(
    "path", ["/v1/nowhere", "/v2/queues", "/v1/queues/", "/v1/queues/x/y", "/", "/v1/queues/abc:explode"]
)
def test_unknown_url_is_a_not_found_envelope(tenant, path):
    assert_error(tenant.client.get(path), 404, "NOT_FOUND")
    assert_error(post_json(tenant.client, path, SEED_CREATE, key="k"), 404, "NOT_FOUND")


def test_unknown_url_is_not_found_even_without_credentials():
    assert_error(api_client(None).get("/v1/nowhere"), 404, "NOT_FOUND")


def test_body_over_the_upload_limit_is_payload_too_large(tenant):
    # given a body one byte over Django's in-memory limit (valid JSON otherwise)
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    head = b'{"name": "images", "max_concurrency": 8, "rate_per_second": 100, "padding": "'
    raw = head + b"x" * (limit + 1 - len(head) - 2) + b'"}'
    assert len(raw) == limit + 1
    # when it is posted
    response = post_json(tenant.client, "/v1/queues", raw, key="k")
    # then 413 PAYLOAD_TOO_LARGE, before any field rule, as compact as every other answer
    assert_error(response, 413, "PAYLOAD_TOO_LARGE")
    assert b", " not in response.content and b'":' in response.content
    assert Queue.objects.count() == 0


def test_body_at_the_upload_limit_is_read(tenant):
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    head = b'{"name": "images", "max_concurrency": 8, "rate_per_second": 100, "padding": "'
    raw = head + b"x" * (limit - len(head) - 2) + b'"}'
    assert len(raw) == limit
    # Read and parsed: the unknown padding field is what gets rejected.
    assert_invalid(post_json(tenant.client, "/v1/queues", raw, key="k"), "padding")


@pytest.mark.parametrize("accept", ["text/html", "application/xml", "image/png;q=1, */*;q=0"])
def test_the_answer_is_json_whatever_accept_asks_for(tenant, accept):
    response = tenant.client.get("/v1/queues", HTTP_ACCEPT=accept)
    assert_ok(response, 200)
    assert response["Content-Type"] == "application/json"
    assert_error(tenant.client.get("/v1/queues/" + "0" * 32, HTTP_ACCEPT=accept), 404, "NOT_FOUND")


@pytest.mark.parametrize("name", ["api", "html", "yaml"])
def test_a_format_parameter_does_not_choose_another_renderer(tenant, name):
    """No endpoint takes `format`: it is refused, in JSON, like any unknown parameter."""
    response = tenant.client.get(f"/v1/queues?format={name}")
    assert_error(response, 400, "INVALID_ARGUMENT")
    assert response.json()["error"]["message"] == "format: unknown query parameter"
    assert response["Content-Type"] == "application/json"


def test_an_unknown_url_answers_compact_json_like_every_other_answer(tenant):
    raw = tenant.client.get("/v1/nowhere").content
    assert raw.startswith(b'{"request_id":"') and b'","error":{"code":"NOT_FOUND","message":"no such endpoint"}}' in raw


def test_the_openapi_document_is_json_for_any_accept(tenant):
    for accept in ["*/*", "text/html", "application/json"]:
        response = tenant.client.get("/v1/openapi.json", HTTP_ACCEPT=accept)
        assert response.status_code == 200
        assert response["Content-Type"].startswith("application/vnd.oai.openapi+json")
        assert response.json()["paths"]["/v1/queues"]
    # the contract holds no data: readable without a credential (SPEC §11)
    anonymous = api_client(None).get("/v1/openapi.json")
    assert anonymous.status_code == 200
    assert anonymous.json()["paths"]["/v1/queues"]


def test_wrong_method_is_a_json_envelope_not_internal(tenant):
    assert_error(tenant.client.delete("/v1/queues"), 405, "INVALID_ARGUMENT")
    assert_error(tenant.client.put("/v1/queues/" + "0" * 32), 405, "INVALID_ARGUMENT")


@pytest.mark.parametrize("path", ["/v1/queues", "/v1/queues/" + "0" * 32, "/v1/tasks", "/v1/tasks:batch"])
def test_options_answers_in_the_success_envelope(tenant, path):
    response = tenant.client.options(path)
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"request_id", "data"} and response["X-Request-Id"] == body["request_id"]
    assert body["data"]["renders"] == ["application/json"] and body["data"]["parses"] == ["application/json"]


@pytest.mark.parametrize("errno", [2006, 2013, 1040], ids=["server-gone", "lost-connection", "too-many-connections"])
def test_database_unreachable_is_unavailable(tenant, monkeypatch, errno):
    def unreachable(**kwargs):
        raise OperationalError(errno, "database unreachable")

    monkeypatch.setattr("queues.actions.queue_list", unreachable)
    assert_error(tenant.client.get("/v1/queues"), 503, "UNAVAILABLE")
