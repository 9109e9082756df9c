from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser

from orbit.errors import PayloadTooLarge


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# json.loads builds a decoder per call when given parse_constant; one is enough.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


class StrictJSONParser(BaseParser):
    """JSON bodies as the API promises: UTF-8, standard JSON, an object at the top."""

    media_type = "application/json"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict | None = None) -> Any:
        # DRF reads the request as a stream, bypassing Django's own check of
        # DATA_UPLOAD_MAX_MEMORY_SIZE, so the limit is enforced here; reading
        # one byte past it is enough to know.
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if stream is None:
            raw = b""
        elif limit is None:
            raw = stream.read()
        else:
            raw = stream.read(limit + 1)
            if len(raw) > limit:
                raise PayloadTooLarge(f"request body: larger than {limit} bytes")
        return json_object(raw)


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or the ParseError that names what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ParseError("request body: invalid UTF-8") from exc
    try:
        # json.loads also refuses a leading BOM, with its own message: kept for that case
        data = json.loads(text, parse_constant=_reject_constant) if text.startswith("\ufeff") else _DECODER.decode(text)
    except ValueError as exc:
        raise ParseError(f"request body: malformed JSON ({exc})") from exc
    except RecursionError as exc:
        raise ParseError("request body: JSON nested too deeply") from exc
    if not isinstance(data, dict):
        raise ParseError("request body: must be a JSON object")
    return data
