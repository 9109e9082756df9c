"""`orbit serve --processes N`: one address, N server processes.

A process of Python serves its requests and worker frames on one event loop and
so uses at most one core's worth of Python. The supervisor binds the listening
socket once (SO_REUSEADDR, a backlog of `BACKLOG`) and starts N children, each
`python -m server.serve --fd FD [daphne's arguments] APPLICATION`: daphne on the
inherited socket, with its own round lanes, database pool and maintenance
thread (server/asgi.py). Every child accepts from the one socket; the kernel
hands each connection to one of them. A worker's WebSocket lives in the child
that accepted it; what another child's round makes available reaches this
child's dispatchers as a wake-up through the directory the supervisor makes
for them (tasks.wakeups, `SIBLINGS_DIR_ENV`), and by polling if one is lost.
The children's /metrics counters add up in another directory, fresh at every
start (prometheus-client's multiprocess mode, `METRICS_DIR_ENV`): a scrape
answered by any child reads every child's files, those of children that died
too, so a counter never goes back when one is restarted (orbit.metrics).

The supervisor:
- announces once, when every child listens (each writes a line to its own
  pipe, `READY_FD_ENV`);
- forwards SIGTERM, SIGINT and SIGHUP to the children as SIGTERM (daphne's
  graceful stop) and waits for them, at most `STOP_SECONDS`, then SIGKILLs what
  is left and exits 0; the children ignore SIGINT and SIGHUP (a terminal's
  Ctrl-C or hang-up reaches the whole process group; the supervisor's SIGTERM
  is the one stop they get);
- restarts a child that dies while serving, after a backoff (`FIRST_BACKOFF`,
  doubled after each quick death up to `MAX_BACKOFF`), with one line on stderr;
- exits 1 when a child dies before the first announcement (it cannot serve).
The children get SIGKILL when the supervisor dies (Linux: PR_SET_PDEATHSIG;
SIGKILL as a SIGSTOPped child cannot act on SIGTERM), so a supervisor killed
on its own leaves no server behind. A supervisor whose port is taken
(EADDRINUSE) by nothing but server children whose supervisor is gone (left by
an Orbit before that signal, or where there is none) SIGKILLs them and binds
again for up to `RECLAIM_SECONDS` (`reclaim_port`, Linux's /proc); a port held
by anything else fails as before, with daphne's "Listen failure" line.

`python -m server.supervisor --processes N -b HOST -p PORT [daphne's arguments]
APPLICATION` is the same without `orbit serve`'s checks (the database, the
migrations), as `python -m orbit.serve` is daphne without them."""

from __future__ import annotations

import argparse
import errno
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import multiprocess

APPLICATION = "server.asgi:application"
# Where the children find each other's wake-up sockets (tasks.wakeups reads it;
# named here too, as the supervisor imports nothing of Django's).
WAKEUP_DIR_ENV = "ORBIT_WAKEUP_DIR"
# Where the children's counters add up (orbit.metrics.MULTIPROCESS_DIR_ENV,
# prometheus-client's name; read when the client is imported, so only a child's
# environment has it, never the supervisor's own).
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
READY_FD_ENV = "ORBIT_SERVE_READY_FD"  # a child writes "ready\n" there once it listens
PARENT_ENV = "ORBIT_SERVE_SUPERVISOR"  # the supervisor's pid, for PR_SET_PDEATHSIG
BACKLOG = 1024
STOP_SECONDS = 30.0
# Each stops the server gracefully: SIGHUP too, as a terminal's hang-up or a
# service manager's reload must not cut rounds short (the settings are read at
# start, so there is nothing to reload).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FIRST_BACKOFF = 0.5
MAX_BACKOFF = 10.0
STEADY_SECONDS = 30.0  # a child that served this long is restarted after FIRST_BACKOFF again
# After killing leftover children on the port, the bind is tried again this long
# (a SIGKILLed process's sockets close once the kernel has reaped its files).
RECLAIM_SECONDS = 5.0
RECLAIM_RETRY_SECONDS = 0.05
TCP_LISTEN = "0A"  # the state column of /proc/net/tcp for a listening socket
# daphne's own ways of choosing where to listen: the supervisor chose already.
ENDPOINT_OPTIONS = ("-u", "--unix-socket", "--fd", "-e", "--endpoint")


class ListenError(Exception):
    pass


def default_processes() -> int:
    return os.cpu_count() or 1


def positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {number}")
    return number


def endpoint_problem(daphne_args: Sequence[str]) -> str | None:
    """A daphne option that would give the children another address, as one line."""
    for arg in daphne_args:
        name = arg.split("=", 1)[0]
        if name in ENDPOINT_OPTIONS:
            return f"{name} cannot be combined with --processes above 1 (the processes share -b HOST -p PORT)"
    return None


def say_on_stderr(line: str) -> None:
    print(f"orbit serve: {line}", file=sys.stderr, flush=True)


def listen(host: str, port: int, backlog: int = BACKLOG, say: Callable[[str], None] = say_on_stderr) -> socket.socket:
    """The one listening socket, non-blocking (Twisted adopts it as it is). A port
    taken by server children of a supervisor that is gone is reclaimed (`reclaim_port`)."""
    if not 0 <= port <= 65535:  # getaddrinfo would wrap it modulo 65536
        raise ListenError(f"Listen failure: Couldn't listen on {host}:{port}: port must be 0-65535.")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError as exc:
        raise ListenError(f"Listen failure: Couldn't listen on {host}:{port}: {exc}.") from None
    try:
        return _bound(family, kind, proto, address, backlog)
    except OSError as exc:
        refused = exc
    if refused.errno == errno.EADDRINUSE:
        killed = reclaim_port(port)
        if killed:
            say(
                f"port {port} was held by server processes of a supervisor that is gone; killed "
                + ", ".join(f"pid {pid}" for pid in killed)
            )
            deadline = time.monotonic() + RECLAIM_SECONDS
            while True:
                try:
                    return _bound(family, kind, proto, address, backlog)
                except OSError as exc:
                    refused = exc
                if refused.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                    break
                time.sleep(RECLAIM_RETRY_SECONDS)
    raise ListenError(f"Listen failure: Couldn't listen on {host}:{port}: {refused}.") from None


def _bound(family: int, kind: int, proto: int, address: tuple, backlog: int) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def reclaim_port(port: int, proc: Path = Path("/proc")) -> list[int]:
    """SIGKILLs the processes listening on `port` if every one is a leftover server
    child (`leftover_child`), and returns their pids; else kills nothing and returns [].

    Only where /proc lists sockets and their owners (Linux); elsewhere []. A listening
    socket whose owner cannot be seen (another user's process) counts as someone
    else's: nothing is killed then."""
    listening = _listening_inodes(port, proc)
    if not listening:
        return []
    holders: dict[int, set[str]] = {}
    for entry in _pids(proc):
        try:
            links = {os.readlink(fd) for fd in (proc / str(entry) / "fd").iterdir()}
        except OSError:  # gone, or not ours to read
            continue
        held = links & listening
        if held:
            holders[entry] = held
    seen = set().union(*holders.values()) if holders else set()
    if seen != listening or not all(leftover_child(pid, proc) for pid in holders):
        return []
    killed = []
    for pid in sorted(holders):
        try:
            os.kill(pid, signal.SIGKILL)  # SIGKILL: a SIGSTOPped leftover acts on nothing else
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def leftover_child(pid: int, proc: Path = Path("/proc")) -> bool:
    """`python -m server.serve --fd N ...` (or an older `orbit.serve`) started by a supervisor (its pid in the
    child's environment, `PARENT_ENV`) that is no longer its parent: the
    supervisor died and the child was adopted by init."""
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
        environ = (proc / str(pid) / "environ").read_bytes().split(b"\0")
        parent = int((proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    is_server_child = (
        any(argv[i : i + 2] in ([b"-m", b"server.serve"], [b"-m", b"orbit.serve"]) for i in range(len(argv)))
        and b"--fd" in argv
    )
    prefix = PARENT_ENV.encode() + b"="
    supervisors = [entry[len(prefix) :] for entry in environ if entry.startswith(prefix)]
    return is_server_child and len(supervisors) == 1 and supervisors[0].isdigit() and int(supervisors[0]) != parent


def _listening_inodes(port: int, proc: Path) -> set[str]:
    """The listening TCP sockets on `port`, as their /proc/PID/fd link texts."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    return inodes


def _pids(proc: Path) -> list[int]:
    try:
        return [int(entry.name) for entry in proc.iterdir() if entry.name.isdigit()]
    except OSError:
        return []


def describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


@dataclass
class Child:
    index: int  # 1..N, stable across restarts
    process: subprocess.Popen | None = None
    ready_fd: int | None = None  # read end of the child's ready pipe
    ready: bool = False
    started: float = 0.0
    backoff: float = 0.0
    restart_at: float | None = None
    restarts: int = 0


class Supervisor:
    def __init__(
        self,
        sock: socket.socket,
        processes: int,
        child_args: Sequence[str],
        python: str = sys.executable,
        say: Callable[[str], None] | None = None,
    ) -> None:
        """`child_args`: daphne's arguments of every child, the application last."""
        self.sock = sock
        self.children = [Child(index) for index in range(1, processes + 1)]
        self.child_args = list(child_args)
        self.python = python
        self.say = say or (lambda line: print(f"orbit serve: {line}", file=sys.stderr, flush=True))
        self.selector = selectors.DefaultSelector()
        self.stop_signal: int | None = None
        self.wakeup_dir: str | None = None
        self.metrics_dir: str | None = None

    # -- children ----------------------------------------------------------------

    def spawn(self, child: Child) -> None:
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        env = {**os.environ, READY_FD_ENV: str(write_end), PARENT_ENV: str(os.getpid())}
        if self.wakeup_dir is not None:
            env[WAKEUP_DIR_ENV] = self.wakeup_dir
        # Set or not, never inherited: another run's files would be added in.
        env.pop(METRICS_DIR_ENV, None)
        if self.metrics_dir is not None:
            env[METRICS_DIR_ENV] = self.metrics_dir
        fd = self.sock.fileno()
        try:
            child.process = subprocess.Popen(
                [self.python, "-m", "server.serve", "--fd", str(fd), *self.child_args],
                env=env,
                pass_fds=(fd, write_end),
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        child.ready_fd, child.ready, child.started, child.restart_at = read_end, False, time.monotonic(), None
        self.selector.register(read_end, selectors.EVENT_READ, child)

    def forget_pipe(self, child: Child) -> None:
        if child.ready_fd is not None:
            self.selector.unregister(child.ready_fd)
            os.close(child.ready_fd)
            child.ready_fd = None

    def read_ready(self, child: Child) -> None:
        try:
            data = os.read(child.ready_fd, 64) if child.ready_fd is not None else b""
        except BlockingIOError:
            return
        if data:
            child.ready = True
            if child.restarts and child.process is not None:
                self.say(f"server process {child.index} serving again (pid {child.process.pid})")
        self.forget_pipe(child)  # one line, or EOF: the pipe has served its purpose

    def forget_metrics(self, pid: int) -> None:
        """A child that is gone: its counters stay in the sum, the values of live
        gauges (multiprocess_mode live*) it wrote go."""
        if self.metrics_dir is not None:
            multiprocess.mark_process_dead(pid, self.metrics_dir)

    def live(self) -> list[subprocess.Popen]:
        return [c.process for c in self.children if c.process is not None and c.process.poll() is None]

    # -- the loop ------------------------------------------------------------------

    def run(self, on_ready: Callable[[], None] | None = None) -> int:
        wake_read, wake_write = os.pipe()
        for end in (wake_read, wake_write):
            os.set_blocking(end, False)
        self.selector.register(wake_read, selectors.EVENT_READ, None)
        previous = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGCHLD)}
        old_wakeup = signal.set_wakeup_fd(wake_write)

        def stop(signum: int, _frame: object) -> None:
            if self.stop_signal is None:
                self.stop_signal = signum

        for stop_signal in STOP_SIGNALS:
            signal.signal(stop_signal, stop)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select
        if len(self.children) > 1:
            self.wakeup_dir = tempfile.mkdtemp(prefix="orbit-wakeups-")
        self.metrics_dir = tempfile.mkdtemp(prefix="orbit-metrics-")
        try:
            return self._serve(on_ready, wake_read)
        finally:
            self._stop_children()
            if self.wakeup_dir is not None:
                shutil.rmtree(self.wakeup_dir, ignore_errors=True)
                self.wakeup_dir = None
            if self.metrics_dir is not None:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)
                self.metrics_dir = None
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for child in self.children:
                self.forget_pipe(child)
            self.selector.unregister(wake_read)
            os.close(wake_read)
            os.close(wake_write)

    def _serve(self, on_ready: Callable[[], None] | None, wake_read: int) -> int:
        for child in self.children:
            self.spawn(child)
        announced = False
        while self.stop_signal is None:
            due = [c.restart_at for c in self.children if c.restart_at is not None]
            timeout = max(0.0, min(due) - time.monotonic()) if due else 1.0
            for key, _ in self.selector.select(min(timeout, 1.0)):
                if key.data is None:
                    try:
                        while os.read(wake_read, 512):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    self.read_ready(key.data)
            if self.stop_signal is not None:
                break
            now = time.monotonic()
            for child in self.children:
                if child.process is None or child.restart_at is not None:
                    continue
                code = child.process.poll()
                if code is None:
                    continue
                if child.ready_fd is not None:  # it may have written "ready" and died at once
                    self.read_ready(child)
                self.forget_pipe(child)
                self.forget_metrics(child.process.pid)
                if not announced:
                    self.say(
                        f"server process {child.index} (pid {child.process.pid}) exited with "
                        f"{describe_status(code)} before it served"
                    )
                    return 1
                served = now - child.started
                child.backoff = (
                    FIRST_BACKOFF
                    if served >= STEADY_SECONDS or not child.backoff
                    else min(child.backoff * 2, MAX_BACKOFF)
                )
                child.restart_at = now + child.backoff
                child.restarts += 1
                self.say(
                    f"server process {child.index} (pid {child.process.pid}) exited with {describe_status(code)}; "
                    f"restarting it in {child.backoff:g} s"
                )
            for child in self.children:
                if child.restart_at is not None and child.restart_at <= time.monotonic():
                    self.spawn(child)
            if not announced and all(c.ready for c in self.children):
                announced = True
                if on_ready is not None:
                    on_ready()
        return 0

    def _stop_children(self) -> None:
        """SIGTERM to each child (daphne stops gracefully), then wait; SIGKILL after STOP_SECONDS."""
        for process in self.live():
            try:
                process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_SECONDS
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(
                    f"server process {child.index} (pid {child.process.pid}) did not stop "
                    f"within {STOP_SECONDS:g} s; killed"
                )
                child.process.kill()
                child.process.wait()


def announce_line(addresses: Sequence[tuple[str, int]], processes: int, database: str | None = None) -> str:
    """The start-up line of `orbit serve` (with the database) and of this module (without)."""
    where = ", ".join(f"http://{'[' + h + ']' if ':' in h else h}:{p}" for h, p in addresses)
    described = f"; database {database}" if database is not None else ""
    return f"orbit: serving on {where}{described}; processes {processes}; pid {os.getpid()}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m server.supervisor",
        description="N daphne processes of APPLICATION on one address (no start-up checks: see `orbit serve`). "
        "Other options are daphne's.",
    )
    parser.add_argument("--processes", type=positive, default=default_processes())
    parser.add_argument("-b", "--bind", metavar="HOST", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=8000)
    options, child_args = parser.parse_known_args(argv)
    if not child_args:
        child_args.append(APPLICATION)
    problem = endpoint_problem(child_args)
    if problem is not None:
        print(f"orbit serve: {problem}", file=sys.stderr, flush=True)
        return 1
    try:
        sock = listen(options.bind, options.port)
    except ListenError as exc:
        print(f"orbit serve: {exc}", file=sys.stderr, flush=True)
        return 1
    addresses = [sock.getsockname()[:2]]
    with sock:
        return Supervisor(sock, options.processes, child_args).run(
            on_ready=lambda: print(announce_line(addresses, options.processes), flush=True)
        )


if __name__ == "__main__":
    sys.exit(main())
