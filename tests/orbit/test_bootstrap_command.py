"""manage.py orbit_bootstrap: application, namespace, queue and a credential file."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import OperationalError

from orbit.models import Application, ApplicationState, AuditEntry, Credential, Event, Namespace
from queues.models import Queue, QueueState
from tests.conftest import api_client, post_json
from tests.support.api import HEX32, assert_ok
from tests.support.queues import SEED_CREATE, get_queue

FILE_KEYS = {"url", "token", "application_id", "namespace_id", "environment", "queue_id", "scopes"}
MANAGE_SCOPES = ["keys:manage", "queues:manage", "queues:read", "tasks:cancel", "tasks:read", "tasks:submit"]


@pytest.fixture(autouse=True)
def no_orbit_url(monkeypatch):
    monkeypatch.delenv("ORBIT_URL", raising=False)


def bootstrap(output, *, application="resources-demo", queue="bootstrap", **extra):
    call_command(
        "orbit_bootstrap",
        application=application,
        namespace="default",
        environment="development",
        queue=queue,
        output=str(output),
        stdout=open(os.devnull, "w"),  # noqa: SIM115
        **extra,
    )


def read_file(path) -> dict:
    return json.loads(path.read_text())


def mode_of(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def counts() -> tuple[int, ...]:
    return (
        Application.objects.count(),
        Namespace.objects.count(),
        Queue.objects.count(),
        Credential.objects.count(),
    )


def test_bootstrap_writes_the_credentials_file(db, tmp_path):
    # given an empty database
    output = tmp_path / ".local" / "resources.credentials.json"
    # when bootstrap runs
    bootstrap(output)
    # then the file has exactly the seven keys, mode 0600
    content = read_file(output)
    assert set(content) == FILE_KEYS
    assert mode_of(output) == 0o600
    assert content["url"] == f"http://{settings.ORBIT_HTTP_ADDR}"
    assert content["environment"] == "development"
    assert content["scopes"] == MANAGE_SCOPES
    for field in ("application_id", "namespace_id", "queue_id"):
        assert HEX32.fullmatch(content[field]), field
    # and the rows it names exist, with the queue's defaults
    application = Application.objects.get(name="resources-demo")
    assert application.id == content["application_id"]
    assert ApplicationState.objects.filter(application_id=application.id).exists()
    namespace = Namespace.objects.get(id=content["namespace_id"])
    assert (namespace.application_id, namespace.environment, namespace.name) == (
        application.id,
        "development",
        "default",
    )
    queue = Queue.objects.get(id=content["queue_id"])
    assert (queue.namespace_id, queue.application_id, queue.name) == (namespace.id, application.id, "bootstrap")
    assert (queue.max_concurrency, queue.rate_per_second, queue.max_unfinished_tasks) == (8, 100, 100_000)
    assert (queue.paused, queue.revision, queue.retired_at) == (False, 1, None)
    assert QueueState.objects.filter(queue_id=queue.id, unfinished_tasks=0).exists()
    # and the credential covers all queues of the namespace, stored only as a hash
    prefix, credential_id, secret = content["token"].split("_", 2)
    assert prefix == "orb"
    credential = Credential.objects.get(id=credential_id)
    assert credential.namespace_id == namespace.id and credential.queue_ids is None
    assert credential.scopes == MANAGE_SCOPES
    assert credential.secret_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in json.dumps(list(Credential.objects.values()), default=str)


def test_the_queue_bootstrap_creates_has_its_audit_row_and_event_as_the_apis(db, tmp_path):
    # SPEC §3: a queue create writes an audit row and an event in its transaction.
    bootstrap(tmp_path / "first.json")
    content = read_file(tmp_path / "first.json")
    credential_id = content["token"].split("_", 2)[1]
    (entry,) = AuditEntry.objects.filter(target_id=content["queue_id"])
    assert (entry.action, entry.target_type, entry.credential_id, entry.namespace_id, entry.before) == (
        "queue.created",
        "queue",
        credential_id,
        content["namespace_id"],
        None,
    )
    assert entry.after == assert_ok(get_queue(api_client(content["token"]), content["queue_id"]))
    (event,) = Event.objects.filter(subject_id=content["queue_id"])
    assert (event.type, event.seq, event.data["after"]) == ("queue.created", 1, entry.after)
    # a second run reuses the queue: nothing more is recorded for it
    bootstrap(tmp_path / "second.json")
    assert AuditEntry.objects.filter(target_id=content["queue_id"]).count() == 1


def test_bootstrap_token_works_against_the_api(db, tmp_path):
    output = tmp_path / "creds.json"
    bootstrap(output)
    content = read_file(output)
    client = api_client(content["token"])
    queue = assert_ok(get_queue(client, content["queue_id"]))
    assert queue["name"] == "bootstrap" and queue["namespace_id"] == content["namespace_id"]
    # all-queues range and queues:manage: it may create queues
    assert_ok(post_json(client, "/v1/queues", SEED_CREATE, key="queue-images-v1"), 201)


def test_bootstrap_again_reuses_everything_but_the_credential(db, tmp_path):
    # given a first bootstrap
    bootstrap(tmp_path / "first.json")
    first = read_file(tmp_path / "first.json")
    before = counts()
    # when it runs again with the same names into another file
    bootstrap(tmp_path / "second.json")
    second = read_file(tmp_path / "second.json")
    # then application, namespace and queue are the same; only a new credential exists
    for field in ("application_id", "namespace_id", "queue_id", "environment", "scopes"):
        assert second[field] == first[field], field
    assert second["token"] != first["token"]
    assert counts() == (before[0], before[1], before[2], before[3] + 1)
    # and both tokens work
    for content in (first, second):
        assert_ok(get_queue(api_client(content["token"]), content["queue_id"]))


def test_bootstrap_reuses_a_queue_whose_configuration_changed(db, tmp_path):
    bootstrap(tmp_path / "first.json")
    first = read_file(tmp_path / "first.json")
    Queue.objects.filter(id=first["queue_id"]).update(max_concurrency=2, revision=5)
    bootstrap(tmp_path / "second.json")
    assert read_file(tmp_path / "second.json")["queue_id"] == first["queue_id"]
    assert Queue.objects.get(id=first["queue_id"]).max_concurrency == 2


@pytest.mark.parametrize("fresh_names", [False, True], ids=["same-names", "new-names"])
def test_bootstrap_refuses_to_overwrite_and_creates_nothing(db, tmp_path, fresh_names):
    # given an existing output file
    output = tmp_path / "creds.json"
    bootstrap(output)
    original = output.read_bytes()
    before = counts()
    # when bootstrap targets it again without --overwrite
    names = {"application": "another-app", "queue": "another-queue"} if fresh_names else {}
    with pytest.raises(CommandError, match="overwrite"):
        bootstrap(output, **names)
    # then the file is untouched and no row was created
    assert output.read_bytes() == original
    assert counts() == before


def test_bootstrap_overwrite_replaces_the_file_with_mode_0600(db, tmp_path):
    output = tmp_path / "creds.json"
    output.write_text("{}")
    output.chmod(0o644)
    bootstrap(output, overwrite=True)
    assert set(read_file(output)) == FILE_KEYS
    assert mode_of(output) == 0o600


def test_worker_access_adds_worker_scopes(db, tmp_path):
    output = tmp_path / "creds.json"
    bootstrap(output, worker_access=True)
    content = read_file(output)
    assert content["scopes"] == sorted([*MANAGE_SCOPES, "workers:connect", "workers:consume"])
    credential_id = content["token"].split("_")[1]
    assert set(Credential.objects.get(id=credential_id).scopes) == set(content["scopes"])


def test_bootstrap_url_follows_orbit_url(db, tmp_path, monkeypatch):
    monkeypatch.setenv("ORBIT_URL", "http://orbit.internal:9000")
    bootstrap(tmp_path / "creds.json")
    assert read_file(tmp_path / "creds.json")["url"] == "http://orbit.internal:9000"


@pytest.mark.parametrize("queue", ["bad name", "_hidden", "队列", "a" * 129, ""])
def test_bootstrap_refuses_a_queue_name_the_api_would_reject(db, tmp_path, queue):
    output = tmp_path / "creds.json"
    with pytest.raises(CommandError, match="queue"):
        bootstrap(output, queue=queue)
    assert not output.exists()
    assert counts() == (0, 0, 0, 0)


@pytest.mark.parametrize(
    "limits",
    [{"max_concurrency": 0}, {"max_concurrency": 100_001}, {"rate_per_second": 0}, {"rate_per_second": 1_000_001}],
)
def test_bootstrap_refuses_limits_the_api_would_reject(db, tmp_path, limits):
    output = tmp_path / "creds.json"
    with pytest.raises(CommandError):
        bootstrap(output, **limits)
    assert not output.exists()
    assert counts() == (0, 0, 0, 0)


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("missing-dir-is-a-file/creds.json", "missing-dir-is-a-file: File exists"),
        ("a-directory", "Is a directory"),
    ],
)
def test_an_output_that_cannot_be_written_mints_nothing_and_says_why_in_one_line(db, tmp_path, output, message):
    # given a file where a directory is needed, and a directory where the file should go
    (tmp_path / "missing-dir-is-a-file").write_text("")
    (tmp_path / "a-directory").mkdir()
    # when bootstrap writes there (--overwrite gets past the existence check)
    with pytest.raises(CommandError) as refused:
        bootstrap(tmp_path / output, overwrite=True)
    # then the error is one line, and nothing was created
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert counts() == (0, 0, 0, 0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"application": ""}, "--application: must be 1-128 characters"),
        ({"application": "x" * 129}, "--application: must be 1-128 characters"),
        ({"output": ""}, "--output: a file path is required"),
        ({"application": "a\nb"}, "--application: must not contain control characters"),
        ({"application": "a\u0085"}, "--application: must not contain control characters"),
        ({"application": "   "}, "--application: must not start or end with whitespace"),
        ({"application": " a"}, "--application: must not start or end with whitespace"),
    ],
)
def test_names_outside_their_columns_are_refused_before_anything_is_created(db, tmp_path, options, message):
    arguments = {"output": tmp_path / "creds.json", **options}
    with pytest.raises(CommandError, match=message):
        bootstrap(**arguments)
    assert counts() == (0, 0, 0, 0)


def test_a_retired_queue_is_not_handed_out_again(db, tmp_path):
    # given a bootstrapped queue that was retired
    bootstrap(tmp_path / "first.json")
    Queue.objects.update(retired_at=Queue.objects.get().created_at)
    before = counts()
    # when bootstrap is run again for it
    with pytest.raises(CommandError, match="queue 'bootstrap' of this namespace is retired"):
        bootstrap(tmp_path / "second.json")
    # then no credential is minted and no file written
    assert counts() == before and not (tmp_path / "second.json").exists()


def test_the_database_down_is_one_line(db, tmp_path, monkeypatch):
    def unreachable(name):
        raise OperationalError(2003, "Can't connect to MySQL server on '127.0.0.1:3307' (111)")

    monkeypatch.setattr("server.management.commands.orbit_bootstrap.ensure_application", unreachable)
    with pytest.raises(CommandError) as refused:
        bootstrap(tmp_path / "creds.json")
    assert str(refused.value) == "database: Can't connect to MySQL server on '127.0.0.1:3307' (111)"
    assert not (tmp_path / "creds.json").exists()
