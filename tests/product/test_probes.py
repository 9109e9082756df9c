"""GET /healthz and GET /readyz: no credential, cheap, and a 1 s bound on the
readiness answer even when the database server is frozen."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from orbit import cells
from server import probes
from server.probes import Readiness, check_database, database_settings, open_connection
from tests.conftest import api_client
from tests.product.conftest import closed_port, mysql_settings


@pytest.fixture
def readiness(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Installs a Readiness of the test's choosing behind GET /readyz."""
    made: list[Readiness] = []

    def install(settings_dict: dict[str, Any] | None = None, timeout: float = probes.PROBE_SECONDS) -> Readiness:
        checker = Readiness(settings_dict, timeout)
        monkeypatch.setattr(probes, "READINESS", checker)
        made.append(checker)
        return checker

    yield install
    for checker in made:
        checker._executor.shutdown(wait=False)


def assert_unavailable(response: Any, reason: str) -> None:
    assert response.status_code == 503, response.content
    body = response.json()
    assert set(body) == {"request_id", "error"}
    assert body["request_id"] == response["X-Request-Id"]
    assert body["error"]["code"] == "UNAVAILABLE"
    assert reason in body["error"]["message"], body


def test_healthz_answers_without_a_credential_or_the_database(django_db_blocker):
    # No db fixture: any database access would fail the test.
    response = api_client(None).get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["data"] == {"status": "ok"} and body["request_id"] == response["X-Request-Id"]
    assert response["Cache-Control"] == "no-store"


@pytest.mark.django_db
def test_a_credential_is_not_needed_and_a_bad_one_is_not_refused(readiness):
    readiness()
    for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer orb_nonsense"}):
        assert api_client(None).get("/healthz", **headers).status_code == 200
        assert api_client(None).get("/readyz", **headers).status_code == 200


@pytest.mark.django_db(transaction=True)
def test_readyz_is_200_on_the_migrated_database_and_then_one_query_per_poll(readiness):
    checker = readiness()
    first = api_client(None).get("/readyz")
    assert first.status_code == 200, first.content
    # With cells, each cell's state too (SPEC §14).
    in_cells = {"cells": dict.fromkeys(cells.names(), "ready")} if cells.configured() else {}
    assert first.json()["data"] == {"status": "ready", **in_cells}
    assert checker.migrated
    # Later polls only ask the database whether it answers: the migration
    # graph is not read again (it took tens of ms; SELECT 1 takes well under one).
    with CaptureQueriesContext(checker._connection) as polled:
        for _ in range(5):
            assert api_client(None).get("/readyz").status_code == 200
    assert [query["sql"] for query in polled.captured_queries] == ["SELECT 1"] * 5
    # And never on the request's own connection.
    with CaptureQueriesContext(connection) as queries:
        assert api_client(None).get("/readyz").status_code == 200
    assert len(queries) == 0


@pytest.mark.django_db
def test_readyz_is_503_while_migrations_are_not_applied(readiness, empty_database):
    readiness(empty_database)
    assert_unavailable(api_client(None).get("/readyz"), "not applied")
    assert "orbit migrate" in api_client(None).get("/readyz").json()["error"]["message"]


def assert_logged(caplog: pytest.LogCaptureFixture, detail: str) -> None:
    """The operator's detail is in the server log, at WARNING."""
    logged = [r.getMessage() for r in caplog.records if r.name == "server.probes" and r.levelname == "WARNING"]
    assert any(detail in message for message in logged), logged


@pytest.mark.django_db
def test_readyz_is_503_when_the_database_server_is_unreachable(readiness, caplog):
    port = closed_port()
    readiness(mysql_settings(port))
    started = time.monotonic()
    response = api_client(None).get("/readyz")
    assert time.monotonic() - started < 1.5
    assert_unavailable(response, "not ready: database unreachable")
    assert "127.0.0.1" not in response.content.decode() and str(port) not in response.content.decode()
    assert_logged(caplog, f"cannot reach the database server at 127.0.0.1:{port}")


@pytest.mark.django_db
def test_a_probe_polling_through_an_outage_logs_it_once(readiness, caplog):
    """A load balancer polls /readyz every second: an hour's outage is one line
    (the detail, when it begins), not Django's "Service Unavailable" per poll."""
    readiness(mysql_settings(closed_port()))
    for _ in range(5):
        assert api_client(None).get("/readyz").status_code == 503
    said = [(r.name, r.levelname) for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == [("server.probes", "WARNING")], [r.getMessage() for r in caplog.records]


@pytest.mark.django_db
def test_readyz_is_503_for_a_database_that_does_not_exist(readiness, caplog):
    if connection.vendor == "sqlite":
        readiness({**database_settings(), "NAME": "/nonexistent/orbit.sqlite3"})
        assert_unavailable(api_client(None).get("/readyz"), "not ready: database unreachable")
        assert_logged(caplog, "database file /nonexistent/orbit.sqlite3 does not exist")
    else:
        readiness({**database_settings(), "NAME": "orbit_no_such_database"})
        response = api_client(None).get("/readyz")
        assert_unavailable(response, "not ready: database unreachable")
        assert "orbit_no_such_database" not in response.content.decode()
        assert_logged(caplog, 'database "orbit_no_such_database" does not exist')


@pytest.mark.mysql_only  # SQLite has no server to refuse a password
@pytest.mark.django_db
def test_readyz_names_no_database_user_host_port_or_name_without_a_credential(readiness, caplog):
    """Issue 35 (6): the 503 of a refused login named the user, host, port and database."""
    settings_dict = {**database_settings(), "PASSWORD": "not-the-password"}
    readiness(settings_dict)
    response = api_client(None).get("/readyz")
    assert_unavailable(response, "database unreachable")
    assert response.json()["error"]["message"] == "not ready: database unreachable"
    for secret in (settings_dict["USER"], settings_dict["HOST"], settings_dict["PORT"], settings_dict["NAME"]):
        assert str(secret) not in response.content.decode()
    assert_logged(caplog, f"refused the credentials: Access denied for user '{settings_dict['USER']}'@")
    # polled again with the same failure: one log line, not one per poll
    caplog.clear()
    for _ in range(3):
        assert api_client(None).get("/readyz").status_code == 503
    assert [r for r in caplog.records if r.name == "server.probes"] == []


@pytest.mark.django_db
def test_readyz_answers_within_1_s_when_the_database_is_frozen(readiness, frozen_server):
    readiness(mysql_settings(frozen_server))
    for _ in range(2):
        started = time.monotonic()
        response = api_client(None).get("/readyz")
        elapsed = time.monotonic() - started
        assert response.status_code == 503, response.content
        assert elapsed < 1.5, elapsed


@pytest.mark.django_db
def test_a_frozen_database_holds_one_check_however_often_it_is_polled(frozen_server):
    # A bound below the driver's 1 s timeout: the check is still stuck when
    # each poll gives up, and every poll waits on that same check.
    checker = Readiness(mysql_settings(frozen_server), timeout=0.3)
    try:
        started = time.monotonic()
        reasons = [asyncio.run(checker.reason()) for _ in range(2)]
        assert time.monotonic() - started < 0.9
        assert [(r.public, r.detail) for r in reasons if r] == [
            ("database unreachable", "the database did not answer within 0.3 s")
        ] * 2
        assert checker.start() is checker.start()
        # Once the driver gives up (connect_timeout 1 s) the check ends with its reason.
        ended = checker.start().result(timeout=10)
        assert ended is not None and "database" in ended.detail
    finally:
        checker._executor.shutdown(wait=False)


@pytest.mark.django_db
def test_the_start_up_check_names_what_is_wrong(empty_database):
    assert check_database() is None
    assert "migrations not applied (first: " in (check_database(empty_database) or "")
    assert check_database(mysql_settings(closed_port()), timeout=1).startswith("cannot reach the database server")


def test_the_probe_connection_keeps_its_1_s_timeouts_in_a_serving_process(monkeypatch):
    from orbit.db.mysql import base as mysql_backend

    # orbit.asgi sets serving timeouts (seconds longer) on every connection the process opens.
    monkeypatch.setattr(mysql_backend, "serving", True)
    params = open_connection(mysql_settings(closed_port()), probes.PROBE_SECONDS).get_connection_params()
    assert (params["connect_timeout"], params["read_timeout"], params["write_timeout"]) == (1, 1, 1)
