"""The HTTP kit's OpenAPI machinery names no app: each app registers its own
objects, fields and body rules (orbit.api.openapi_registry) from its
AppConfig.ready(), and the registry refuses two apps claiming one name."""

import ast
from pathlib import Path

import pytest

import orbit.api
from orbit.api import openapi_registry
from orbit.api.openapi_objects import component
from orbit.api.openapi_registry import register_component

APPS = {"tasks", "queues", "plans", "workers"}


def app_imports(package: Path) -> list[str]:
    """Every import of an app package in the modules under `package`, at module
    level or inside a function, as `path:line module`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            found += [f"{path.name}:{node.lineno} {name}" for name in modules if name.split(".")[0] in APPS]
    return found


def test_the_http_kit_imports_no_app():
    assert app_imports(Path(orbit.api.__file__).parent) == []


def test_each_app_registered_its_objects_at_ready():
    # One object of each app, in the registry the document is built from.
    assert component("Queue")["properties"]["paused"] == {"type": "boolean"}
    assert "SUCCEEDED" in component("TaskState")["enum"]
    assert component("PlanResponse")["properties"]["data"] == {"$ref": "#/components/schemas/Plan"}
    assert set(openapi_registry.BODY_RULES) >= {"ScheduleInput", "MisfireInput", "SubmitTaskInput", "RetryInput"}
    assert set(openapi_registry.REFERENCED_SERIALIZERS) == {
        "SubmitTaskInput",
        "ScheduleInput",
        "MisfireInput",
        "DefinitionInput",
    }


def test_a_second_registration_of_a_name_must_say_the_same():
    register_component("Queue", component("Queue"))  # ready() run again: no change
    with pytest.raises(ValueError, match="'Queue'"):
        register_component("Queue", {"type": "string"})
    assert component("Queue")["type"] == "object"
