"""Clients generated from the served OpenAPI document by standard generators,
with their default settings (issue 37): openapi-python-client makes a Python
client that runs a queue → task → error round trip against a live server,
and openapi-typescript's declarations compile with `tsc --noEmit`.

The generators are pinned here. openapi-python-client is in
requirements-dev.txt (scripts/setup puts it in .venv); without it the test
installs the pin into a venv cached under .local/. The npm tools are installed
into .local/ the same way (npm itself comes from Debian, like the browser
tests' Chromium). A missing tool is an install, never a skip."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.live import LiveServer

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
PYTHON_GENERATOR = ("openapi-python-client", "0.29.1")
NPM_TOOLS = {"openapi-typescript": "7.13.0", "typescript": "5.9.3"}
# The package openapi-python-client names after the document's title ("Orbit API").
CLIENT_PROJECT, CLIENT_PACKAGE = "orbit-api-client", "orbit_api_client"
INSTALL_TIMEOUT = 600


def run(command: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    finished = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT, check=False
    )
    assert finished.returncode == 0, (command, finished.stdout[-4000:], finished.stderr[-4000:])
    return finished


def python_generator_bin() -> Path:
    """The directory holding openapi-python-client at the pinned version (and
    ruff, which the generator runs over its output)."""
    name, version = PYTHON_GENERATOR
    for bin_dir in (Path(sys.executable).parent, ROOT / ".local" / "openapi-python-client" / "bin"):
        tool = bin_dir / name
        if tool.exists() and version in run([str(tool), "--version"], cwd=ROOT).stdout:
            return bin_dir
    venv = ROOT / ".local" / "openapi-python-client"
    run([sys.executable, "-m", "venv", "--clear", str(venv)], cwd=ROOT)
    run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", f"{name}=={version}"], cwd=ROOT)
    return venv / "bin"


def npm_tools() -> Path:
    """.local/openapi-ts/node_modules/.bin with the pinned npm tools."""
    prefix = ROOT / ".local" / "openapi-ts"

    def installed(package: str) -> str | None:
        manifest = prefix / "node_modules" / package / "package.json"
        return json.loads(manifest.read_text())["version"] if manifest.exists() else None

    if any(installed(package) != version for package, version in NPM_TOOLS.items()):
        if shutil.which("npm") is None:
            # As scripts/test does for Chromium: Debian's package, installed where the suite may.
            assert shutil.which("apt-get") and os.geteuid() == 0, "npm is needed: apt-get install nodejs npm"
            run(["apt-get", "update", "-qq"], cwd=ROOT)
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            run(["apt-get", "install", "-y", "-qq", "nodejs", "npm"], cwd=ROOT, env=env)
        prefix.mkdir(parents=True, exist_ok=True)
        pins = [f"{package}@{version}" for package, version in NPM_TOOLS.items()]
        run(["npm", "install", "--no-audit", "--no-fund", "--save-exact", "--prefix", str(prefix), *pins], cwd=prefix)
    return prefix / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def document(orbit_server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    answer = httpx.get(f"{orbit_server.url}/v1/openapi.json", timeout=30)
    assert answer.status_code == 200, answer.text
    path = tmp_path_factory.mktemp("openapi") / "openapi.json"
    path.write_text(answer.text)
    return path


@pytest.fixture
def generated(document: Path, tmp_path: Path) -> Iterator[Any]:
    """The Python client generated into tmp_path with default settings, imported."""
    bin_dir = python_generator_bin()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    started = time.monotonic()
    output = run([str(bin_dir / "openapi-python-client"), "generate", "--path", str(document)], cwd=tmp_path, env=env)
    said = output.stdout + output.stderr
    # The generator skips what it cannot read with a warning and still exits 0.
    assert "Warning" not in said and "Error" not in said, said
    print(f"openapi-python-client generate: {time.monotonic() - started:.1f}s")
    sys.path.insert(0, str(tmp_path / CLIENT_PROJECT))
    try:
        yield importlib.import_module(CLIENT_PACKAGE)
    finally:
        sys.path.remove(str(tmp_path / CLIENT_PROJECT))
        for module in [name for name in sys.modules if name.split(".")[0] == CLIENT_PACKAGE]:
            del sys.modules[module]


def key() -> str:
    return f"generated-{uuid.uuid4().hex}"


def test_the_generated_python_client_runs_a_queue_task_error_round_trip(generated, orbit_server, tenant):
    def operation(operation_id: str) -> Any:
        """The generated module of one call: api/<tag>/<operation id>.py."""
        return importlib.import_module(f"{CLIENT_PACKAGE}.api.{operation_id.split('_')[0]}.{operation_id}")

    models = importlib.import_module(f"{CLIENT_PACKAGE}.models")
    queues_create, queues_get, queues_configure = map(operation, ("queues_create", "queues_get", "queues_configure"))
    tasks_submit, tasks_get, tasks_list, tasks_cancel = map(
        operation, ("tasks_submit", "tasks_get", "tasks_list", "tasks_cancel")
    )
    client = generated.AuthenticatedClient(base_url=orbit_server.url, token=tenant.token)

    # A queue, created and then replayed with the same Idempotency-Key.
    name = f"gen-{uuid.uuid4().hex[:12]}"
    queue_body = models.QueueCreateInput(name=name, max_concurrency=4, rate_per_second=100)
    create_key = key()
    created = queues_create.sync_detailed(client=client, body=queue_body, idempotency_key=create_key)
    assert created.status_code == 201, created.content
    assert isinstance(created.parsed, models.QueueReceiptResponse)
    queue = created.parsed.data.queue
    assert queue.name == name and queue.paused is False
    replay = queues_create.sync_detailed(client=client, body=queue_body, idempotency_key=create_key)
    assert replay.status_code == 200 and replay.parsed.data.deduplicated is True
    assert replay.parsed.data.queue.id == queue.id
    assert queues_get.sync(queue.id, client=client).data.revision == queue.revision

    # A task in it: submitted, read back, listed.
    payload = models.SubmitTaskInputPayloadType0.from_dict({"n": 1})
    task_body = models.SubmitTaskInput(
        queue_id=queue.id, handler="generated", handler_version="v1", payload_version="v1", payload=payload
    )
    submitted = tasks_submit.sync_detailed(client=client, body=task_body, idempotency_key=key())
    assert submitted.status_code == 201, submitted.content
    task_id = submitted.parsed.data.task.id
    task = tasks_get.sync(task_id, client=client).data
    assert (task.queue_id, task.handler, task.state) == (queue.id, "generated", models.TaskState.WAITING)
    assert task.payload == {"n": 1}
    listed = tasks_list.sync(client=client, queue_id=queue.id).data
    assert [item.id for item in listed.items] == [task_id] and listed.next_page_token == ""

    # Typed errors: each status parses into its own model, the error's code an enum.
    missing = tasks_get.sync_detailed("0" * 32, client=client)
    assert missing.status_code == 404 and isinstance(missing.parsed, models.Error404)
    assert missing.parsed.error.code == models.Error404ErrorCode.NOT_FOUND
    other_body = models.QueueCreateInput(name=f"{name}-other", max_concurrency=4, rate_per_second=100)
    conflict = queues_create.sync_detailed(client=client, body=other_body, idempotency_key=create_key)
    assert conflict.status_code == 409 and isinstance(conflict.parsed, models.Error409)
    assert conflict.parsed.error.code == models.Error409ErrorCode.IDEMPOTENCY_CONFLICT
    stale = models.QueueConfigureInput(
        expected_revision=str(int(queue.revision) + 7),
        reason="generated client",
        paused=True,
        max_concurrency=4,
        rate_per_second=100,
        max_unfinished_tasks=10,
    )
    refused = queues_configure.sync_detailed(queue.id, client=client, body=stale, idempotency_key=key())
    assert refused.status_code == 409 and refused.parsed.error.code == models.Error409ErrorCode.STATE_CONFLICT
    too_large = models.QueueCreateInput(name=f"{name}-big", max_concurrency=2**31, rate_per_second=100)
    invalid = queues_create.sync_detailed(client=client, body=too_large, idempotency_key=key())
    assert invalid.status_code == 400 and isinstance(invalid.parsed, models.Error400)
    assert "max_concurrency" in invalid.parsed.error.message
    stranger = generated.AuthenticatedClient(base_url=orbit_server.url, token="orb_" + "0" * 32 + "_nope")
    denied = tasks_get.sync_detailed(task_id, client=stranger)
    assert denied.status_code == 401 and isinstance(denied.parsed, models.Error401)

    # The round trip's end: the task cancelled through the client.
    cancel = models.CancelTaskInput(reason="generated client round trip")
    cancelled = tasks_cancel.sync_detailed(task_id, client=client, body=cancel, idempotency_key=key())
    assert cancelled.status_code == 200, cancelled.content
    assert cancelled.parsed.data.task.state == models.TaskState.CANCELLED


# What a TypeScript caller writes against the declarations: README's first
# curl submit (an object payload; priority, max_attempts, lease_seconds and
# retry left to the server's defaults), one with every field spelled out, a
# batch item whose retry gives one field of three, and a key policy without
# its defaulted capacity and burst.
TYPESCRIPT_CALLER = """\
import type { components, paths } from "./api";
type Submit = paths["/v1/tasks"]["post"]["requestBody"]["content"]["application/json"];
type Batch = paths["/v1/tasks:batch"]["post"]["requestBody"]["content"]["application/json"];
type Policy = components["schemas"]["KeyPolicyCreateInput"];

export const readme: Submit = {
  queue_id: "0123456789abcdef0123456789abcdef",
  handler: "echo",
  handler_version: "v1",
  payload_version: "v1",
  payload: { hi: 1, nested: { list: [1, "two", null] } },
};
export const whole: Submit = { ...readme, priority: 5, max_attempts: 3, lease_seconds: 30, payload: [] };
export const batch: Batch = {
  tasks: [{ idempotency_key: "a", task: { ...readme, payload: "text", retry: { max_seconds: 60 } } }],
};
export const policy: Policy = { match: { prefix: "account/" }, rate: { starts: 2, per_seconds: 1 }, reason: "r" };
"""


def test_the_typescript_declarations_compile_and_take_what_a_caller_sends(document, tmp_path):
    """The declarations compile, and a caller's request bodies type-check against
    them: an object payload is an object with keys, and a field the server
    fills in when it is left out (priority, retry's three, a policy's capacity)
    is optional, not required as openapi-typescript makes a property with a
    `default` (the document says defaults in words)."""
    bin_dir = npm_tools()
    declarations = tmp_path / "api.d.ts"
    started = time.monotonic()
    run([str(bin_dir / "openapi-typescript"), str(document), "-o", str(declarations)], cwd=tmp_path)
    generated_at = time.monotonic()
    run([str(bin_dir / "tsc"), "--noEmit", "--strict", str(declarations)], cwd=tmp_path)
    print(f"openapi-typescript: {generated_at - started:.1f}s, tsc --noEmit: {time.monotonic() - generated_at:.1f}s")
    (tmp_path / "caller.ts").write_text(TYPESCRIPT_CALLER)
    run([str(bin_dir / "tsc"), "--noEmit", "--strict", str(declarations), "caller.ts"], cwd=tmp_path)
    text = declarations.read_text()
    for operation in ("queues_configure", "tasks_list", "tasks_submit", "concurrency_keys_get"):
        assert f"{operation}: {{" in text, operation
