from __future__ import annotations

import json
from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class StrictJSONParser(BaseParser):
    """JSON bodies as the API promises: UTF-8, standard JSON, an object at the top."""

    media_type = "application/json"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict | None = None) -> Any:
        raw = stream.read() if stream is not None else b""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ParseError("request body: invalid UTF-8") from exc
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except ValueError as exc:
            raise ParseError(f"request body: malformed JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ParseError("request body: must be a JSON object")
        return data
