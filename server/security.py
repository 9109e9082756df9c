"""Headers every HTTP answer carries, whichever handler made it.

The console's pages change state with one click (a delete confirmation, an
action), so no other site may frame them: `X-Frame-Options: DENY` for the
browsers that know only that header, and a Content-Security-Policy of
`frame-ancestors 'none'` for the ones that prefer it. The policy names no
other directive: the console's own inline scripts and styles stay allowed.

The server has three ways to answer (server/asgi.py): Django's full handler
(the console, the probes, static files), the API's handler (/v1/) and the
API's own routes that answer from the ASGI scope (tasks/submit_route.py).
Only a wrapper around the ASGI application sees all of them, so the headers
are added there, to any answer that does not set them itself; Django's
XFrameOptionsMiddleware still runs in the console's chain (settings) so the
console keeps its protection under any other entry point, the test client's
included."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CONTENT_SECURITY_POLICY = "frame-ancestors 'none'"
FRAMING_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode("ascii")),
)


def with_framing_headers(headers: Any) -> list[tuple[bytes, bytes]]:
    """The answer's headers plus each framing header it does not set itself."""
    kept = list(headers or ())
    present = {name.lower() for name, _ in kept}
    kept.extend(header for header in FRAMING_HEADERS if header[0] not in present)
    return kept


def frame_protected(app: AsgiApp) -> AsgiApp:
    """`app`, its every HTTP answer refusing to be framed (see the module)."""

    async def protected(scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await app(scope, receive, send)
            return

        async def send_protected(message: Message) -> None:
            if message.get("type") == "http.response.start":
                message = {**message, "headers": with_framing_headers(message.get("headers"))}
            await send(message)

        await app(scope, receive, send_protected)

    return protected
