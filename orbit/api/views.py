"""Shared view plumbing: the mutating-POST path and list pagination."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from typing import Any, TypeVar, cast
from urllib.parse import unquote_to_bytes

from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from orbit.api.fields import StrictSerializer
from orbit.api.middleware import request_id_of
from orbit.api.responses import ok
from orbit.errors import InvalidArgument
from orbit.idempotency import run_idempotent, validate_key
from orbit.principal import Actor, Principal

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 500


class OrbitView(APIView):
    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        request._request.GET  # noqa: B018 - parsed first: Django's bound on the count answers before check_query
        handler = getattr(self, (request.method or "").lower(), None)
        # None for a method without its documented entry (OPTIONS): any parameter is ignored there.
        accepted: frozenset[str] | None = getattr(handler, "query_parameters", None)
        check_query(request._request.META.get("QUERY_STRING", ""), accepted)
        check_content_encoding(request._request.META.get("HTTP_CONTENT_ENCODING", ""))

    # Orbit's authentication classes set a Principal as request.user, not a Django user.
    @staticmethod
    def principal(request: Request) -> Principal:
        return cast(Principal, request.user)

    @staticmethod
    def actor(request: Request) -> Actor:
        return Actor(principal=cast(Principal, request.user), request_id=request_id_of(request._request))

    @staticmethod
    def body(request: Request) -> dict[str, Any]:
        data = request.data
        if not isinstance(data, dict):
            raise InvalidArgument("request body: must be a JSON object")
        return data

    def mutate(
        self,
        request: Request,
        *,
        operation: str,
        target: str,
        validate: Callable[[dict[str, Any]], T],
        effect: Callable[[Actor, T], tuple[int, dict[str, Any]]],
    ) -> Response:
        """Body, then Idempotency-Key, then replay lookup, then field rules, then
        the effect. Endpoints declare it with orbit.api.mutations.mutation."""
        body = self.body(request)
        key = validate_key(idempotency_key_of(request))
        actor = self.actor(request)
        receipt = run_idempotent(
            actor=actor,
            key=key,
            operation=operation,
            target=target,
            body=body,
            validate=lambda: validate(body),
            effect=lambda validated: effect(actor, validated),
        )
        return ok(request, receipt.data, status=receipt.status)


def check_query(query: str, accepted: frozenset[str] | None = None) -> None:
    """400 naming the parameter whose name or value is not percent-encoded
    UTF-8, that is sent twice, or that is not one of `accepted` (when given).
    Django decodes those bytes to U+FFFD, so `?prefix=%FF` would read as
    "\ufffd" and filter by a character the caller never sent; it keeps the
    last of a repeated parameter, so `?state=WAITING&state=LEASED` would list
    only what the caller named second; and a misspelt filter (`?queueid=`)
    would list everything, as if the caller had asked for no filter."""
    seen: set[str] = set()
    for part in query.split("&"):
        if not part:  # "?a=1&&b=2": Django skips the empty part too
            continue
        raw_name, _, raw_value = part.partition("=")
        name_bytes = unquote_to_bytes(raw_name.replace("+", " "))
        try:
            name = name_bytes.decode("utf-8")
            unquote_to_bytes(raw_value.replace("+", " ")).decode("utf-8")
        except UnicodeDecodeError as exc:
            shown = name_bytes.decode("utf-8", "backslashreplace")
            raise InvalidArgument(f"{shown}: must be percent-encoded UTF-8") from exc
        if name in seen:
            raise InvalidArgument(f"{name}: must be sent once")
        if accepted is not None and name not in accepted:
            raise InvalidArgument(f"{name or '(an empty name)'}: unknown query parameter")
        seen.add(name)


def check_content_encoding(encoding: str) -> None:
    """400 naming a Content-Encoding other than identity: bodies are read as
    sent, and compressed bytes would be refused as the invalid UTF-8 they are."""
    if encoding.strip().lower() not in ("", "identity"):
        raise InvalidArgument(f"Content-Encoding: {encoding} is not supported; send the body uncompressed")


def validated(serializer_class: type[serializers.Serializer], body: dict[str, Any]) -> dict[str, Any]:
    """The serializer's validated data; its ValidationError becomes 400 naming the field."""
    if issubclass(serializer_class, StrictSerializer):
        return serializer_class.validated(body)
    serializer = serializer_class(data=body)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


def idempotency_key_of(request: Request) -> str | None:
    """The Idempotency-Key header as sent. Sent twice, Django would join the
    two with a comma into one key that neither names: refused instead."""
    scope = getattr(request._request, "scope", None)  # None outside ASGI (the test client)
    if scope is not None and sum(name.lower() == b"idempotency-key" for name, _ in scope["headers"]) > 1:
        raise InvalidArgument("Idempotency-Key: must be sent once")
    return request.headers.get("Idempotency-Key")


def page_size_of(request: Request) -> int:
    raw = request.query_params.get("page_size")
    if raw is None:
        return DEFAULT_PAGE_SIZE
    # ASCII digits only: str.isdigit() also takes "²" (int() then fails) and "٣".
    if not re.fullmatch(r"[0-9]{1,4}", raw) or not 1 <= int(raw) <= MAX_PAGE_SIZE:
        raise InvalidArgument(f"page_size: must be an integer between 1 and {MAX_PAGE_SIZE}")
    return int(raw)


def encode_page_token(cursor: str) -> str:
    return base64.urlsafe_b64encode(cursor.encode()).decode().rstrip("=")


def decode_page_token(request: Request, cursor_pattern: str = r"[0-9a-f]{32}") -> str | None:
    raw = request.query_params.get("page_token")
    if not raw:
        return None
    # Strict: a lenient decoder drops unknown characters, so a mangled token
    # would decode to "" and silently restart the walk at the first page.
    # Every token this API issues encodes the last id of a page (`cursor_pattern`).
    try:
        cursor = base64.b64decode(raw + "=" * (-len(raw) % 4), altchars=b"-_", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise InvalidArgument("page_token: invalid") from exc
    if not re.fullmatch(cursor_pattern, cursor):
        raise InvalidArgument("page_token: invalid")
    return cursor
