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

from daphne.cli import CommandLineInterface  # noqa: E402  (daphne makes its loop on import)

if __name__ == "__main__":
    CommandLineInterface.entrypoint()
