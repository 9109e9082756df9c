"""The Content-Type fast path gives Twisted the answer its own parser gives."""

from __future__ import annotations

import pytest
from twisted.web import http

from orbit.serving import fast_content_type, tune_twisted

ORIGINAL = getattr(http._parseContentType, "__wrapped__", http._parseContentType)

HEADERS = [
    b"application/json",
    b"Application/JSON",
    b"application/json; charset=utf-8",
    b"application/json;charset=UTF-8",
    b"  application/json  ",
    b"application/x-www-form-urlencoded",
    b"APPLICATION/X-WWW-FORM-URLENCODED; charset=latin-1",
    b"multipart/form-data; boundary=----abc",
    b'multipart/form-data;boundary="quoted; boundary"',
    b"text/plain",
    b"application/vnd.api+json",
    b"application/problem+json; q=0.5",
    b"",
    b"json",
    b"application/",
    b"/json",
    b"application /json",
    b"application/json (comment)",
    b"application/json, text/plain",
    b"\xe9/\xe9",
    b'application/json; charset="unterminated',
]


@pytest.mark.parametrize("header", HEADERS)
def test_fast_path_agrees_with_twisted(header: bytes) -> None:
    assert fast_content_type(ORIGINAL)(header) == ORIGINAL(header)


def test_tuning_installs_once_and_keeps_the_original_behind_it() -> None:
    tune_twisted()
    tune_twisted()
    assert http._parseContentType.__wrapped__ is ORIGINAL
    assert http._parseContentType(b"Application/Json; charset=utf-8") == b"application/json"
