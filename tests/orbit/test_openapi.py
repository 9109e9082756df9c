"""The OpenAPI document (drf-spectacular) lists every v1 endpoint, with its
request body and the bearer credential, and generates without warnings."""

import io

import yaml
from django.core.management import call_command

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
        assert set(paths[create]["post"]["responses"]) == {"200", "201"}
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
    for listing in ("/v1/plans", "/v1/plans/{plan_id}/triggers"):
        assert parameters(listing, "get", "query") == {"page_size", "page_token"}
    assert parameters("/v1/tasks", "get", "query") == {
        "queue_id",
        "state",
        "business_key",
        "concurrency_key",
        "page_size",
        "page_token",
    }
