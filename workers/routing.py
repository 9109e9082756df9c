from typing import Any

from django.urls import path, re_path

from workers.consumers import WorkerConsumer


async def refuse_handshake(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A WebSocket handshake on any other path: refused (daphne answers a
    handshake closed before it was accepted with HTTP 403, its only refusal),
    not left to Channels' router, which raises and daphne answers 500."""
    await receive()  # websocket.connect
    await send({"type": "websocket.close"})


# Channels routes with Django's path(), whose stubs know views only.
websocket_urlpatterns = [
    path("v1/workers/connect", WorkerConsumer.as_asgi()),  # type: ignore[arg-type]
    re_path(r"", refuse_handshake),  # type: ignore[arg-type]
]
