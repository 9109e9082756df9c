from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser

from orbit.errors import PayloadTooLarge


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e999: JSON no column can store once it is parsed (Infinity)
        raise ValueError(f"{text} is out of range for a number")
    return value


# json.loads builds a decoder per call when given these hooks; one is enough.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)

# Python's own words for an integer over its conversion limit (4300 digits)
# name an interpreter setting; the caller is told what was wrong with the JSON.
_DIGIT_LIMIT = re.compile(r"Exceeds the limit \((\d+) digits\) for integer string conversion: value has (\d+) digits")


def malformed(exc: ValueError) -> str:
    """What a JSON parse error says, in the API's words."""
    over = _DIGIT_LIMIT.match(str(exc))
    if over:
        return f"an integer of {over.group(2)} digits, more than {over.group(1)}"
    return str(exc)


def strict_loads(text: str) -> Any:
    """Standard JSON only: NaN, Infinity and numbers that overflow to them are
    refused (ValueError), as a JSON column would refuse them later; a leading
    BOM too. RecursionError: nested deeper than the parser goes."""
    return _DECODER.decode(text)


class StrictJSONParser(BaseParser):
    """JSON bodies as the API promises: UTF-8, standard JSON, an object at the top."""

    media_type = "application/json"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
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
        data = json.loads(text) if text.startswith("\ufeff") else strict_loads(text)
    except ValueError as exc:
        raise ParseError(f"request body: malformed JSON ({malformed(exc)})") from exc
    except RecursionError as exc:
        raise ParseError("request body: JSON nested too deeply") from exc
    if not isinstance(data, dict):
        raise ParseError("request body: must be a JSON object")
    return data
