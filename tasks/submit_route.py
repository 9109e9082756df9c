"""POST /v1/tasks answered straight from the ASGI scope, without Django's
request and response objects or DRF's view machinery.

A single submit is the request a busy caller sends most, and on the one
event loop that serves every request and worker frame, Django's handler
(request object, URL resolution, middleware, response copy) and DRF (request
wrapper, negotiation, parser, renderer) cost more than the submit's own
checks. This route takes the plain request every JSON client sends and does
what the view does, in the view's order (tasks.actions.rounds.submit_request), with
the same helpers: the same bearer check, the same JSON rules, the same
envelope rendered by DRF's own JSONRenderer, the same headers. Any request
it does not take as is (another Content-Type or Accept, a query string, a
repeated header, a body over 64 KiB or not a JSON object) and any refusal before
the submit goes to the full handler unchanged, so each error keeps the one
place that words it. Once the submit is handed to its round, the answer is
rendered here, refusals included.

A credential this process has authenticated before is not read again on the
database pool: the checks run on the event loop with the principal it was
minted with, and the round reads its row with its other first reads and
decides the submit only if the credential still grants it. A revoked (or
changed) one is handed to the full handler, which answers 401 (or 403)."""

from __future__ import annotations

import asyncio
from typing import Any

from django.conf import settings
from rest_framework.renderers import JSONRenderer

from orbit.api.errors import error_answer
from orbit.api.handler import HttpAnswer
from orbit.api.parsers import json_object
from orbit.db import inline
from orbit.db.pool import run_db
from orbit.errors import Unavailable
from orbit.fields import new_id
from orbit.principal import (
    Minted,
    Principal,
    authenticate_token,
    enter_cell_of_header,
    known_credential,
    token_from_header,
)
from tasks.actions.rounds import Answer, CredentialNotConfirmed, join_round, receipt_of, submit_request

PATH = "/v1/tasks"
# The headers APIView gives the collection's answers (one renderer: no Vary).
ALLOW = b"GET, POST, HEAD, OPTIONS"
PLAIN_ACCEPT = frozenset({"*/*", "application/json"})
# The body is parsed on the event loop, which every request and worker frame
# shares: larger bodies (up to DATA_UPLOAD_MAX_MEMORY_SIZE) are parsed by the
# view, on the database pool.
LARGEST_BODY = 64 * 1024


_render = JSONRenderer().render


def _meta(scope: dict[str, Any]) -> dict[str, str] | None:
    """The request's headers under their names in Django's META, as
    ASGIRequest reads them; None if one would be joined from several lines."""
    meta: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin1")
        if "_" in name:  # Django drops these
            continue
        name = "CONTENT_TYPE" if name == "content-type" else "HTTP_" + name.upper().replace("-", "_")
        if name in meta:
            return None
        meta[name] = raw_value.decode("latin1")
    return meta


def _plain_body(scope: dict[str, Any], meta: dict[str, str], raw: bytes) -> dict[str, Any] | None:
    if scope.get("query_string") or scope.get("root_path"):
        return None
    if meta.get("CONTENT_TYPE") != "application/json" or meta.get("HTTP_ACCEPT", "*/*") not in PLAIN_ACCEPT:
        return None
    if "HTTP_CONTENT_ENCODING" in meta:  # the view refuses any but identity
        return None
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if len(raw) > LARGEST_BODY or (limit is not None and len(raw) > limit):
        return None
    try:
        return json_object(raw)
    except Exception:
        return None


def _joined(
    loop: asyncio.AbstractEventLoop,
    principal: Principal,
    meta: dict[str, str],
    body: dict[str, Any],
    request_id: str,
    minted: Minted | None = None,
) -> asyncio.Future[Answer]:
    """The view's checks after the bearer's, then the submit joins its round."""
    principal.require("tasks:submit")
    key = meta.get("HTTP_IDEMPOTENCY_KEY")
    return join_round(loop, submit_request(principal, body, key, request_id, credential_to_confirm=minted))


def _read_and_joined(
    loop: asyncio.AbstractEventLoop, meta: dict[str, str], body: dict[str, Any], request_id: str
) -> asyncio.Future[Answer]:
    """On the database pool: the credential read first."""
    principal = authenticate_token(token_from_header(meta.get("HTTP_AUTHORIZATION")))
    return _joined(loop, principal, meta, body, request_id)


def _joined_by_known_credential(
    loop: asyncio.AbstractEventLoop, meta: dict[str, str], body: dict[str, Any], request_id: str
) -> asyncio.Future[Answer] | None:
    """On the event loop, for a credential this process has authenticated
    before: the checks with the principal it was minted with; the round reads
    the credential again before deciding the submit (CredentialNotConfirmed if
    revoked since). None: the credential is not known here, or its secret does
    not match; it must be read first."""
    minted = known_credential(token_from_header(meta.get("HTTP_AUTHORIZATION")))
    return None if minted is None else _joined(loop, minted.principal, meta, body, request_id, minted)


def _answer(status: int, envelope: dict[str, Any], request_id: str, extra: dict[str, str]) -> HttpAnswer:
    body = _render(envelope)
    headers = [
        (b"Content-Type", b"application/json"),
        (b"Allow", ALLOW),
        *((name.encode("latin1"), value.encode("latin1")) for name, value in extra.items()),
        (b"X-Request-Id", request_id.encode("ascii")),
        (b"X-Content-Type-Options", b"nosniff"),
        (b"Content-Length", str(len(body)).encode("ascii")),
    ]
    return status, headers, body


async def answer(scope: dict[str, Any], raw: bytes) -> HttpAnswer | None:
    """The answer to a plain POST /v1/tasks, or None: the full handler answers it."""
    if inline():  # the pool's connections cannot see the test case's transaction: the view's path
        return None
    meta = _meta(scope)
    body = None if meta is None else _plain_body(scope, meta, raw)
    if meta is None or body is None:
        return None
    request_id = new_id()
    loop = asyncio.get_running_loop()
    try:
        joined = _joined_by_known_credential(loop, meta, body, request_id)
        if joined is None:
            await enter_cell_of_header(meta.get("HTTP_AUTHORIZATION"))
            joined = await run_db(_read_and_joined, loop, meta, body, request_id)
    except Unavailable as exc:  # the deadline passed reading the credential: the full path would wait again
        status, envelope, extra = error_answer(request_id, exc)
        return _answer(status, envelope, request_id, extra)
    except Exception:
        return None
    try:
        receipt = await receipt_of(joined)
    except CredentialNotConfirmed:
        return None
    except Exception as exc:
        status, envelope, extra = error_answer(request_id, exc)
        return _answer(status, envelope, request_id, extra)
    return _answer(receipt.status, {"request_id": request_id, "data": receipt.data}, request_id, {})
