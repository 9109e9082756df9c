"""The API's bearer-token authentication (the principal itself: orbit.principal)."""

from __future__ import annotations

from typing import Any

from rest_framework.authentication import BaseAuthentication

from orbit.principal import Principal, authenticate_token, token_from_header


class BearerTokenAuthentication(BaseAuthentication):
    def authenticate(self, request: Any) -> tuple[Principal, str]:
        token = token_from_header(request.META.get("HTTP_AUTHORIZATION"))
        return authenticate_token(token), token

    def authenticate_header(self, request: Any) -> str:
        return "Bearer"
