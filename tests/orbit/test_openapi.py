"""The OpenAPI document (drf-spectacular) lists every v1 endpoint, with its
request body and the bearer credential, and generates without warnings; it
is served without a credential; its answers, errors and body rules are the
server's (the rules checked here against the validators themselves; the
answers against a live server in tests/contract)."""

import io
import json
import re

import jsonschema
import pytest
import yaml
from django.core.management import call_command
from rest_framework.exceptions import ValidationError

from orbit.api.fields import ReasonField, Uint64StringField, canonical_uint64
from orbit.api.openapi_objects import decimal_up_to
from orbit.errors import InvalidArgument
from orbit.fields import UINT64_MAX
from plans.openapi import CRON_PATTERN
from plans.serializers import ScheduleInput, iana_zone_names
from tasks.serializers import ConcurrencyKeyField, DependsOnField, TimeField

ENDPOINTS = {
    "/v1/queues": {"get", "post"},
    "/v1/queues/{queue_id}": {"get"},
    "/v1/queues/{queue_id}:configure": {"post"},
    "/v1/queues/{queue_id}:retire": {"post"},
    "/v1/tasks": {"get", "post"},
    "/v1/tasks:batch": {"post"},
    "/v1/tasks/{task_id}": {"get"},
    "/v1/tasks/{task_id}:cancel": {"post"},
    "/v1/tasks/{task_id}:resolve": {"post"},
    "/v1/tasks/{task_id}/attempts": {"get"},
    "/v1/attempts/{attempt_id}": {"get"},
    "/v1/applications/{application_id}": {"get"},
    "/v1/applications/{application_id}:configure": {"post"},
    "/v1/events": {"get"},
    "/v1/plans": {"get", "post"},
    "/v1/plans/{plan_id}": {"get"},
    "/v1/plans/{plan_id}:update": {"post"},
    "/v1/plans/{plan_id}:pause": {"post"},
    "/v1/plans/{plan_id}:resume": {"post"},
    "/v1/plans/{plan_id}:retire": {"post"},
    "/v1/plans/{plan_id}/triggers": {"get"},
    "/v1/tasks/{task_id}/blockers": {"get"},
    "/v1/tasks/{task_id}/dependencies": {"get"},
    "/v1/tasks/{task_id}/dependents": {"get"},
    "/v1/concurrency-keys": {"get"},
    "/v1/concurrency-keys/{key}": {"get"},
    "/v1/key-policies": {"get", "post"},
    "/v1/key-policies/{policy_id}": {"get"},
    "/v1/key-policies/{policy_id}:configure": {"post"},
    "/v1/key-policies/{policy_id}:retire": {"post"},
}


# Each operation's id: `<resource>_<verb>`, the name generated clients give the call.
OPERATION_IDS = {
    ("get", "/v1/queues"): "queues_list",
    ("post", "/v1/queues"): "queues_create",
    ("get", "/v1/queues/{queue_id}"): "queues_get",
    ("post", "/v1/queues/{queue_id}:configure"): "queues_configure",
    ("post", "/v1/queues/{queue_id}:retire"): "queues_retire",
    ("get", "/v1/tasks"): "tasks_list",
    ("post", "/v1/tasks"): "tasks_submit",
    ("post", "/v1/tasks:batch"): "tasks_submit_batch",
    ("get", "/v1/tasks/{task_id}"): "tasks_get",
    ("post", "/v1/tasks/{task_id}:cancel"): "tasks_cancel",
    ("post", "/v1/tasks/{task_id}:resolve"): "tasks_resolve",
    ("get", "/v1/tasks/{task_id}/attempts"): "tasks_attempts_list",
    ("get", "/v1/tasks/{task_id}/blockers"): "tasks_blockers_get",
    ("get", "/v1/tasks/{task_id}/dependencies"): "tasks_dependencies_list",
    ("get", "/v1/tasks/{task_id}/dependents"): "tasks_dependents_list",
    ("get", "/v1/attempts/{attempt_id}"): "attempts_get",
    ("get", "/v1/applications/{application_id}"): "applications_get",
    ("post", "/v1/applications/{application_id}:configure"): "applications_configure",
    ("get", "/v1/events"): "events_list",
    ("get", "/v1/plans"): "plans_list",
    ("post", "/v1/plans"): "plans_create",
    ("get", "/v1/plans/{plan_id}"): "plans_get",
    ("post", "/v1/plans/{plan_id}:update"): "plans_update",
    ("post", "/v1/plans/{plan_id}:pause"): "plans_pause",
    ("post", "/v1/plans/{plan_id}:resume"): "plans_resume",
    ("post", "/v1/plans/{plan_id}:retire"): "plans_retire",
    ("get", "/v1/plans/{plan_id}/triggers"): "plans_triggers_list",
    ("get", "/v1/concurrency-keys"): "concurrency_keys_list",
    ("get", "/v1/concurrency-keys/{key}"): "concurrency_keys_get",
    ("get", "/v1/key-policies"): "key_policies_list",
    ("post", "/v1/key-policies"): "key_policies_create",
    ("get", "/v1/key-policies/{policy_id}"): "key_policies_get",
    ("post", "/v1/key-policies/{policy_id}:configure"): "key_policies_configure",
    ("post", "/v1/key-policies/{policy_id}:retire"): "key_policies_retire",
}


def test_every_endpoint_is_documented_without_warnings():
    out = io.StringIO()
    call_command("spectacular", "--fail-on-warn", stdout=out)
    schema = yaml.safe_load(out.getvalue())
    paths = schema["paths"]
    assert {path: set(paths[path]) & {"get", "post"} for path in paths} == ENDPOINTS
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    submit = paths["/v1/tasks"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert submit.endswith("/SubmitTaskInput")
    fields = schema["components"]["schemas"]["SubmitTaskInput"]["properties"]
    assert {"queue_id", "handler", "handler_version", "payload_version", "payload", "concurrency_key"} <= set(fields)
    components = schema["components"]["schemas"]
    assert components["SubmitTaskInput"]["additionalProperties"] is False  # unknown fields are 400

    def enum_of(component: str, field: str) -> list[str]:
        ref = components[component]["properties"][field]["$ref"]  # drf-spectacular names each enum
        return components[ref.rsplit("/", 1)[-1]]["enum"]

    assert enum_of("MisfireInput", "policy") == ["SKIP", "CATCH_UP", "LATEST"]
    assert enum_of("ResolveTaskInput", "resolution") == ["SUCCEEDED", "FAILED", "RETRY"]


def test_creates_mutations_and_lists_document_their_statuses_headers_and_query():
    out = io.StringIO()
    call_command("spectacular", stdout=out)
    paths = yaml.safe_load(out.getvalue())["paths"]

    def parameters(path: str, method: str, where: str) -> set[str]:
        return {p["name"] for p in paths[path][method].get("parameters", []) if p["in"] == where}

    for create in ("/v1/queues", "/v1/tasks", "/v1/plans"):
        responses = set(paths[create]["post"]["responses"])
        assert {status for status in responses if status < "300"} == {"200", "201"}
        assert responses - {"200", "201"} >= {"400", "401", "403", "409", "413", "503"}
    for path in (
        "/v1/queues",
        "/v1/tasks",
        "/v1/queues/{queue_id}:configure",
        "/v1/queues/{queue_id}:retire",
        "/v1/tasks/{task_id}:cancel",
        "/v1/tasks/{task_id}:resolve",
        "/v1/applications/{application_id}:configure",
        "/v1/plans",
        "/v1/plans/{plan_id}:update",
        "/v1/plans/{plan_id}:pause",
        "/v1/plans/{plan_id}:resume",
        "/v1/plans/{plan_id}:retire",
    ):
        assert parameters(path, "post", "header") == {"Idempotency-Key"}
    assert parameters("/v1/tasks:batch", "post", "header") == set()  # each item carries its own key
    assert parameters("/v1/queues", "get", "query") == {"page_size", "page_token"}
    assert parameters("/v1/events", "get", "query") == {"after", "page_size"}
    for listing in (
        "/v1/plans",
        "/v1/plans/{plan_id}/triggers",
        "/v1/tasks/{task_id}/attempts",
        "/v1/tasks/{task_id}/dependencies",
        "/v1/tasks/{task_id}/dependents",
    ):
        assert parameters(listing, "get", "query") == {"page_size", "page_token"}
    assert parameters("/v1/tasks", "get", "query") == {
        "queue_id",
        "state",
        "business_key",
        "concurrency_key",
        "page_size",
        "page_token",
    }


def document() -> dict:
    out = io.StringIO()
    call_command(
        "spectacular", "--format", "openapi-json", "--custom-settings", "orbit.api.schema.DOCUMENT_SETTINGS", stdout=out
    )
    return json.loads(out.getvalue())


def test_the_document_is_served_without_a_credential(client):
    response = client.get("/v1/openapi.json")
    assert response.status_code == 200
    served = json.loads(response.content)
    assert served["paths"].keys() == ENDPOINTS.keys()
    assert "docs/protocol.md" in served["info"]["description"]  # the WebSocket protocol's home


def test_every_operation_documents_its_envelope_and_its_errors():
    schema = document()
    components = schema["components"]["schemas"]
    for path, methods in ENDPOINTS.items():
        for method in methods:
            operation = schema["paths"][path][method]
            responses = operation["responses"]
            for status, response in responses.items():
                target = response["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
                assert "X-Request-Id" in response["headers"], (path, method, status)
                if status >= "400":
                    assert target == f"Error{status}"
                    error = components[target]["properties"]["error"]
                    assert set(error["required"]) == {"code", "message"}
                else:
                    assert components[target]["required"] == ["request_id", "data"]
            assert {"401", "403", "503"} <= set(responses), (path, method)
            if "{" in path:
                assert "404" in responses, (path, method)
    assert components["Error409"]["properties"]["error"]["properties"]["code"]["enum"] == [
        "IDEMPOTENCY_CONFLICT",
        "STATE_CONFLICT",
    ]
    assert "Retry-After" in schema["paths"]["/v1/tasks"]["post"]["responses"]["429"]["headers"]
    page = components["QueuePage"]
    assert page["required"] == ["items", "next_page_token"]
    assert components["Queue"]["additionalProperties"] is False


def test_body_rules_are_documented():
    schema = document()
    components = schema["components"]["schemas"]
    paths = schema["paths"]
    page_size = next(p for p in paths["/v1/queues"]["get"]["parameters"] if p["name"] == "page_size")
    assert (page_size["schema"]["minimum"], page_size["schema"]["maximum"]) == (1, 500)
    key = next(p for p in paths["/v1/queues"]["post"]["parameters"] if p["name"] == "Idempotency-Key")
    assert key["required"] and (key["schema"]["minLength"], key["schema"]["maxLength"]) == (1, 255)
    batch = components["SubmitBatchInput"]["properties"]["tasks"]
    assert (batch["minItems"], batch["maxItems"]) == (1, 500)
    assert batch["items"]["properties"]["task"]["$ref"].endswith("/SubmitTaskInput")
    forms = [ref["$ref"].rsplit("/", 1)[1] for ref in components["ScheduleInput"]["oneOf"]]
    assert forms == ["CronSchedule", "IntervalSchedule"]
    assert set(components["CronSchedule"]["properties"]) == {"cron", "timezone"}
    assert components["IntervalSchedule"]["required"] == ["interval_seconds"]
    assert len(components["MisfireInput"]["oneOf"]) == 2
    assert components["SubmitTaskInput"]["not"] == {"required": ["deadline_at", "timeout_seconds"]}
    assert components["SubmitTaskInput"]["properties"]["available_at"]["format"] == "date-time"
    assert "pattern" in components["CancelTaskInput"]["properties"]["reason"]


def accepts(field, value) -> bool:
    try:
        field.run_validation(value)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("nonzero", [False, True])
def test_the_uint64_pattern_is_canonical_uint64(nonzero):
    pattern = re.compile(decimal_up_to(UINT64_MAX, nonzero=nonzero))
    field = Uint64StringField(nonzero=nonzero)
    samples = ["0", "1", "9", "10", "01", "-1", "+1", " 1", "1.0", str(UINT64_MAX), str(UINT64_MAX + 1)]
    samples += [str(UINT64_MAX)[:i] + "9" * (20 - i) for i in range(20)]  # each digit one above
    samples += [str(10**k) for k in range(21)] + [str(10**k - 1) for k in range(1, 21)]
    for sample in samples:
        assert bool(pattern.match(sample)) == accepts(field, sample), sample
        if not nonzero:
            assert bool(pattern.match(sample)) == (canonical_uint64(sample) is not None), sample


def test_reason_and_time_patterns_are_the_fields_rules():
    schema = document()["components"]["schemas"]
    reason = re.compile(schema["CancelTaskInput"]["properties"]["reason"]["pattern"])
    for sample in ["x", " x ", "", " ", "\t\n", "\u3000", "a\x00", "\u00a0", "ok\u2003"]:
        assert bool(reason.search(sample)) == accepts(ReasonField(), sample), repr(sample)
    time = re.compile(schema["SubmitTaskInput"]["properties"]["available_at"]["pattern"])
    for sample in [
        "2026-01-02T03:04:05Z",
        "2026-01-02t03:04:05.123456z",
        "2026-01-02T03:04:05+01:00",
        "2026-01-02 03:04:05Z",
        "2026-01-02T03:04:05",
        "2026-01-02T03:04:05+0100",
        "2026-W01-1T03:04:05Z",
    ]:
        assert bool(time.search(sample)) == accepts(TimeField(), sample), sample


def test_a_key_policys_match_carries_the_concurrency_keys_pattern():
    # (decisions: every pattern is in the schema, built from the validators' own rules)
    schema = document()["components"]["schemas"]
    forms = [form["properties"] for form in schema["KeyPolicyMatch"]["oneOf"]]
    for form in forms:
        ((name, field),) = form.items()
        pattern = re.compile(field["pattern"])
        for sample in ["customer/", "a b", " a", "a ", "a\nb", "\u00a0x", "x\u0085", "é/\u4e2d", "a\x00b"]:
            assert bool(pattern.search(sample)) == accepts(ConcurrencyKeyField(), sample), (name, repr(sample))


@pytest.mark.parametrize(
    "cron",
    [
        "* * * * *",
        "*/5 0-23/2 1,15 JAN-jun mon-FRI",
        "0 0 L * *",
        "0 0 LW * *",
        "0 0 * * 5L",
        "0 0 * * MON#2",
        " 05  4 * * 0 ",
        "60 * * * *",
        "* 24 * * *",
        "* * 0 * *",
        "* * * 13 *",
        "* * * * 8",
        "*/0 * * * *",
        "* * * *",
        "* * * * * *",
        "@daily",
        "0 0 * * MON#6",
        "0 0 L/2 * *",
        "0 0 lw/3 * *",
        "0 0 1,L/2 * *",
    ],
)
def test_the_cron_pattern_is_the_schedules_rule(cron):
    # The pattern does not see a range's order or a day no month has; it
    # agrees with the server on everything else.
    serializer = ScheduleInput(data={"cron": cron})
    assert bool(re.search(CRON_PATTERN, cron)) == serializer.is_valid(), cron


def test_every_operation_has_a_plain_verb_id_a_summary_and_a_description():
    """What a generated client names and documents each call by (issue 37:
    ids read `queues_:configure_create`, 25 of 27 operations had neither)."""
    schema = document()
    operations = {
        (method, path): operation
        for path, methods in schema["paths"].items()
        for method, operation in methods.items()
        if method in ("get", "post")
    }
    assert {key: operation["operationId"] for key, operation in operations.items()} == OPERATION_IDS
    for key, operation in operations.items():
        assert re.fullmatch(r"[a-z]+(_[a-z]+)+", operation["operationId"]), key
        summary, description = operation.get("summary", ""), operation.get("description", "")
        assert summary.strip() and "\n" not in summary and len(summary) <= 80, key
        assert description.strip() and description.strip() != summary.strip(), key
    # One tag per resource: the batch submit is grouped with the tasks, not under "tasks:batch".
    assert operations[("post", "/v1/tasks:batch")]["tags"] == ["tasks"]


def test_a_time_zone_is_a_documented_string_not_an_enum_of_names():
    """~600 zone names as an enum collapse in generators (Etc/GMT+0, Etc/GMT-0
    and Etc/GMT0 make one identifier); the document states the format and the
    server checks the name against the tz database, as before."""
    zone = document()["components"]["schemas"]["CronSchedule"]["properties"]["timezone"]
    assert zone["type"] == "string" and "enum" not in zone
    assert "IANA time zone name" in zone["description"] and "Europe/Berlin" in zone["description"]
    assert zone["example"] == "Europe/Berlin"
    names = ScheduleInput().fields["timezone"]  # the documented form holds every name the server accepts
    assert zone["maxLength"] == names.max_length
    assert all(re.fullmatch(zone["pattern"], name) for name in iana_zone_names())
    assert len(iana_zone_names()) > 400
    for name, accepted in (("Europe/Berlin", True), ("Etc/GMT+0", True), ("Mars/Olympus_Mons", False), ("", False)):
        body = {"cron": "30 2 * * *", "timezone": name}
        assert ScheduleInput(data=body).is_valid() is accepted, name


def test_dependencies_are_documented():
    """SPEC §13 in the document: the submit's depends_on and
    on_dependency_failure, a batch item's ref, BLOCKED, the task object's
    depends_on, the two lists and their item, the blockers code."""
    schema = document()
    components = schema["components"]["schemas"]
    submit = components["SubmitTaskInput"]["properties"]
    depends_on = submit["depends_on"]
    assert (depends_on["minItems"], depends_on["maxItems"], depends_on["uniqueItems"]) == (1, 1000, True)
    on_failure = submit["on_dependency_failure"]["$ref"].rsplit("/", 1)[1]
    assert components[on_failure]["enum"] == ["CANCEL", "RUN"]
    assert "BLOCKED" in components["TaskState"]["enum"]
    item = components["SubmitBatchInput"]["properties"]["tasks"]["items"]
    assert set(item["properties"]) == {"idempotency_key", "ref", "task"} and "ref" not in item["required"]
    for name in ("TaskSummary", "Task"):
        task = components[name]
        assert task["properties"]["depends_on"]["items"]["pattern"] == "^[0-9a-f]{32}$"
        assert task["properties"]["on_dependency_failure"]["allOf"][0]["$ref"].endswith(f"/{on_failure}")
        assert {"depends_on", "on_dependency_failure"}.isdisjoint(task["required"])
    for path in ("/v1/tasks/{task_id}/dependencies", "/v1/tasks/{task_id}/dependents"):
        responses = schema["paths"][path]["get"]["responses"]
        assert set(responses) >= {"200", "400", "401", "403", "404", "503"}
        envelope = responses["200"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        assert components[envelope]["properties"]["data"]["$ref"].endswith("/TaskLinkPage")
    assert components["TaskLinkPage"]["properties"]["items"]["items"]["$ref"].endswith("/TaskLink")
    link = components["TaskLink"]
    assert link["required"] == ["id"] and link["additionalProperties"] is False
    assert set(link["properties"]) == {
        "id",
        "pruned",
        "queue_id",
        "handler",
        "business_key",
        "state",
        "created_at",
        "updated_at",
        "finished_at",
    }
    codes = components["Blocker"]["properties"]["code"]["$ref"].rsplit("/", 1)[1]
    assert {"KEY_HELD", "KEY_AT_CAPACITY", "WAITING_FOR_DEPENDENCIES"} <= set(components[codes]["enum"])
    assert "task_ids" in components["Blocker"]["description"]


@pytest.mark.parametrize(
    ("entry", "in_batch"),
    [
        ("0123456789abcdef0123456789abcdef", True),
        ("ref:split.1_a-b", True),
        ("ref:" + "x" * 64, True),
        ("ref:" + "x" * 65, False),
        ("ref:", False),
        ("ref:a b", False),
        ("0123456789ABCDEF0123456789ABCDEF", False),
        ("0123456789abcdef0123456789abcde", False),
        ("task", False),
    ],
)
def test_the_depends_on_pattern_is_the_fields_rule(entry, in_batch):
    pattern = document()["components"]["schemas"]["SubmitTaskInput"]["properties"]["depends_on"]["items"]["pattern"]
    try:
        DependsOnField().to_internal_value([entry])
        accepted = True
    except InvalidArgument:
        accepted = False
    assert accepted == in_batch == bool(re.search(pattern, entry)), entry


def test_request_fields_say_their_defaults_in_words_and_any_json_is_an_open_object():
    """openapi-typescript (default settings) declares a property with a `default`
    required and a bare {"type": "object"} an object without keys: a TypeScript
    caller could neither leave out `priority` nor send `{"hi": 1}` as a payload."""
    schemas = document()["components"]["schemas"]
    inputs = {name: schema for name, schema in schemas.items() if name.endswith("Input")}
    assert {"SubmitTaskInput", "RetryInput", "KeyPolicyCreateInput", "KeyRateInput", "PlanTaskInput"} <= set(inputs)
    defaulted = [
        f"{name}.{prop}"
        for name, schema in inputs.items()
        for prop, spec in schema.get("properties", {}).items()
        if "default" in spec
    ]
    assert defaulted == []
    assert schemas["SubmitTaskInput"]["properties"]["priority"]["description"].endswith("default 5")
    assert schemas["RetryInput"]["properties"]["multiplier"]["description"] == "default 2.0"
    for name in ("SubmitTaskInput", "PlanTaskInput"):
        branches = schemas[name]["properties"]["payload"]["anyOf"]
        assert {"type": "object", "additionalProperties": True} in branches, branches


@pytest.mark.parametrize(
    ("component", "field", "value", "valid"),
    [
        ("SubmitTaskInput", "concurrency_key", "", True),
        ("SubmitTaskInput", "concurrency_key", "account-7", True),
        ("SubmitTaskInput", "concurrency_key", " edge", False),
        ("SubmitTaskInput", "fairness_key", "", True),
        ("SubmitTaskInput", "business_key", "", True),
        ("SubmitTaskInput", "business_key", "x" * 192, False),
        ("PlanTaskInput", "concurrency_key", "", True),
        ("PlanTaskInput", "business_key", "", True),
        ("KeyMatchInput", "key", "", False),
        ("KeyMatchInput", "prefix", "", False),
        ("KeyMatchInput", "prefix", "account-", True),
    ],
)
def test_a_string_field_takes_exactly_what_the_server_takes(component, field, value, valid):
    """drf-spectacular documents a field that may be blank and has a pattern as
    `oneOf: [the pattern, maxLength 0]`; where the pattern also takes "", the
    empty string matched both branches, so a validating client refused the
    `concurrency_key: ""` the server accepts and echoes back. A match's key or
    prefix is never empty (400 "must not be empty")."""
    spec = document()["components"]["schemas"][component]["properties"][field]
    errors = list(jsonschema.Draft202012Validator(spec).iter_errors(value))
    assert (errors == []) is valid, (spec, [error.message for error in errors])
