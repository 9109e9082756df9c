"""`python -m server.serve [daphne's arguments]` (documented as `python -m orbit.serve`): daphne, with uvloop under its
Twisted reactor where uvloop is installed.

Daphne runs Twisted on an asyncio event loop that it creates when it is
imported; every HTTP request and worker frame of the process is scheduled on
it (call_soon, futures, timers, the readiness callbacks). uvloop is asyncio's
event loop in C: under a stream of single submits the pure-Python loop's own
bookkeeping was a fifth of the event loop's time. Twisted still does the
socket I/O and daphne the protocols, so the behaviour is daphne's; only the
loop underneath changes. Without uvloop (Windows), the standard loop runs.

Started by server/supervisor.py (`orbit serve --processes N`), a child serves the
supervisor's socket (`--fd`) and reports, on the pipe named in its environment,
once it listens (`run_child`)."""

import asyncio
import os
import signal
import socket
import sys

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is installed wherever it builds
    uvloop = None  # type: ignore[assignment]  # the optional-import idiom

if uvloop is not None:
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import daphne.server  # noqa: E402  (daphne makes its loop on import)
from daphne.cli import CommandLineInterface  # noqa: E402
from daphne.server import Server  # noqa: E402
from twisted.internet.endpoints import AdoptedStreamServerEndpoint, serverFromString  # noqa: E402

READY_FD_ENV = "ORBIT_SERVE_READY_FD"  # as in server/supervisor.py
PARENT_ENV = "ORBIT_SERVE_SUPERVISOR"
PR_SET_PDEATHSIG = 1


def endpoint_from_string(reactor: Any, description: str) -> Any:
    """Twisted's serverFromString, except that daphne's `--fd N` ("fd:fileno=N",
    which Twisted reads as an IPv4 socket) adopts the socket with its own family."""
    prefix = "fd:fileno="
    if description.startswith(prefix) and description[len(prefix) :].isdigit():
        fd = int(description[len(prefix) :])
        probe = socket.socket(fileno=fd)
        family = probe.family
        probe.detach()
        return AdoptedStreamServerEndpoint(reactor, fd, family)
    return serverFromString(reactor, description)


daphne.server.serverFromString = endpoint_from_string


def run(
    argv: list[str],
    on_listening: Callable[[list[tuple[str, int]]], None] | None = None,
    on_listen_failure: Callable[[str], object] | None = None,
) -> int:
    """daphne with `argv` (its own arguments); `on_listening` is called with the
    bound (host, port) pairs once every endpoint listens, before the first
    request is served, and `on_listen_failure` (instead of daphne's log line)
    with "Listen failure: …" when one cannot. The exit status: 1 when an
    endpoint could not listen."""

    class ListeningServer(Server):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if on_listening is not None:
                # Called by Server.run after its endpoints listened (TCP listens
                # synchronously), and not at all when one failed (abort_start).
                kwargs["ready_callable"] = lambda: on_listening(list(self.listening_addresses))
            super().__init__(*args, **kwargs)

        def listen_error(self, failure: Any) -> None:
            if on_listen_failure is None:
                super().listen_error(failure)
                return
            on_listen_failure(f"Listen failure: {failure.getErrorMessage()}")
            self.stop()

    cli = CommandLineInterface()
    cli.server_class = ListeningServer
    try:
        cli.run(argv)
    except SystemExit as exc:  # daphne exits 1 when a listen failed
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def die_with_parent(parent: int) -> None:
    """SIGKILL when the supervisor dies (Linux), so that no child outlives it.

    SIGKILL, not SIGTERM: a child frozen by SIGSTOP (a debugger, a hung host)
    cannot act on SIGTERM, which stays pending until it is continued, so it
    would keep the supervisor's socket and the port, accepting connections it
    never answers. A supervisor that is stopped, not killed, still stops its
    children gracefully with SIGTERM (server/supervisor.py); this signal only
    comes when the supervisor is gone without doing so. Elsewhere than Linux
    there is no parent-death signal: a new supervisor reclaims the port from
    leftovers where it can (supervisor.reclaim_port)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the prctl: the signal will never come
        os.kill(os.getpid(), signal.SIGKILL)


def run_child(argv: list[str], ready_fd: int, parent: int) -> int:
    """One of the supervisor's processes: daphne on its socket, "ready" on `ready_fd`
    once it listens. SIGINT and SIGHUP are ignored (Twisted then leaves SIGINT
    alone): a terminal's Ctrl-C or hang-up reaches the supervisor too, which
    stops every child with SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    die_with_parent(parent)

    def ready(_addresses: list[tuple[str, int]]) -> None:
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)

    return run(argv, on_listening=ready)


def stop_on_hangup() -> None:
    """SIGHUP stops a lone server process as SIGTERM does (Twisted's graceful
    stop), where its default would end the process mid-round."""
    signal.signal(signal.SIGHUP, lambda _signum, _frame: os.kill(os.getpid(), signal.SIGTERM))


def main() -> None:
    if READY_FD_ENV in os.environ:
        ready_fd, parent = int(os.environ.pop(READY_FD_ENV)), int(os.environ.pop(PARENT_ENV, "0"))
        sys.exit(run_child(sys.argv[1:], ready_fd, parent))
    stop_on_hangup()
    CommandLineInterface.entrypoint()


if __name__ == "__main__":
    main()
