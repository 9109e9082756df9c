"""The synchronous HTTP client (SPEC §3–§5)."""

from __future__ import annotations

import datetime
import json
import os
import re
from collections.abc import Callable, Mapping
from functools import lru_cache
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from orbit_sdk._credentials import load_credentials
from orbit_sdk._exceptions import APIError, ProtocolError, TransportError
from orbit_sdk._models import (
    Application,
    Attempt,
    CancelTaskResult,
    ConfigureApplicationResult,
    ConfigureQueueRequest,
    CreatePlanRequest,
    CreateQueueRequest,
    CreateQueueResult,
    EventPage,
    Page,
    Plan,
    PlanResult,
    PlanTrigger,
    Queue,
    ResolveTaskResult,
    SubmitTaskRequest,
    SubmitTaskResult,
    Task,
    UpdatePlanRequest,
    _uint64_text,
)

T = TypeVar("T")

USER_AGENT = "orbit-python/0.1"
MAX_RETRY_AFTER = datetime.timedelta(hours=1)
_RETRY_AFTER_SECONDS = re.compile(r"[0-9]+")


def parse_retry_after(value: str | None) -> datetime.timedelta:
    """Integer seconds from a Retry-After header; missing, invalid or over one hour → 0.

    An HTTP-date is not integer seconds and reads as 0 as well: the server only sends seconds.
    """
    if value is None:
        return datetime.timedelta(0)
    text = value.strip().lstrip("0") or "0"
    # More than four digits is over an hour whatever they say (and int() refuses
    # a string of over 4,300 digits).
    if len(text) > 4 or not _RETRY_AFTER_SECONDS.fullmatch(text):
        return datetime.timedelta(0)
    seconds = int(text)
    if seconds > MAX_RETRY_AFTER.total_seconds():
        return datetime.timedelta(0)
    return datetime.timedelta(seconds=seconds)


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


def _check_idempotency_key(key: str) -> str:
    if not isinstance(key, str) or not 1 <= len(key) <= 255 or not all(0x20 <= ord(ch) <= 0x7E for ch in key):
        raise ValueError("Idempotency-Key must be 1-255 printable ASCII characters")
    return key


def _segment(value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("resource id must be a non-empty string")
    return quote(value, safe="")


def _body_of(request: Any, kind: type[Any]) -> dict[str, Any]:
    if not isinstance(request, kind):
        raise TypeError(f"request must be a {kind.__name__}, got {type(request).__name__}")
    return request.to_json()


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


class _HttpClient(httpx.Client):
    """httpx.Client with a _CookiesWhenSet jar."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.cookies = options.get("cookies")

    @property  # type: ignore[override]
    def cookies(self) -> httpx.Cookies:
        return self._jar

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        self._jar = _CookiesWhenSet(cookies)


def _page(data: Any, parse: Callable[[Any], T]) -> Page[T]:
    if isinstance(data, list):  # a bare list is a complete, unpaginated answer
        return Page(items=[parse(item) for item in data], next_page_token=None)
    if not isinstance(data, dict) or not isinstance(data.get("items"), list):
        raise ProtocolError("list response: expected an object with an 'items' list")
    token = data.get("next_page_token")
    if token is not None and not isinstance(token, str):
        raise ProtocolError(f"list response: next_page_token must be a string, got {token!r}")
    return Page(items=[parse(item) for item in data["items"]], next_page_token=token or None)


class Client:
    """Synchronous Orbit API client.

    Every mutating call takes the Idempotency-Key first. The client never re-sends a write on its
    own: a :class:`TransportError` means the outcome is unknown, so re-send the *same* request
    with the *same* key; an :class:`APIError` is the server's definite answer.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        # Checked here, not left to the first request: a header httpx cannot send would
        # surface as a TransportError, which says "outcome unknown, send again".
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// URL, got {url!r}")
        if not isinstance(token, str) or not token or not all(0x21 <= ord(ch) <= 0x7E for ch in token):
            raise ValueError("token must be a non-empty string of printable ASCII without spaces")
        self.url = url.rstrip("/")
        self._http = _HttpClient(
            base_url=self.url,
            headers={
                "Authorization": f"Bearer {token}",
                "Accept": "application/json",
                "User-Agent": USER_AGENT,
            },
            timeout=timeout,
            transport=transport,
            follow_redirects=False,
        )

    @classmethod
    def from_credentials_file(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> Client:
        """A client from ``path`` or ``$ORBIT_CREDENTIALS_FILE`` (JSON with ``url`` and ``token``)."""
        credentials = load_credentials(path)
        return cls(credentials.url, credentials.token, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _request(
        self,
        method: str,
        path: str,
        *,
        key: str | None = None,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> Any:
        headers = {}
        if key is not None:
            headers["Idempotency-Key"] = _check_idempotency_key(key)
        content = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            content = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        query = {name: value for name, value in (params or {}).items() if value is not None}
        try:
            url = _full_url(self.url, path)
        except httpx.InvalidURL as exc:  # e.g. an id too long for a URL: nothing was sent
            raise ValueError(f"{method} {path[:80]}: {exc}") from exc
        try:
            response = self._http.request(method, url, content=content, params=query or None, headers=headers)
        except httpx.TimeoutException as exc:
            raise TransportError(f"{method} {path}: timed out ({exc.__class__.__name__})") from exc
        except httpx.TransportError as exc:
            raise TransportError(f"{method} {path}: {exc.__class__.__name__}: {exc}") from exc
        if not 200 <= response.status_code < 300:
            raise _api_error(response)
        try:
            envelope = response.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"{method} {path}: success response is not JSON") from exc
        if not isinstance(envelope, dict) or "data" not in envelope:
            raise ProtocolError(f"{method} {path}: success response has no 'data' envelope")
        return envelope["data"]

    # ------------------------------------------------------------------ queues

    def create_queue(self, key: str, request: CreateQueueRequest) -> CreateQueueResult:
        """``POST /v1/queues``: 201 first, replay 200 with ``deduplicated=True``."""
        return CreateQueueResult.from_json(
            self._request("POST", "/v1/queues", key=key, body=_body_of(request, CreateQueueRequest))
        )

    def get_queue(self, queue_id: str) -> Queue:
        return Queue.from_json(self._request("GET", f"/v1/queues/{_segment(queue_id)}"))

    def list_queues(self, page_size: int | None = None, page_token: str | None = None) -> Page[Queue]:
        data = self._request("GET", "/v1/queues", params={"page_size": page_size, "page_token": page_token})
        return _page(data, Queue.from_json)

    def configure_queue(self, queue_id: str, key: str, request: ConfigureQueueRequest) -> CreateQueueResult:
        """Full replacement of the queue's controls, checked against ``expected_revision``."""
        path = f"/v1/queues/{_segment(queue_id)}:configure"
        return CreateQueueResult.from_json(
            self._request("POST", path, key=key, body=_body_of(request, ConfigureQueueRequest))
        )

    def retire_queue(self, queue_id: str, key: str, expected_revision: int, reason: str) -> CreateQueueResult:
        """Retire a paused, empty queue for good (reads keep working, the name stays taken)."""
        body = {"expected_revision": _uint64_text(expected_revision, "expected_revision"), "reason": reason}
        path = f"/v1/queues/{_segment(queue_id)}:retire"
        return CreateQueueResult.from_json(self._request("POST", path, key=key, body=body))

    # ------------------------------------------------------------ application

    def get_application(self, application_id: str) -> Application:
        """The credential's own application: quotas and live counters (``applications:manage``)."""
        return Application.from_json(self._request("GET", f"/v1/applications/{_segment(application_id)}"))

    def configure_application(
        self,
        application_id: str,
        key: str,
        expected_revision: int,
        reason: str,
        max_active_attempts: int,
        max_unfinished_tasks: int,
    ) -> ConfigureApplicationResult:
        """Full replacement of the application's quotas, checked against ``expected_revision``."""
        body = {
            "expected_revision": _uint64_text(expected_revision, "expected_revision"),
            "reason": reason,
            "max_active_attempts": max_active_attempts,
            "max_unfinished_tasks": max_unfinished_tasks,
        }
        path = f"/v1/applications/{_segment(application_id)}:configure"
        return ConfigureApplicationResult.from_json(self._request("POST", path, key=key, body=body))

    def list_events(self, after: int | None = None, page_size: int | None = None) -> EventPage:
        """The namespace's events after cursor ``after`` (from the start when None), oldest first."""
        params = {"after": None if after is None else _uint64_text(after, "after"), "page_size": page_size}
        return EventPage.from_json(self._request("GET", "/v1/events", params=params))

    # ------------------------------------------------------------------ plans

    def create_plan(self, key: str, request: CreatePlanRequest) -> PlanResult:
        return PlanResult.from_json(
            self._request("POST", "/v1/plans", key=key, body=_body_of(request, CreatePlanRequest))
        )

    def get_plan(self, plan_id: str) -> Plan:
        return Plan.from_json(self._request("GET", f"/v1/plans/{_segment(plan_id)}"))

    def list_plans(self, page_size: int | None = None, page_token: str | None = None) -> Page[Plan]:
        data = self._request("GET", "/v1/plans", params={"page_size": page_size, "page_token": page_token})
        return _page(data, Plan.from_json)

    def update_plan(self, plan_id: str, key: str, request: UpdatePlanRequest) -> PlanResult:
        """A new immutable version; its schedule starts from now."""
        path = f"/v1/plans/{_segment(plan_id)}:update"
        return PlanResult.from_json(self._request("POST", path, key=key, body=_body_of(request, UpdatePlanRequest)))

    def _change_plan(self, verb: str, plan_id: str, key: str, expected_revision: int, reason: str) -> PlanResult:
        body = {"expected_revision": _uint64_text(expected_revision, "expected_revision"), "reason": reason}
        return PlanResult.from_json(self._request("POST", f"/v1/plans/{_segment(plan_id)}:{verb}", key=key, body=body))

    def pause_plan(self, plan_id: str, key: str, expected_revision: int, reason: str) -> PlanResult:
        return self._change_plan("pause", plan_id, key, expected_revision, reason)

    def resume_plan(self, plan_id: str, key: str, expected_revision: int, reason: str) -> PlanResult:
        """Points that fell while paused are not made up."""
        return self._change_plan("resume", plan_id, key, expected_revision, reason)

    def retire_plan(self, plan_id: str, key: str, expected_revision: int, reason: str) -> PlanResult:
        return self._change_plan("retire", plan_id, key, expected_revision, reason)

    def list_plan_triggers(
        self, plan_id: str, page_size: int | None = None, page_token: str | None = None
    ) -> Page[PlanTrigger]:
        """The plan's decided points, in the order they were decided."""
        path = f"/v1/plans/{_segment(plan_id)}/triggers"
        return _page(
            self._request("GET", path, params={"page_size": page_size, "page_token": page_token}), PlanTrigger.from_json
        )

    # ------------------------------------------------------------------ tasks

    def submit_task(self, key: str, request: SubmitTaskRequest) -> SubmitTaskResult:
        """``POST /v1/tasks``. On ``QUEUE_FULL`` wait ``retry_after`` and re-send with the same key."""
        return SubmitTaskResult.from_json(
            self._request("POST", "/v1/tasks", key=key, body=_body_of(request, SubmitTaskRequest))
        )

    def get_task(self, task_id: str) -> Task:
        """The task detail, payload included."""
        return Task.from_json(self._request("GET", f"/v1/tasks/{_segment(task_id)}"))

    def list_tasks(
        self,
        queue_id: str | None = None,
        state: str | None = None,
        business_key: str | None = None,
        concurrency_key: str | None = None,
        page_size: int | None = None,
        page_token: str | None = None,
    ) -> Page[Task]:
        """Task summaries (no payload)."""
        params = {
            "queue_id": queue_id,
            "state": state,
            "business_key": business_key,
            "concurrency_key": concurrency_key,
            "page_size": page_size,
            "page_token": page_token,
        }
        return _page(self._request("GET", "/v1/tasks", params=params), Task.from_json)

    def list_attempts(self, task_id: str, page_size: int | None = None, page_token: str | None = None) -> Page[Attempt]:
        """A task's attempts in lease order, a page at a time."""
        params = {"page_size": page_size, "page_token": page_token}
        path = f"/v1/tasks/{_segment(task_id)}/attempts"
        return _page(self._request("GET", path, params=params), Attempt.from_json)

    def get_attempt(self, attempt_id: str) -> Attempt:
        return Attempt.from_json(self._request("GET", f"/v1/attempts/{_segment(attempt_id)}"))

    def cancel_task(self, task_id: str, key: str, reason: str) -> CancelTaskResult:
        """Cancel now if not started; a running task only gets ``cancel_requested``."""
        path = f"/v1/tasks/{_segment(task_id)}:cancel"
        return CancelTaskResult.from_json(self._request("POST", path, key=key, body={"reason": reason}))

    def resolve_task(self, task_id: str, key: str, resolution: str, reason: str) -> ResolveTaskResult:
        """Decide a NEEDS_REVIEW task: ``resolution`` is SUCCEEDED, FAILED or RETRY."""
        path = f"/v1/tasks/{_segment(task_id)}:resolve"
        body = {"resolution": resolution, "reason": reason}
        return ResolveTaskResult.from_json(self._request("POST", path, key=key, body=body))
