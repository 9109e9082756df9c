"""manage.py orbit_credential create / list / revoke."""

from __future__ import annotations

import io
import json
import stat

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from orbit.models import Credential
from tests.conftest import api_client, post_json
from tests.support.api import assert_error, assert_ok
from tests.support.queues import SEED_CREATE, create_queue, get_queue

FILE_KEYS = {"url", "token", "application_id", "namespace_id", "environment", "queue_id", "scopes"}


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("orbit_credential", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def bootstrapped(db, tmp_path):
    output = tmp_path / "bootstrap.json"
    call_command(
        "orbit_bootstrap",
        application="resources-demo",
        namespace="default",
        environment="development",
        queue="bootstrap",
        output=str(output),
        stdout=io.StringIO(),
    )
    return json.loads(output.read_text())


def create(tmp_path, *, scopes: str, queues: str, name: str = "", filename: str = "cred.json", extra=()) -> dict:
    output = tmp_path / filename
    run(
        "create",
        "--application",
        "resources-demo",
        "--namespace",
        "default",
        "--environment",
        "development",
        "--scopes",
        scopes,
        "--queues",
        queues,
        "--name",
        name,
        "--output",
        str(output),
        *extra,
    )
    return json.loads(output.read_text())


def test_create_writes_the_same_file_format(bootstrapped, tmp_path):
    content = create(tmp_path, scopes="queues:read,tasks:read", queues="all", name="reader")
    assert set(content) == FILE_KEYS
    assert stat.S_IMODE((tmp_path / "cred.json").stat().st_mode) == 0o600
    assert content["application_id"] == bootstrapped["application_id"]
    assert content["namespace_id"] == bootstrapped["namespace_id"]
    assert content["environment"] == "development"
    assert content["scopes"] == ["queues:read", "tasks:read"]
    credential = Credential.objects.get(id=content["token"].split("_")[1])
    assert (credential.name, credential.queue_ids, credential.revoked_at) == ("reader", None, None)
    # the token reads, and lacks manage
    client = api_client(content["token"])
    assert_ok(get_queue(client, bootstrapped["queue_id"]))
    assert_error(post_json(client, "/v1/queues", SEED_CREATE, key="k"), 403, "PERMISSION_DENIED")


def test_create_with_a_queue_range(bootstrapped, tmp_path):
    # given a second queue in the namespace
    admin = api_client(bootstrapped["token"])
    other = create_queue(admin, "images", key="queue-images-v1")
    # when a credential is minted for the bootstrap queue only
    content = create(tmp_path, scopes="queues:read,queues:manage", queues=bootstrapped["queue_id"])
    assert content["queue_id"] == bootstrapped["queue_id"]
    client = api_client(content["token"])
    # then it sees that queue, not the other, and cannot create
    assert_ok(get_queue(client, bootstrapped["queue_id"]))
    assert_error(get_queue(client, other["id"]), 404, "NOT_FOUND")
    assert_error(post_json(client, "/v1/queues", {**SEED_CREATE, "name": "x"}, key="k"), 403, "PERMISSION_DENIED")
    assert [item["id"] for item in assert_ok(client.get("/v1/queues"))["items"]] == [bootstrapped["queue_id"]]


def test_list_and_revoke(bootstrapped, tmp_path):
    # given a minted credential that works
    content = create(tmp_path, scopes="queues:read", queues="all", name="temp")
    credential_id = content["token"].split("_")[1]
    client = api_client(content["token"])
    assert_ok(get_queue(client, bootstrapped["queue_id"]))
    listed = {line.split("\t")[0]: line.split("\t") for line in run("list").splitlines()}
    assert listed[credential_id][1] == "active"
    assert content["token"].split("_", 2)[2] not in run("list")
    # when it is revoked
    assert credential_id in run("revoke", credential_id)
    # then its token is refused and the list says so
    assert_error(get_queue(client, bootstrapped["queue_id"]), 401, "UNAUTHENTICATED")
    listed = {line.split("\t")[0]: line.split("\t") for line in run("list").splitlines()}
    assert listed[credential_id][1] == "revoked"
    # and the bootstrap credential is unaffected
    assert_ok(get_queue(api_client(bootstrapped["token"]), bootstrapped["queue_id"]))


def test_revoke_twice_keeps_the_first_time(bootstrapped):
    credential_id = bootstrapped["token"].split("_")[1]
    run("revoke", credential_id)
    first = Credential.objects.get(id=credential_id).revoked_at
    run("revoke", credential_id)
    assert Credential.objects.get(id=credential_id).revoked_at == first


def test_revoke_unknown_credential_fails(db):
    with pytest.raises(CommandError):
        run("revoke", "0" * 32)


def test_create_for_an_unknown_namespace_fails_without_a_file(bootstrapped, tmp_path):
    output = tmp_path / "nope.json"
    before = Credential.objects.count()
    with pytest.raises(CommandError):
        run(
            "create",
            "--application",
            "resources-demo",
            "--namespace",
            "missing",
            "--environment",
            "development",
            "--scopes",
            "queues:read",
            "--queues",
            "all",
            "--output",
            str(output),
        )
    assert not output.exists() and Credential.objects.count() == before


@pytest.mark.parametrize("scopes", ["queues:admin", "", ",", "queues:read,root"])
def test_create_with_unknown_scopes_fails(bootstrapped, tmp_path, scopes):
    before = Credential.objects.count()
    with pytest.raises(CommandError, match="scopes"):
        create(tmp_path, scopes=scopes, queues="all")
    assert not (tmp_path / "cred.json").exists() and Credential.objects.count() == before


def test_create_refuses_to_overwrite(bootstrapped, tmp_path):
    create(tmp_path, scopes="queues:read", queues="all")
    original = (tmp_path / "cred.json").read_bytes()
    before = Credential.objects.count()
    with pytest.raises(CommandError, match="overwrite"):
        create(tmp_path, scopes="queues:read", queues="all")
    assert (tmp_path / "cred.json").read_bytes() == original
    assert Credential.objects.count() == before
    replaced = create(tmp_path, scopes="queues:manage", queues="all", extra=("--overwrite",))
    assert replaced["scopes"] == ["queues:manage"]
