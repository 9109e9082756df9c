"""GET /v1/concurrency-keys and GET /v1/concurrency-keys/{key}: read only.

A key is shared by every queue of its namespace, so reading one takes
tasks:read over all of them. There is no reset and no delete: the row's
version is the key's token sequence (SPEC §11)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter
from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api import openapi_objects as shapes
from orbit.api.responses import ok, page
from orbit.api.schema import documented
from orbit.api.views import OrbitView, decode_page_token, encode_page_token, page_size_of
from tasks.actions import keys

# A key, as tasks.serializers.ConcurrencyKeyField accepts it: no control characters.
KEY_CURSOR = "[^\\x00-\\x1f\\x7f-\\x9f]{1,191}"

PREFIX = OpenApiParameter(
    "prefix",
    str,
    OpenApiParameter.QUERY,
    description="only keys starting with it, compared byte for byte; omitted: every key",
)

HOLDER = shapes.closed(
    {
        "attempt_id": shapes.ID,
        "task_id": shapes.ID,
        "worker_id": {"type": "string"},
        "token": {**shapes.UINT64_STRING, "description": "the holder's permit token"},
        "since": {**shapes.TIME, "description": "when the holder's lease took the permit"},
    },
    optional=("worker_id", "token"),
    description="the attempt holding the key's one valid permit",
)
CONCURRENCY_KEY = shapes.closed(
    {
        "key": {"type": "string", "minLength": 1},
        "holder": shapes.ref("ConcurrencyKeyHolder"),
        "highest_token": {
            **shapes.UINT64_STRING,
            "description": "the key's token sequence: every token issued is at most it, the next one is above it",
        },
        "waiting_tasks": {"type": "integer", "minimum": 0, "description": "WAITING tasks with this key, every queue"},
        "updated_at": {**shapes.TIME, "description": "the last lease or release"},
    },
    optional=("holder", "updated_at"),
    description="a concurrency key: holder omitted while the key is free, updated_at until its first lease",
)
# The key objects join the API's components (orbit.api.openapi_objects).
shapes.OBJECTS.setdefault("ConcurrencyKeyHolder", HOLDER)
shapes.OBJECTS.setdefault("ConcurrencyKey", CONCURRENCY_KEY)
shapes.OBJECTS.setdefault("ConcurrencyKeyPage", shapes.page_of("ConcurrencyKey"))


class ConcurrencyKeyCollectionView(OrbitView):
    @documented(data="ConcurrencyKeyPage", operation_id="concurrency_keys_list", paged=True, extra_parameters=(PREFIX,))
    def get(self, request: Request) -> Response:
        """List concurrency keys.

        The namespace's concurrency keys in key order, those starting with prefix if given: who
        holds each, its token sequence and how many tasks wait for it, one page at a time."""
        principal = self.principal(request)
        after = decode_page_token(request, cursor_pattern=KEY_CURSOR)
        size = page_size_of(request)
        items, next_key = keys.key_list(
            principal=principal, prefix=request.query_params.get("prefix", ""), after=after, limit=size
        )
        return ok(request, page(items, encode_page_token(next_key) if next_key else ""))


class ConcurrencyKeyDetailView(OrbitView):
    @documented(data="ConcurrencyKey", operation_id="concurrency_keys_get")
    def get(self, request: Request, key: str) -> Response:
        """Get a concurrency key.

        Who holds the key (the task and attempt), its highest token issued and how many WAITING
        tasks wait for it; 404 for a key no lease has taken yet."""
        return ok(request, keys.key_get(principal=self.principal(request), key=key))
