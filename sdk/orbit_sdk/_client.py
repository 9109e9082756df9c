"""The HTTP clients (SPEC §3–§5): :class:`Client` and :class:`AsyncClient`, one set of verbs.

Each API operation is written once, on ``_BaseClient``, as a function that describes its
request (method, path, key, body, how to read the answer); the two clients differ only in
how they send one.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import types
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload
from urllib.parse import quote

import httpx

from orbit_sdk._checks import check_seconds, check_token
from orbit_sdk._credentials import load_credentials
from orbit_sdk._exceptions import APIError, ProtocolError, TransportError, parse_retry_after
from orbit_sdk._models import (
    Application,
    Attempt,
    BatchItem,
    BatchItemResult,
    CancelTaskResult,
    ConcurrencyKey,
    ConfigureApplicationResult,
    ConfigureKeyPolicyRequest,
    ConfigureQueueRequest,
    CreateKeyPolicyRequest,
    CreatePlanRequest,
    CreateQueueRequest,
    CreateQueueResult,
    EventPage,
    KeyPolicy,
    KeyPolicyResult,
    Page,
    Plan,
    PlanResult,
    PlanTrigger,
    Queue,
    ResolveTaskResult,
    SubmitTaskRequest,
    SubmitTaskResult,
    Task,
    TaskBlockers,
    TaskLink,
    UpdatePlanRequest,
    _text,
    _uint64_text,
    _whole,
)
from orbit_sdk._transport import KeepAliveTransport, environment_names_a_proxy

T = TypeVar("T")
P = ParamSpec("P")

USER_AGENT = "orbit-python/0.1"
MAX_BATCH_ITEMS = 500  # the server's limit for POST /v1/tasks:batch
MAX_BATCH_DEPENDENCIES = 10_000  # and for its items' depends_on lists together


def _code_for_status(status: int) -> str:
    # A body that is not an error envelope came from something in front of the server
    # (proxy, load balancer) or from a crash: only "unavailable" vs "internal" can be told.
    return "UNAVAILABLE" if status in (502, 503, 504) else "INTERNAL"


def _api_error(response: httpx.Response) -> APIError:
    retry_after = parse_retry_after(response.headers.get("Retry-After"))
    request_id = response.headers.get("X-Request-Id", "")
    try:
        body = response.json()
    except (ValueError, UnicodeDecodeError):
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        if isinstance(body.get("request_id"), str):
            request_id = body["request_id"]
        message = error.get("message")
        return APIError(
            code=error["code"],
            status_code=response.status_code,
            message=message if isinstance(message, str) else "",
            request_id=request_id,
            retry_after=retry_after,
        )
    text = response.text.strip()
    return APIError(
        code=_code_for_status(response.status_code),
        status_code=response.status_code,
        message=text[:200] if text else f"HTTP {response.status_code} without an error envelope",
        request_id=request_id,
        retry_after=retry_after,
    )


def _check_idempotency_key(key: object) -> str:
    """Every mutating call's key, checked before anything is sent: a missing one (None) too,
    which the server would only refuse after a round trip."""
    if not isinstance(key, str):
        raise TypeError(
            f"Idempotency-Key must be a string of 1-255 printable ASCII characters, got {type(key).__name__}"
        )
    if not 1 <= len(key) <= 255 or not all(0x20 <= ord(ch) <= 0x7E for ch in key):
        raise ValueError("Idempotency-Key must be 1-255 printable ASCII characters")
    return key


def _segment(value: object, name: str) -> str:
    """An id (or a concurrency key) as one path segment. Every character but the unreserved
    ones is percent-encoded ("/" too), and so are the dots of a value that is "." or "..": a URL
    parser would otherwise take it for a dot segment and drop it (httpx does), asking for
    another path (``get_task(".")`` for ``GET /v1/tasks``, the task list)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must be a non-empty string")
    segment = quote(value, safe="")
    return segment.replace(".", "%2E") if segment in (".", "..") else segment


_MAX_NESTING = 500  # levels of a body searched for what JSON cannot carry (json.dumps recurses too)
_INSTEAD = {"set": "a list", "frozenset": "a list", "datetime": "a string", "date": "a string", "bytes": "a string"}


def _member(where: str, key: object) -> str:
    if isinstance(key, str) and key.isidentifier():
        return f"{where}.{key}" if where else key
    return f"{where}[{key!r}]"


def _not_json(value: object, where: str, active: set[int], depth: int) -> Exception | None:
    """The first thing in `value` that the request body's JSON cannot carry, as the error to
    raise, naming where it is (``payload.when``, ``tasks[0].task.payload[2]``); None if none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return ValueError(f"{where}: a string with a lone surrogate is not UTF-8, so not JSON text")
        return None
    if value is None or isinstance(value, int):  # bool too
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else ValueError(f"{where}: {value!r} is not a JSON number")
    if not isinstance(value, dict | list | tuple):
        instead = _INSTEAD.get(type(value).__name__)
        return TypeError(f"{where}: a {type(value).__name__} is not JSON" + (f"; give {instead}" if instead else ""))
    if depth >= _MAX_NESTING:
        return ValueError(f"{where}: nested too deeply to encode")
    if id(value) in active:
        return ValueError(f"{where}: refers back to itself (a circular reference)")
    active.add(id(value))
    try:
        if isinstance(value, dict):
            for key, item in value.items():
                inside = _member(where, key)
                if not (key is None or isinstance(key, str | int | float)):
                    return TypeError(f"{inside}: a key must be a string, not a {type(key).__name__}")
                problem = _not_json(key, inside, active, depth + 1) or _not_json(item, inside, active, depth + 1)
                if problem is not None:
                    return problem
        else:
            for index, item in enumerate(value):
                problem = _not_json(item, f"{where}[{index}]", active, depth + 1)
                if problem is not None:
                    return problem
    finally:
        active.discard(id(value))
    return None


def _unencodable(call: _Call[Any], exc: Exception) -> Exception:
    """The error for a body json.dumps refused (`exc`), naming the field it stems from."""
    assert call.body is not None
    problem = _not_json(call.body, "", set(), 0)
    if problem is not None:
        return problem
    kind = TypeError if isinstance(exc, TypeError) else ValueError
    return kind(f"{call.method} {call.path}: the request body cannot be encoded as JSON: {exc}")


def _body_of(request: Any, kind: type[Any]) -> dict[str, Any]:
    if not isinstance(request, kind):
        raise TypeError(f"request must be a {kind.__name__}, got {type(request).__name__}")
    body: dict[str, Any] = request.to_json()
    return body


@lru_cache(maxsize=256)
def _full_url(base: str, path: str) -> httpx.URL:
    """The request URL of `path`, parsed once for the paths a caller keeps
    using (httpx parses the path and joins it to the base on every request)."""
    return httpx.URL(base + path)


class _CookiesWhenSet(httpx.Cookies):
    """A cookie jar that looks at a response only when it sets a cookie. The
    API sets none, yet httpx wraps every response and its request for the
    standard library's cookie jar (a fifth of a submit's client time); a
    proxy in front that does set one (a sticky session) is still honoured."""

    def extract_cookies(self, response: httpx.Response) -> None:
        headers = response.headers
        if "set-cookie" in headers or "set-cookie2" in headers:
            super().extract_cookies(response)


def _jar_when_set(client: httpx.Client | httpx.AsyncClient, cookies: Any) -> None:
    client._cookies = _CookiesWhenSet(cookies)


class _HttpClient(httpx.Client):
    """httpx.Client with a _CookiesWhenSet jar."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        _jar_when_set(self, options.get("cookies"))


class _AsyncHttpClient(httpx.AsyncClient):
    """httpx.AsyncClient with a _CookiesWhenSet jar."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        _jar_when_set(self, options.get("cookies"))


def _page(data: Any, parse: Callable[[Any], T]) -> Page[T]:
    if isinstance(data, list):  # a bare list is a complete, unpaginated answer
        return Page(items=[parse(item) for item in data], next_page_token=None)
    if not isinstance(data, dict) or not isinstance(data.get("items"), list):
        raise ProtocolError("list response: expected an object with an 'items' list")
    token = data.get("next_page_token")
    if token is not None and not isinstance(token, str):
        raise ProtocolError(f"list response: next_page_token must be a string, got {token!r}")
    return Page(items=[parse(item) for item in data["items"]], next_page_token=token or None)


# --------------------------------------------------------------------------- one set of verbs


@dataclass(frozen=True)
class _Call(Generic[T]):
    """One request, described without sending it: both clients send the same ones."""

    method: str
    path: str
    # The envelope's data and the request id (which a batch's per-item errors carry).
    parse: Callable[[Any, str], T]
    key: str | None = None
    body: Mapping[str, Any] | None = None
    params: Mapping[str, Any] | None = None


class _Unkeyed:
    """What a call that takes no Idempotency-Key passes for one (None is a missing key)."""


_UNKEYED = _Unkeyed()


def _call(
    method: str,
    path: str,
    parse: Callable[[Any], T],
    *,
    key: str | _Unkeyed = _UNKEYED,
    body: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
) -> _Call[T]:
    checked = None if isinstance(key, _Unkeyed) else _check_idempotency_key(key)
    for name, value in (params or {}).items():
        # A query parameter of the wrong kind would go out as its str(): 2.5 or True as a
        # page size, 5 as a queue id.
        if value is not None and name == "page_size":
            _whole(value, name)
        elif value is not None:
            _text(value, name)
    return _Call(method, path, lambda data, _request_id: parse(data), key=checked, body=body, params=params)


def _as_is(data: Any) -> Any:
    return data


def _raw_call(
    method: str, path: str, key: str | None, body: Mapping[str, Any] | None, params: Mapping[str, Any] | None
) -> _Call[Any]:
    """A request on any path; `key` None sends none (a read)."""
    return _call(method, path, _as_is, key=_UNKEYED if key is None else key, body=body, params=params)


class _Verb(Generic[P, T]):
    """An API operation written once, as a function that describes its request.

    Read on a :class:`Client` it is a method that sends the request and returns ``T``; read
    on an :class:`AsyncClient`, a method that returns a coroutine of ``T``. The overloads
    below tell type checkers (and editors) exactly that.
    """

    def __init__(self, build: Callable[Concatenate[Any, P], _Call[T]]) -> None:
        def method(client: _BaseClient, *args: Any, **kwargs: Any) -> Any:
            return client._invoke(build, client, *args, **kwargs)

        functools.update_wrapper(method, build)
        # What the method returns is the call's answer, not the description of the request.
        signature = inspect.signature(build)
        returns = signature.return_annotation
        if isinstance(returns, str) and returns.startswith("_Call[") and returns.endswith("]"):
            signature = signature.replace(return_annotation=returns[len("_Call[") : -1])
        method.__signature__ = signature  # type: ignore[attr-defined]
        self._method = method
        functools.update_wrapper(self, method)

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Self: ...

    @overload
    def __get__(self, client: Client, owner: type[Any]) -> Callable[P, T]: ...

    @overload
    def __get__(self, client: AsyncClient, owner: type[Any]) -> Callable[P, Coroutine[Any, Any, T]]: ...

    def __get__(self, client: _BaseClient | None, owner: type[Any]) -> Any:
        if client is None:
            return self
        # A bound method, as for any function on a class (cheap, and without `self` in its signature).
        return types.MethodType(self._method, client)

    def __call__(self, client: _BaseClient, *args: P.args, **kwargs: P.kwargs) -> Any:
        """``Client.get_queue(client, queue_id)``, as for a plain method."""
        return self._method(client, *args, **kwargs)


BatchItems = Mapping[str, SubmitTaskRequest] | Iterable[tuple[str, SubmitTaskRequest] | BatchItem]


def _batch_items(tasks: BatchItems) -> list[BatchItem]:
    entries = list(tasks.items() if isinstance(tasks, Mapping) else tasks)
    if not 1 <= len(entries) <= MAX_BATCH_ITEMS:
        # Refused here: split into several calls knowingly, each is its own transaction.
        raise ValueError(f"submit_tasks takes 1 to {MAX_BATCH_ITEMS} tasks, got {len(entries)}")
    items: list[BatchItem] = []
    keys: set[str] = set()
    refs: set[str] = set()
    for entry in entries:
        if isinstance(entry, tuple) and len(entry) == 2:
            entry = BatchItem(entry[0], entry[1])
        if not isinstance(entry, BatchItem):
            raise TypeError("submit_tasks takes a mapping, pairs of (idempotency key, SubmitTaskRequest) or BatchItems")
        key = _check_idempotency_key(entry.idempotency_key)
        if key in keys:
            raise ValueError(f"Idempotency-Key {key!r} given twice in one batch")
        keys.add(key)
        if entry.ref is not None:
            if entry.ref in refs:
                raise ValueError(f"ref {entry.ref!r} given twice in one batch")
            refs.add(entry.ref)
        items.append(entry)
    return items


def _batch_entry(item: BatchItem) -> dict[str, Any]:
    try:
        task = _body_of(item.task, SubmitTaskRequest)
    except (TypeError, ValueError) as exc:
        if type(exc) not in (TypeError, ValueError):
            raise
        raise type(exc)(f"batch item {item.idempotency_key!r}: {exc}") from None
    entry = {"idempotency_key": item.idempotency_key, "task": task}
    return entry if item.ref is None else {**entry, "ref": item.ref}


def _batch_results(keys: list[str]) -> Callable[[Any, str], list[BatchItemResult]]:
    def parse(data: Any, request_id: str) -> list[BatchItemResult]:
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list) or len(results) != len(keys):
            raise ProtocolError(f"tasks:batch: expected a 'results' list of {len(keys)} items")
        items = [BatchItemResult.from_json(result, request_id) for result in results]
        for key, item in zip(keys, items, strict=True):
            if item.idempotency_key != key:
                raise ProtocolError(f"tasks:batch: result for {item.idempotency_key!r} where {key!r} was expected")
        return items

    return parse


class _BaseClient:
    """What both clients share: argument checks, request encoding, answer decoding, verbs."""

    def __init__(self, url: str, token: str, timeout: float | None) -> None:
        # Checked here, not left to the first request: a header httpx cannot send, or a timeout
        # a socket cannot take, would surface as a TransportError, which says "outcome unknown,
        # send again", or from deep inside the socket module.
        if not isinstance(url, str):
            raise TypeError(f"url must be a string, got {type(url).__name__}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// URL, got {url!r}")
        token = check_token(token)
        self._timeout = check_seconds(timeout, "timeout", allow_none=True)
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}", "Accept": "application/json", "User-Agent": USER_AGENT}

    def _invoke(self, build: Callable[..., _Call[T]], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _encode(self, call: _Call[Any]) -> tuple[httpx.URL, bytes | None, dict[str, Any] | None, dict[str, str]]:
        headers = {}
        if call.key is not None:  # checked when the call was described (_call)
            headers["Idempotency-Key"] = call.key
        content = None
        if call.body is not None:
            headers["Content-Type"] = "application/json"
            try:
                text = json.dumps(call.body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
                content = text.encode()
            except (TypeError, ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
                raise _unencodable(call, exc) from None
        query = {name: value for name, value in (call.params or {}).items() if value is not None}
        try:
            url = _full_url(self.url, call.path)
        except httpx.InvalidURL as exc:  # e.g. an id too long for a URL: nothing was sent
            raise ValueError(f"{call.method} {call.path[:80]}: {exc}") from exc
        return url, content, query or None, headers

    @staticmethod
    def _transport_error(call: _Call[Any], exc: httpx.TransportError) -> TransportError:
        if isinstance(exc, httpx.TimeoutException):
            return TransportError(f"{call.method} {call.path}: timed out ({exc.__class__.__name__})")
        return TransportError(f"{call.method} {call.path}: {exc.__class__.__name__}: {exc}")

    @staticmethod
    def _decode(call: _Call[T], response: httpx.Response) -> T:
        if not 200 <= response.status_code < 300:
            raise _api_error(response)
        try:
            envelope = response.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"{call.method} {call.path}: success response is not JSON") from exc
        if not isinstance(envelope, dict) or "data" not in envelope:
            raise ProtocolError(f"{call.method} {call.path}: success response has no 'data' envelope")
        request_id = envelope.get("request_id")
        if not isinstance(request_id, str):
            request_id = response.headers.get("X-Request-Id", "")
        return call.parse(envelope["data"], request_id)

    # ------------------------------------------------------------------ queues

    @_Verb
    def create_queue(self, key: str, request: CreateQueueRequest) -> _Call[CreateQueueResult]:
        """``POST /v1/queues``: 201 first, replay 200 with ``deduplicated=True``."""
        body = _body_of(request, CreateQueueRequest)
        return _call("POST", "/v1/queues", CreateQueueResult.from_json, key=key, body=body)

    @_Verb
    def get_queue(self, queue_id: str) -> _Call[Queue]:
        return _call("GET", f"/v1/queues/{_segment(queue_id, 'queue_id')}", Queue.from_json)

    @_Verb
    def list_queues(self, page_size: int | None = None, page_token: str | None = None) -> _Call[Page[Queue]]:
        params = {"page_size": page_size, "page_token": page_token}
        return _call("GET", "/v1/queues", lambda data: _page(data, Queue.from_json), params=params)

    @_Verb
    def configure_queue(self, queue_id: str, key: str, request: ConfigureQueueRequest) -> _Call[CreateQueueResult]:
        """Full replacement of the queue's controls, checked against ``expected_revision``."""
        path = f"/v1/queues/{_segment(queue_id, 'queue_id')}:configure"
        return _call("POST", path, CreateQueueResult.from_json, key=key, body=_body_of(request, ConfigureQueueRequest))

    @_Verb
    def retire_queue(self, queue_id: str, key: str, expected_revision: int, reason: str) -> _Call[CreateQueueResult]:
        """Retire a paused, empty queue for good (reads keep working, the name stays taken)."""
        body = {
            "expected_revision": _uint64_text(expected_revision, "expected_revision"),
            "reason": _text(reason, "reason"),
        }
        return _call(
            "POST",
            f"/v1/queues/{_segment(queue_id, 'queue_id')}:retire",
            CreateQueueResult.from_json,
            key=key,
            body=body,
        )

    # ------------------------------------------------------------ application

    @_Verb
    def get_application(self, application_id: str) -> _Call[Application]:
        """The credential's own application: quotas and live counters (``applications:manage``)."""
        return _call("GET", f"/v1/applications/{_segment(application_id, 'application_id')}", Application.from_json)

    @_Verb
    def configure_application(
        self,
        application_id: str,
        key: str,
        expected_revision: int,
        reason: str,
        max_active_attempts: int,
        max_unfinished_tasks: int,
    ) -> _Call[ConfigureApplicationResult]:
        """Full replacement of the application's quotas, checked against ``expected_revision``."""
        body = {
            "expected_revision": _uint64_text(expected_revision, "expected_revision"),
            "reason": _text(reason, "reason"),
            "max_active_attempts": _whole(max_active_attempts, "max_active_attempts"),
            "max_unfinished_tasks": _whole(max_unfinished_tasks, "max_unfinished_tasks"),
        }
        path = f"/v1/applications/{_segment(application_id, 'application_id')}:configure"
        return _call("POST", path, ConfigureApplicationResult.from_json, key=key, body=body)

    @_Verb
    def list_events(self, after: int | None = None, page_size: int | None = None) -> _Call[EventPage]:
        """The namespace's events after cursor ``after`` (from the start when None), oldest first."""
        params = {"after": None if after is None else _uint64_text(after, "after"), "page_size": page_size}
        return _call("GET", "/v1/events", EventPage.from_json, params=params)

    # ------------------------------------------------------------------ plans

    @_Verb
    def create_plan(self, key: str, request: CreatePlanRequest) -> _Call[PlanResult]:
        return _call("POST", "/v1/plans", PlanResult.from_json, key=key, body=_body_of(request, CreatePlanRequest))

    @_Verb
    def get_plan(self, plan_id: str) -> _Call[Plan]:
        return _call("GET", f"/v1/plans/{_segment(plan_id, 'plan_id')}", Plan.from_json)

    @_Verb
    def list_plans(self, page_size: int | None = None, page_token: str | None = None) -> _Call[Page[Plan]]:
        params = {"page_size": page_size, "page_token": page_token}
        return _call("GET", "/v1/plans", lambda data: _page(data, Plan.from_json), params=params)

    @_Verb
    def update_plan(self, plan_id: str, key: str, request: UpdatePlanRequest) -> _Call[PlanResult]:
        """A new immutable version; its schedule starts from now."""
        path = f"/v1/plans/{_segment(plan_id, 'plan_id')}:update"
        return _call("POST", path, PlanResult.from_json, key=key, body=_body_of(request, UpdatePlanRequest))

    @_Verb
    def pause_plan(self, plan_id: str, key: str, expected_revision: int, reason: str) -> _Call[PlanResult]:
        return _change_plan("pause", plan_id, key, expected_revision, reason)

    @_Verb
    def resume_plan(self, plan_id: str, key: str, expected_revision: int, reason: str) -> _Call[PlanResult]:
        """Points that fell while paused are not made up."""
        return _change_plan("resume", plan_id, key, expected_revision, reason)

    @_Verb
    def retire_plan(self, plan_id: str, key: str, expected_revision: int, reason: str) -> _Call[PlanResult]:
        return _change_plan("retire", plan_id, key, expected_revision, reason)

    @_Verb
    def list_plan_triggers(
        self, plan_id: str, page_size: int | None = None, page_token: str | None = None
    ) -> _Call[Page[PlanTrigger]]:
        """The plan's decided points, in the order they were decided."""
        path = f"/v1/plans/{_segment(plan_id, 'plan_id')}/triggers"
        params = {"page_size": page_size, "page_token": page_token}
        return _call("GET", path, lambda data: _page(data, PlanTrigger.from_json), params=params)

    # ------------------------------------------------------------------ tasks

    @_Verb
    def submit_task(self, key: str, request: SubmitTaskRequest) -> _Call[SubmitTaskResult]:
        """``POST /v1/tasks``. On ``QUEUE_FULL`` wait ``retry_after`` and re-send with the same key."""
        body = _body_of(request, SubmitTaskRequest)
        return _call("POST", "/v1/tasks", SubmitTaskResult.from_json, key=key, body=body)

    @_Verb
    def submit_tasks(self, tasks: BatchItems) -> _Call[list[BatchItemResult]]:
        """``POST /v1/tasks:batch``: up to 500 submits in one transaction, each with its own key.

        ``tasks`` maps each Idempotency-Key to its request, or is a list of such pairs or of
        :class:`BatchItem` (a key, a request and an optional ``ref`` that a later item's
        ``depends_on`` names as ``"ref:NAME"``). The answer is one :class:`BatchItemResult` per
        item, in order: accepted (``task`` set, ``status`` 201, or 200 with ``deduplicated`` for
        a replay) or refused (``error`` set, nothing stored for that key). Each item is digested
        as a single ``submit_task`` would be, so a key replays across both. A batch the server
        cannot read at all (a key or a ref twice, more than 500 items, more than 10,000
        ``depends_on`` entries in all) raises :class:`APIError`; this method refuses those
        before sending (ValueError).
        """
        items = _batch_items(tasks)
        body = {"tasks": [_batch_entry(item) for item in items]}
        named = sum(len(entry["task"].get("depends_on") or ()) for entry in body["tasks"])
        if named > MAX_BATCH_DEPENDENCIES:
            raise ValueError(
                f"submit_tasks takes at most {MAX_BATCH_DEPENDENCIES} depends_on entries in all, got {named}"
            )
        return _Call("POST", "/v1/tasks:batch", _batch_results([item.idempotency_key for item in items]), body=body)

    @_Verb
    def get_task(self, task_id: str) -> _Call[Task]:
        """The task detail, payload included."""
        return _call("GET", f"/v1/tasks/{_segment(task_id, 'task_id')}", Task.from_json)

    @_Verb
    def list_tasks(
        self,
        queue_id: str | None = None,
        state: str | None = None,
        business_key: str | None = None,
        concurrency_key: str | None = None,
        page_size: int | None = None,
        page_token: str | None = None,
    ) -> _Call[Page[Task]]:
        """Task summaries (no payload)."""
        params = {
            "queue_id": queue_id,
            "state": state,
            "business_key": business_key,
            "concurrency_key": concurrency_key,
            "page_size": page_size,
            "page_token": page_token,
        }
        return _call("GET", "/v1/tasks", lambda data: _page(data, Task.from_json), params=params)

    @_Verb
    def get_task_blockers(self, task_id: str) -> _Call[TaskBlockers]:
        """Why the task is not running: every reason its next lease would not take it (a snapshot)."""
        return _call("GET", f"/v1/tasks/{_segment(task_id, 'task_id')}/blockers", TaskBlockers.from_json)

    @_Verb
    def list_dependencies(
        self, task_id: str, page_size: int | None = None, page_token: str | None = None
    ) -> _Call[Page[TaskLink]]:
        """The tasks this task waits for, in its ``depends_on`` order, a page at a time."""
        params = {"page_size": page_size, "page_token": page_token}
        path = f"/v1/tasks/{_segment(task_id, 'task_id')}/dependencies"
        return _call("GET", path, lambda data: _page(data, TaskLink.from_json), params=params)

    @_Verb
    def list_dependents(
        self, task_id: str, page_size: int | None = None, page_token: str | None = None
    ) -> _Call[Page[TaskLink]]:
        """The tasks whose ``depends_on`` names this task, in the order they were submitted, a page at a time."""
        params = {"page_size": page_size, "page_token": page_token}
        path = f"/v1/tasks/{_segment(task_id, 'task_id')}/dependents"
        return _call("GET", path, lambda data: _page(data, TaskLink.from_json), params=params)

    @_Verb
    def list_attempts(
        self, task_id: str, page_size: int | None = None, page_token: str | None = None
    ) -> _Call[Page[Attempt]]:
        """A task's attempts in lease order, a page at a time."""
        params = {"page_size": page_size, "page_token": page_token}
        path = f"/v1/tasks/{_segment(task_id, 'task_id')}/attempts"
        return _call("GET", path, lambda data: _page(data, Attempt.from_json), params=params)

    @_Verb
    def get_attempt(self, attempt_id: str) -> _Call[Attempt]:
        return _call("GET", f"/v1/attempts/{_segment(attempt_id, 'attempt_id')}", Attempt.from_json)

    @_Verb
    def cancel_task(self, task_id: str, key: str, reason: str) -> _Call[CancelTaskResult]:
        """Cancel now if not started; a running task only gets ``cancel_requested``."""
        path = f"/v1/tasks/{_segment(task_id, 'task_id')}:cancel"
        return _call("POST", path, CancelTaskResult.from_json, key=key, body={"reason": _text(reason, "reason")})

    @_Verb
    def resolve_task(self, task_id: str, key: str, resolution: str, reason: str) -> _Call[ResolveTaskResult]:
        """Decide a NEEDS_REVIEW task: ``resolution`` is SUCCEEDED, FAILED or RETRY."""
        path = f"/v1/tasks/{_segment(task_id, 'task_id')}:resolve"
        body = {"resolution": _text(resolution, "resolution"), "reason": _text(reason, "reason")}
        return _call("POST", path, ResolveTaskResult.from_json, key=key, body=body)

    # ------------------------------------------------------- concurrency keys

    @_Verb
    def list_concurrency_keys(
        self, prefix: str | None = None, page_size: int | None = None, page_token: str | None = None
    ) -> _Call[Page[ConcurrencyKey]]:
        """The namespace's keys that ever leased, in byte order; ``prefix`` compares byte for byte."""
        params = {"prefix": prefix, "page_size": page_size, "page_token": page_token}
        return _call("GET", "/v1/concurrency-keys", lambda data: _page(data, ConcurrencyKey.from_json), params=params)

    @_Verb
    def get_concurrency_key(self, key: str) -> _Call[ConcurrencyKey]:
        """One key, compared byte for byte (percent-encoded here: ``/`` and any other character are fine)."""
        return _call("GET", f"/v1/concurrency-keys/{_segment(key, 'key')}", ConcurrencyKey.from_json)

    # ------------------------------------------------------------ key policies

    @_Verb
    def create_key_policy(self, key: str, request: CreateKeyPolicyRequest) -> _Call[KeyPolicyResult]:
        """``POST /v1/key-policies`` (``keys:manage``): 201 first, replay 200 with ``deduplicated=True``."""
        body = _body_of(request, CreateKeyPolicyRequest)
        return _call("POST", "/v1/key-policies", KeyPolicyResult.from_json, key=key, body=body)

    @_Verb
    def get_key_policy(self, policy_id: str) -> _Call[KeyPolicy]:
        return _call("GET", f"/v1/key-policies/{_segment(policy_id, 'policy_id')}", KeyPolicy.from_json)

    @_Verb
    def list_key_policies(self, page_size: int | None = None, page_token: str | None = None) -> _Call[Page[KeyPolicy]]:
        """The namespace's key policies, retired ones too, in id order."""
        params = {"page_size": page_size, "page_token": page_token}
        return _call("GET", "/v1/key-policies", lambda data: _page(data, KeyPolicy.from_json), params=params)

    @_Verb
    def configure_key_policy(
        self, policy_id: str, key: str, request: ConfigureKeyPolicyRequest
    ) -> _Call[KeyPolicyResult]:
        """Full replacement of the policy's capacity and rate, checked against ``expected_revision``."""
        path = f"/v1/key-policies/{_segment(policy_id, 'policy_id')}:configure"
        body = _body_of(request, ConfigureKeyPolicyRequest)
        return _call("POST", path, KeyPolicyResult.from_json, key=key, body=body)

    @_Verb
    def retire_key_policy(
        self, policy_id: str, key: str, expected_revision: int, reason: str
    ) -> _Call[KeyPolicyResult]:
        """Retire a policy for good: its keys fall back to the next rule, its match is free again."""
        body = {
            "expected_revision": _uint64_text(expected_revision, "expected_revision"),
            "reason": _text(reason, "reason"),
        }
        path = f"/v1/key-policies/{_segment(policy_id, 'policy_id')}:retire"
        return _call("POST", path, KeyPolicyResult.from_json, key=key, body=body)


def _change_plan(verb: str, plan_id: str, key: str, expected_revision: int, reason: str) -> _Call[PlanResult]:
    body = {
        "expected_revision": _uint64_text(expected_revision, "expected_revision"),
        "reason": _text(reason, "reason"),
    }
    return _call("POST", f"/v1/plans/{_segment(plan_id, 'plan_id')}:{verb}", PlanResult.from_json, key=key, body=body)


class Client(_BaseClient):
    """Synchronous Orbit API client (thread-safe: one can serve many threads).

    Every mutating call takes the Idempotency-Key first (after the resource's id). The client
    never re-sends a write on its own: a :class:`TransportError` means the outcome is unknown,
    so re-send the *same* request with the *same* key; an :class:`APIError` is the server's
    definite answer. Requests go through ``httpx.Client``, over HTTP/1.1 keep-alive
    connections of the standard library (``orbit_sdk._transport``), or httpx's own transport
    when the environment names a proxy; ``transport`` replaces that last step (e.g. with an
    ``httpx.MockTransport`` in tests). ``timeout`` is in seconds, None for none.

    What no request could carry (a token with a newline, a timeout of 0, a key that is None, an
    id that is not a string, a request field of the wrong kind, a payload JSON cannot carry) is
    a TypeError or ValueError naming it, raised before anything is sent.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float | None = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(url, token, timeout)
        if transport is None and not environment_names_a_proxy():
            transport = KeepAliveTransport()
        self._http = _HttpClient(
            base_url=self.url, headers=self._headers, timeout=self._timeout, transport=transport, follow_redirects=False
        )

    @classmethod
    def from_credentials_file(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        timeout: float | None = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> Client:
        """A client from ``path`` or ``$ORBIT_CREDENTIALS_FILE`` (see :func:`load_credentials`)."""
        credentials = load_credentials(path)
        return cls(credentials.url, credentials.token, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _invoke(self, build: Callable[..., _Call[T]], *args: Any, **kwargs: Any) -> T:
        return self._send(build(*args, **kwargs))

    def _send(self, call: _Call[T]) -> T:
        url, content, params, headers = self._encode(call)
        try:
            response = self._http.request(call.method, url, content=content, params=params, headers=headers)
        except httpx.TransportError as exc:
            raise self._transport_error(call, exc) from exc
        except httpx.DecodingError as exc:  # a body its Content-Encoding does not decode
            raise ProtocolError(f"{call.method} {call.path}: DecodingError: {exc}") from exc
        return self._decode(call, response)

    def _request(
        self,
        method: str,
        path: str,
        *,
        key: str | None = None,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> Any:
        """The envelope's ``data`` of any request (for paths this client has no method for yet)."""
        return self._send(_raw_call(method, path, key, body, params))


class AsyncClient(_BaseClient):
    """The asynchronous Orbit API client: :class:`Client`'s methods, each a coroutine.

    Use it as ``async with AsyncClient(...) as client`` (or call :meth:`aclose`). Argument
    errors (a request of the wrong type, a bad key) are raised when the call is awaited.
    ``transport`` takes an ``httpx.AsyncBaseTransport`` (e.g. ``httpx.MockTransport``).
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float | None = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(url, token, timeout)
        self._http = _AsyncHttpClient(
            base_url=self.url, headers=self._headers, timeout=self._timeout, transport=transport, follow_redirects=False
        )

    @classmethod
    def from_credentials_file(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        timeout: float | None = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> AsyncClient:
        """A client from ``path`` or ``$ORBIT_CREDENTIALS_FILE`` (see :func:`load_credentials`)."""
        credentials = load_credentials(path)
        return cls(credentials.url, credentials.token, timeout=timeout, transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _invoke(self, build: Callable[..., _Call[T]], *args: Any, **kwargs: Any) -> T:
        return await self._send(build(*args, **kwargs))

    async def _send(self, call: _Call[T]) -> T:
        url, content, params, headers = self._encode(call)
        try:
            response = await self._http.request(call.method, url, content=content, params=params, headers=headers)
        except httpx.TransportError as exc:
            raise self._transport_error(call, exc) from exc
        except httpx.DecodingError as exc:  # a body its Content-Encoding does not decode
            raise ProtocolError(f"{call.method} {call.path}: DecodingError: {exc}") from exc
        return self._decode(call, response)

    async def _request(
        self,
        method: str,
        path: str,
        *,
        key: str | None = None,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> Any:
        """The envelope's ``data`` of any request (for paths this client has no method for yet)."""
        return await self._send(_raw_call(method, path, key, body, params))
