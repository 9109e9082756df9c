"""GET /v1/concurrency-keys and GET /v1/concurrency-keys/{key}: read only.

A key is shared by every queue of its namespace, so reading one takes
tasks:read over all of them. There is no reset and no delete: the row's
version is the key's token sequence (SPEC §11)."""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

from drf_spectacular.utils import OpenApiParameter
from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api import openapi_objects as shapes
from orbit.api.responses import ok, page
from orbit.api.schema import documented
from orbit.api.views import OrbitView, decode_page_token, encode_page_token, page_size_of
from orbit.errors import InvalidArgument
from tasks.actions import keys

# A key, as tasks.serializers.ConcurrencyKeyField accepts it: no control characters.
KEY_CURSOR = "[^\\x00-\\x1f\\x7f-\\x9f]{1,191}"

PREFIX = OpenApiParameter(
    "prefix",
    str,
    OpenApiParameter.QUERY,
    description="only keys starting with it, compared byte for byte; omitted: every key",
)

HOLDER_FIELDS = {
    "attempt_id": shapes.ID,
    "task_id": shapes.ID,
    "worker_id": {"type": "string"},
    "token": {**shapes.UINT64_STRING, "description": "the holder's permit token"},
    "since": {**shapes.TIME, "description": "when the holder's lease took the permit"},
}
HOLDER = shapes.closed(
    HOLDER_FIELDS,
    optional=("worker_id", "token"),
    description="the attempt holding the key's one valid permit (a key of capacity 1)",
)
SLOT_HOLDER = shapes.closed(
    {
        "slot": {
            "type": "integer",
            "minimum": 0,
            "description": "the permit's slot, 0…capacity−1 (0 for a key of capacity 1); tokens are fenced per slot",
        },
        **HOLDER_FIELDS,
    },
    optional=("worker_id", "token"),
    description="one valid permit of the key and the attempt holding it",
)
RATE = shapes.closed(
    {
        "starts": {"type": "integer", "minimum": 1, "maximum": 100000},
        "per_seconds": {"type": "integer", "minimum": 1, "maximum": 3600},
        "burst": {"type": "integer", "minimum": 1, "maximum": 100000},
    },
    description="the key's start rate: at most burst + t / (per_seconds / starts) Starts in any interval t",
)
CONCURRENCY_KEY = shapes.closed(
    {
        "key": {"type": "string", "minLength": 1},
        "holder": shapes.ref("ConcurrencyKeyHolder"),
        "capacity": {
            "type": "integer",
            "minimum": 1,
            "maximum": 1000,
            "description": "valid permits the key grants at once, as its policies resolve it now (default 1); "
            "a lowered capacity keeps its current holders",
        },
        "policy_id": {**shapes.ID, "description": "the key policy that applies (absent: the default)"},
        "rate": RATE,
        "reserved_starts": {
            **shapes.COUNT,
            "description": "leased attempts of the key that have not started yet, each holding a Start's room",
        },
        "next_start_at": {
            **shapes.TIME,
            "description": "when a lease may next take an attempt of the key under its rate (now: it may now)",
        },
        "holders": {
            "type": "array",
            "items": shapes.ref("ConcurrencyKeySlotHolder"),
            "description": "every valid permit by slot, lowest slot first; empty while the key is free",
        },
        "highest_token": {
            **shapes.UINT64_STRING,
            "description": "the key's token sequence: every token issued is at most it, the next one is above it",
        },
        "waiting_tasks": {"type": "integer", "minimum": 0, "description": "WAITING tasks with this key, every queue"},
        "updated_at": {**shapes.TIME, "description": "the last lease or release"},
    },
    optional=("holder", "policy_id", "rate", "reserved_starts", "next_start_at", "updated_at"),
    description="a concurrency key: holder (capacity 1 only) omitted while the key is free; policy_id without a "
    "policy; rate, reserved_starts and next_start_at without a rate; updated_at until its first lease",
)
# The key objects join the API's components (orbit.api.openapi_objects).
shapes.OBJECTS.setdefault("ConcurrencyKeyHolder", HOLDER)
shapes.OBJECTS.setdefault("ConcurrencyKeySlotHolder", SLOT_HOLDER)
shapes.OBJECTS.setdefault("ConcurrencyKey", CONCURRENCY_KEY)
shapes.OBJECTS.setdefault("ConcurrencyKeyPage", shapes.page_of("ConcurrencyKey"))


class ConcurrencyKeyCollectionView(OrbitView):
    @documented(data="ConcurrencyKeyPage", operation_id="concurrency_keys_list", paged=True, extra_parameters=(PREFIX,))
    def get(self, request: Request) -> Response:
        """List concurrency keys.

        The namespace's concurrency keys in key order, those starting with prefix if given: each
        one's capacity, rate and policy, who holds its permits by slot, its token sequence and how
        many tasks wait for it, one page at a time."""
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

        The key's capacity, rate and policy as resolved now, who holds its permits by slot (the
        task and attempt, the token), its highest token issued and how many WAITING tasks wait for
        it; 404 for a key neither leased nor waited for."""
        # The ASGI server decodes the path with U+FFFD for bytes that are not
        # UTF-8, so "%FF" would read the key "\ufffd": check the raw bytes.
        raw_path = getattr(request._request, "scope", {}).get("raw_path")
        if raw_path:
            try:
                unquote_to_bytes(raw_path.partition(b"/v1/concurrency-keys/")[2]).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidArgument("key: must be percent-encoded UTF-8") from exc
        return ok(request, keys.key_get(principal=self.principal(request), key=key))
