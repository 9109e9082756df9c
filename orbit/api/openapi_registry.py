"""Where each app registers its own OpenAPI objects.

The HTTP kit (orbit.api.schema, orbit.api.openapi_objects) knows how to turn
views, serializers and JSON Schema into the document, but not which app
answers what: that would make the foundation import every app. Instead each
app states its shapes and rules in its own `openapi` module and registers them
from its AppConfig.ready(), before the URLconf (and so any view) is imported.
The generic machinery consults the stores below when it builds the document.

Registering the same name twice with the same value is a no-op (a test may
call ready() again); with another value it is an error, so two apps cannot
silently claim one component."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Schema = dict[str, Any]
# (drf-spectacular's AutoSchema, the serializer's mapped schema) -> the schema with the rule.
BodyRule = Callable[[Any, Schema], Schema]

# Component schemas by name: the objects inside `data` (each also answers as
# `<name>Response`, the success envelope around it) and the bodies no DRF
# serializer describes.
COMPONENTS: dict[str, Schema] = {}
# Rules between fields that a serializer's validate() enforces, by its class name.
BODY_RULES: dict[str, BodyRule] = {}
# Serializer fields whose schema is stated here rather than mapped by
# drf-spectacular (a field class's own extend_schema_field wins over a field
# extension, so a StrictSerializer body sets these itself).
FIELD_SCHEMAS: dict[type, Callable[[], Schema]] = {}
# Serializers that component schemas name by $ref (as `#/components/schemas/<class name>`):
# the document resolves them from the serializer, in the request direction.
REFERENCED_SERIALIZERS: dict[str, type] = {}
# Query filters (documented(filters=...)) whose value has a schema of its own;
# any other filter is a plain string.
QUERY_FILTERS: dict[str, Schema] = {}


def _store(store: dict[Any, Any], key: Any, value: Any, what: str) -> None:
    if key in store and store[key] != value:
        raise ValueError(f"OpenAPI {what} {key!r} is registered twice, with different values")
    store[key] = value


def register_component(name: str, schema: Schema) -> None:
    """A component schema, `#/components/schemas/<name>`."""
    _store(COMPONENTS, name, schema, "component")


def register_body_rule(serializer_name: str, rule: BodyRule) -> None:
    """A rule between the fields of the request body of that serializer class."""
    _store(BODY_RULES, serializer_name, rule, "body rule")


def register_field_schema(field_class: type, schema: Callable[[], Schema]) -> None:
    """The schema of every field of `field_class` in a request body."""
    _store(FIELD_SCHEMAS, field_class, schema, "field schema")


def register_referenced_serializer(serializer_class: type) -> None:
    """A serializer that component schemas refer to by its class name."""
    _store(REFERENCED_SERIALIZERS, serializer_class.__name__, serializer_class, "referenced serializer")


def register_query_filter(name: str, schema: Schema) -> None:
    """The schema of the query parameter `name` wherever a view filters by it."""
    _store(QUERY_FILTERS, name, schema, "query filter")
