"""The OpenAPI document against a live server (schemathesis): every answer
is a status the document lists for the operation, with the headers, content
type and body schema it documents, never a 5xx; and every operation reaches
its success status with generated data (the cases alternate: a real id, the
current revision and a fresh Idempotency-Key put into the generated request,
then the request as generated, which mostly exercises the errors).

Short form (the suite): ORBIT_CONTRACT_EXAMPLES cases per operation, 12 by
default, deterministic. The long form raises the count and draws new data
each run, e.g.

    ORBIT_CONTRACT_EXAMPLES=500 ORBIT_CONTRACT_RANDOM=1 scripts/test tests/contract -q
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from orbit.models import SCOPES
from tests.support.contract import TASK_BODY, World, fresh_key
from tests.support.factories import NamespaceFactory, make_credential
from tests.support.live import LiveServer

pytestmark = pytest.mark.django_db(transaction=True)

EXAMPLES = int(os.environ.get("ORBIT_CONTRACT_EXAMPLES", "12"))
RANDOM = os.environ.get("ORBIT_CONTRACT_RANDOM", "") == "1"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]

# Statuses answered, by operation ("POST /v1/queues"), across the run.
STATUSES: dict[str, Counter[int]] = defaultdict(Counter)


@pytest.fixture(scope="session")
def orbit_api(orbit_server: LiveServer) -> Any:
    # No credential: the document is public (SPEC §11).
    document = httpx.get(f"{orbit_server.url}/v1/openapi.json", timeout=30)
    assert document.status_code == 200, document.text
    schema = schemathesis.openapi.from_dict(document.json())
    schema.config.update(base_url=orbit_server.url)
    return schema


@pytest.fixture
def world(orbit_server: LiveServer, transactional_db: None) -> Iterator[World]:
    namespace = NamespaceFactory()
    issued = make_credential(namespace, scopes=list(SCOPES))
    world = World(orbit_server.url, issued.token, namespace.application_id)
    yield world
    world.close()


def _set_body(case: Any, **fields: Any) -> None:
    if isinstance(case.body, dict):
        case.body = {**case.body, **fields}


def _queue(purpose: str) -> Callable[[Any, World], None]:
    def prepare(case: Any, world: World) -> None:
        case.path_parameters = {"queue_id": world.queue(purpose)}

    return prepare


def _configure_queue(case: Any, world: World) -> None:
    queue_id = world.queue("configure")
    case.path_parameters = {"queue_id": queue_id}
    _set_body(case, expected_revision=world.revision(f"/v1/queues/{queue_id}"))


def _retire_queue(case: Any, world: World) -> None:
    queue_id, revision = world.retirable_queue()
    case.path_parameters = {"queue_id": queue_id}
    _set_body(case, expected_revision=revision)


def _submit(case: Any, world: World) -> None:
    _set_body(case, queue_id=world.queue("tasks"))


def _batch(case: Any, world: World) -> None:
    if isinstance(case.body, dict) and isinstance(case.body.get("tasks"), list):
        items = []
        for item in case.body["tasks"]:
            task = {**item["task"], "queue_id": world.queue("tasks")}
            items.append({"idempotency_key": fresh_key(), "task": task})
        case.body = {"tasks": items}


def _task(choose: Callable[[World], str]) -> Callable[[Any, World], None]:
    def prepare(case: Any, world: World) -> None:
        case.path_parameters = {"task_id": choose(world)}

    return prepare


def _blocked_pair(world: World) -> tuple[str, str]:
    """(a waiting task, a task BLOCKED on it): both lists and the
    WAITING_FOR_DEPENDENCIES blocker answer something."""
    if "blocked" not in world.named:
        world.named["blocked_on"] = world.new_task("dependencies")
        body = {**TASK_BODY, "queue_id": world.queue("dependencies"), "depends_on": [world.named["blocked_on"]]}
        world.named["blocked"] = world.post("/v1/tasks", body)["task"]["id"]
    return world.named["blocked_on"], world.named["blocked"]


def _application(case: Any, world: World) -> None:
    case.path_parameters = {"application_id": world.application_id}
    if case.method.upper() == "POST":
        _set_body(case, expected_revision=world.revision(f"/v1/applications/{world.application_id}"))


def _plan_create(case: Any, world: World) -> None:
    _set_body(case, queue_id=world.queue("plans"))


def _plan(purpose: str) -> Callable[[Any, World], None]:
    def prepare(case: Any, world: World) -> None:
        case.path_parameters = {"plan_id": world.plan(purpose)}

    return prepare


def _plan_update(case: Any, world: World) -> None:
    plan_id = world.plan("update")
    case.path_parameters = {"plan_id": plan_id}
    _set_body(case, expected_revision=world.revision(f"/v1/plans/{plan_id}"))


def _plan_change(paused: bool) -> Callable[[Any, World], None]:
    def prepare(case: Any, world: World) -> None:
        plan_id, revision = world.new_plan(paused=paused)
        case.path_parameters = {"plan_id": plan_id}
        _set_body(case, expected_revision=revision)

    return prepare


def _nothing(case: Any, world: World) -> None:
    pass


CONTRACT_KEY = "contract/key 1"


def _concurrency_key(case: Any, world: World) -> None:
    """A key with a waiting task (GET /v1/concurrency-keys/{key} answers it before its first lease)."""
    if "concurrency_key" not in world.named:
        world.post("/v1/tasks", {**TASK_BODY, "queue_id": world.queue("keys"), "concurrency_key": CONTRACT_KEY})
        world.named["concurrency_key"] = CONTRACT_KEY
    case.path_parameters = {"key": CONTRACT_KEY}


def _new_key_policy(world: World) -> tuple[str, str]:
    body = {"match": {"key": f"contract/{fresh_key()}"}, "capacity": 2, "reason": "contract"}
    policy = world.post("/v1/key-policies", body)["policy"]
    return policy["id"], policy["revision"]


def _key_policy(case: Any, world: World) -> None:
    if "key_policy" not in world.named:
        world.named["key_policy"] = _new_key_policy(world)[0]
    policy_id = world.named["key_policy"]
    case.path_parameters = {"policy_id": policy_id}
    if case.method.upper() == "POST":
        _set_body(case, expected_revision=world.revision(f"/v1/key-policies/{policy_id}"))


def _retire_key_policy(case: Any, world: World) -> None:
    policy_id, revision = _new_key_policy(world)
    case.path_parameters = {"policy_id": policy_id}
    _set_body(case, expected_revision=revision)


# What a "real" case of each operation gets from the world.
PREPARE: dict[str, Callable[[Any, World], None]] = {
    "GET /v1/queues": _nothing,
    "POST /v1/queues": _nothing,
    "GET /v1/queues/{queue_id}": _queue("read"),
    "POST /v1/queues/{queue_id}:configure": _configure_queue,
    "POST /v1/queues/{queue_id}:retire": _retire_queue,
    "GET /v1/tasks": _nothing,
    "POST /v1/tasks": _submit,
    "POST /v1/tasks:batch": _batch,
    "GET /v1/tasks/{task_id}": _task(lambda world: world.task("read")),
    "POST /v1/tasks/{task_id}:cancel": _task(lambda world: world.task("cancel")),
    "POST /v1/tasks/{task_id}:resolve": _task(World.task_needing_review),
    "GET /v1/tasks/{task_id}/attempts": _task(World.worked_task),
    "GET /v1/tasks/{task_id}/blockers": _task(lambda world: _blocked_pair(world)[1]),
    "GET /v1/tasks/{task_id}/dependencies": _task(lambda world: _blocked_pair(world)[1]),
    "GET /v1/tasks/{task_id}/dependents": _task(lambda world: _blocked_pair(world)[0]),
    "GET /v1/attempts/{attempt_id}": lambda case, world: setattr(
        case, "path_parameters", {"attempt_id": world.attempt()}
    ),
    "GET /v1/applications/{application_id}": _application,
    "POST /v1/applications/{application_id}:configure": _application,
    "GET /v1/events": _nothing,
    "GET /v1/concurrency-keys": _nothing,
    "GET /v1/concurrency-keys/{key}": _concurrency_key,
    "GET /v1/key-policies": _nothing,
    "POST /v1/key-policies": _nothing,
    "GET /v1/key-policies/{policy_id}": _key_policy,
    "POST /v1/key-policies/{policy_id}:configure": _key_policy,
    "POST /v1/key-policies/{policy_id}:retire": _retire_key_policy,
    "GET /v1/plans": _nothing,
    "POST /v1/plans": _plan_create,
    "GET /v1/plans/{plan_id}": _plan("read"),
    "GET /v1/plans/{plan_id}/triggers": _plan("read"),
    "POST /v1/plans/{plan_id}:update": _plan_update,
    "POST /v1/plans/{plan_id}:pause": _plan_change(paused=False),
    "POST /v1/plans/{plan_id}:resume": _plan_change(paused=True),
    "POST /v1/plans/{plan_id}:retire": _plan_change(paused=False),
}


def operation_of(case: Any) -> str:
    return f"{case.method.upper()} {case.path}"


# Each operation is its own test, on a tenant of its own (the database is
# emptied between tests), driven by hypothesis from schemathesis' strategy:
# schemathesis' own pytest loader (from_fixture) does not run on pytest 9.
@pytest.mark.parametrize("operation", list(PREPARE))
def test_operation_keeps_the_contract(operation: str, orbit_api: Any, world: World) -> None:
    method, path = operation.split(" ", 1)
    strategy = orbit_api[path][method].as_strategy(GenerationMode.POSITIVE)

    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=strategy)
    def run(case: Any) -> None:
        calls = sum(STATUSES[operation].values())
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {world.token}"}
        if calls % 2 == 0:  # every other case: real resources, a fresh key
            PREPARE[operation](case, world)
            if "Idempotency-Key" in case.headers:
                case.headers["Idempotency-Key"] = fresh_key()
        response = case.call(timeout=10)
        STATUSES[operation][response.status_code] += 1
        case.validate_response(response, checks=CHECKS)

    run()


def test_every_operation_reached_its_success_status() -> None:
    """Runs after the tests above (pytest keeps the file's order)."""
    if set(STATUSES) != set(PREPARE):
        pytest.skip("the contract run did not cover every operation (a -k selection)")
    succeeded = {
        operation: statuses
        for operation, statuses in STATUSES.items()
        if not any(200 <= status < 300 for status in statuses)
    }
    assert succeeded == {}, f"operations that never succeeded: {succeeded}"
    cases = sum(sum(statuses.values()) for statuses in STATUSES.values())
    print(f"\ncontract: {len(STATUSES)} operations, {cases} cases")
    for operation in sorted(STATUSES):
        print(f"  {operation}: {dict(sorted(STATUSES[operation].items()))}")
