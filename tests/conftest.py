from __future__ import annotations

import os

# In-process ASGI apps in tests must not sweep the test database in the
# background; the live server subprocess turns it back on. The environment for
# subprocesses that inherit it, the setting for this one (pytest-django has
# read the settings before this file).
os.environ["ORBIT_MAINTENANCE"] = "0"

import json
from dataclasses import dataclass
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from rest_framework.test import APIClient

from tests.support.alone import turn_of
from tests.support.factories import NamespaceFactory, make_credential

# In-process API views run on the test's own connection, inside its transaction
# (a live server subprocess uses the database pool as in production).
settings.ORBIT_INLINE_DB = True
settings.ORBIT_MAINTENANCE = False


@dataclass
class Tenant:
    namespace: Any
    token: str
    client: APIClient

    @property
    def namespace_id(self) -> str:
        return self.namespace.id


def api_client(token: str | None) -> APIClient:
    client = APIClient()
    if token:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def post_json(client: APIClient, path: str, body: Any, key: str | None = None, **extra: Any) -> Any:
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return client.post(path, data=raw, content_type="application/json", **headers, **extra)


def new_tenant(**credential: Any) -> Tenant:
    """A new application with one credential (make_credential's options) and its client."""
    namespace = NamespaceFactory()
    issued = make_credential(namespace, **credential)
    return Tenant(namespace=namespace, token=issued.token, client=api_client(issued.token))


@pytest.fixture
def tenant(db: None) -> Tenant:
    return new_tenant()


@pytest.fixture
def operator(client: Any) -> Any:
    """A logged-in superuser's Django test client (the console), showing the test's cell."""
    from tests.support.operators import make_user

    user = make_user("operator", "op@example.com", "pw", superuser=True)
    client.force_login(user)
    show_the_tests_cell(client.get)
    return client


@pytest.fixture
def is_mysql() -> bool:
    return connection.vendor == "mysql"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The chaos runs (minutes each) first, alone (tests/support/alone.py): then
    # both processes share the rest, instead of one waiting on them at the end.
    items.sort(key=lambda item: not item.nodeid.startswith("tests/chaos/"))
    spread_over_cells(items)
    if connection.vendor == "mysql":
        return
    skip = pytest.mark.skip(reason="needs MySQL (set ORBIT_MYSQL_DSN)")
    for item in items:
        if "mysql_only" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    with turn_of(item):  # a chaos run alone on the machine (tests/support/alone.py)
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    # A report crosses to pytest-xdist's controller as UTF-8, and a test of lone
    # surrogates captures them in its output: escaped, they cannot end the run.
    report = yield
    report.sections = [(name, text.encode("utf-8", "backslashreplace").decode()) for name, text in report.sections]
    return report


from tests.support.live import orbit_server  # noqa: E402,F401  (session fixture: a real server process)
from tests.support.suite_cells import (  # noqa: E402,F401  (ORBIT_CELLS set)
    _in_the_tests_cell,
    show_the_tests_cell,
    spread_over_cells,
)
