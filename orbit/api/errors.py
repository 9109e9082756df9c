"""Maps every exception to the error envelope; bad input never becomes a 500."""

from __future__ import annotations

import logging
from typing import Any, overload

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent
from django.db import DatabaseError, InterfaceError, OperationalError
from django.http import HttpRequest, JsonResponse
from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response

from orbit.api.fields import first_validation_message
from orbit.api.middleware import request_id_of
from orbit.errors import OrbitError

logger = logging.getLogger("orbit.api")

# MySQL client error numbers that mean "the server is not there right now";
# 1040/1203 are the server refusing a connection because all are in use.
DATABASE_UNREACHABLE_ERRNOS = frozenset({2002, 2003, 2005, 2006, 2013, 2055, 1040, 1053, 1203, 1205, 1213})


def encodable(message: str) -> str:
    """`message` as UTF-8 can encode it. A message may echo input (an unknown
    field's name) holding a lone surrogate from a JSON escape; UTF-8 cannot
    encode that, so it is escaped rather than fail while rendering the error."""
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(request_id: str, code: str, message: str) -> dict[str, Any]:
    return {"request_id": request_id, "error": {"code": code, "message": encodable(message)}}


@overload
def translate(exc: drf_exceptions.ValidationError) -> OrbitError: ...
@overload
def translate(exc: BaseException) -> OrbitError | None: ...
def translate(exc: BaseException) -> OrbitError | None:
    """The OrbitError an exception stands for, or None when it is a real fault."""
    from orbit import errors

    if isinstance(exc, OrbitError):
        return exc
    if isinstance(exc, RequestDataTooBig):
        return errors.PayloadTooLarge("request body too large")
    if isinstance(exc, TooManyFieldsSent):
        return errors.InvalidArgument(f"query: more than {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} parameters")
    if isinstance(exc, drf_exceptions.ParseError):
        return errors.InvalidArgument(str(exc.detail))
    if isinstance(exc, drf_exceptions.UnsupportedMediaType):
        return errors.InvalidArgument("Content-Type must be application/json")
    if isinstance(exc, drf_exceptions.ValidationError):
        return errors.InvalidArgument(first_validation_message(exc.detail))
    if isinstance(exc, (drf_exceptions.NotAuthenticated, drf_exceptions.AuthenticationFailed)):
        return errors.Unauthenticated(str(exc.detail))
    if isinstance(exc, drf_exceptions.PermissionDenied):
        return errors.PermissionDenied(str(exc.detail))
    if isinstance(exc, drf_exceptions.NotFound):
        return errors.NotFound(str(exc.detail))
    if isinstance(exc, drf_exceptions.APIException) and exc.status_code < 500:
        # Any other client error DRF raises (405 method, 406 Accept, ...) keeps
        # its status; bad input is never an INTERNAL error.
        error = errors.InvalidArgument(str(exc.detail))
        error.status = exc.status_code
        return error
    if isinstance(exc, (OperationalError, InterfaceError)):
        errno = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
        if errno is None or errno in DATABASE_UNREACHABLE_ERRNOS:
            return errors.Unavailable("database unavailable; retry later")
    if isinstance(exc, DatabaseError) and "unable to open database" in str(exc):
        return errors.Unavailable("database unavailable; retry later")
    return None


def error_response_for(request: HttpRequest, exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    return error_answer(request_id_of(request), exc)


def error_answer(request_id: str, exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Status, envelope and headers of the answer to a request that `exc` ended."""
    from orbit import errors

    error = translate(exc)
    if error is None:
        logger.exception("unhandled error", exc_info=exc)
        error = errors.Internal("internal error")
    headers = {}
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    return error.status, error_body(request_id, error.code, error.message), headers


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response:
    # DRF's views always give the handler their request (a context without one
    # would have failed in request_id_of all the same).
    request = context["request"]._request
    status, body, headers = error_response_for(request, exc)
    return Response(body, status=status, headers=headers)


# Compact, as DRF's JSONRenderer answers every other request.
COMPACT_JSON = {"separators": (",", ":")}


def json_error_view(code: str, status: int, message: str) -> Any:
    def view(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
        response = JsonResponse(
            error_body(request_id_of(request), code, message),
            status=status,
            json_dumps_params=COMPACT_JSON,
        )
        response["X-Request-Id"] = request_id_of(request)
        return response

    return view
