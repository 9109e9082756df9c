"""`python -m orbit.serve [daphne's arguments]`: daphne, with uvloop under its
Twisted reactor where uvloop is installed.

Daphne runs Twisted on an asyncio event loop that it creates when it is
imported; every HTTP request and worker frame of the process is scheduled on
it (call_soon, futures, timers, the readiness callbacks). uvloop is asyncio's
event loop in C: under a stream of single submits the pure-Python loop's own
bookkeeping was a fifth of the event loop's time. Twisted still does the
socket I/O and daphne the protocols, so the behaviour is daphne's; only the
loop underneath changes. Without uvloop (Windows), the standard loop runs."""

import asyncio

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is installed wherever it builds
    uvloop = None

if uvloop is not None:
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

from daphne.cli import CommandLineInterface  # noqa: E402  (daphne makes its loop on import)
from daphne.server import Server  # noqa: E402


def run(argv: list[str], on_listening: Callable[[list[tuple[str, int]]], None] | None = None) -> int:
    """daphne with `argv` (its own arguments); `on_listening` is called with the
    bound (host, port) pairs once every endpoint listens, before the first
    request is served. The exit status: 1 when an endpoint could not listen."""

    class ListeningServer(Server):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if on_listening is not None:
                # Called by Server.run after its endpoints listened (TCP listens
                # synchronously), and not at all when one failed (abort_start).
                kwargs["ready_callable"] = lambda: on_listening(list(self.listening_addresses))
            super().__init__(*args, **kwargs)

    cli = CommandLineInterface()
    cli.server_class = ListeningServer
    try:
        cli.run(argv)
    except SystemExit as exc:  # daphne exits 1 when a listen failed
        return exc.code if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    CommandLineInterface.entrypoint()
