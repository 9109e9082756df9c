"""`orbit serve --processes N` (here as `manage.py serve`, the same code): one
supervisor, N daphne children on its one socket. Both children accept, SIGTERM
stops every one of them with exit 0, and a child that dies is started again."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.live import ROOT, free_port, server_env

START_LINE = re.compile(r"orbit: serving on http://127\.0\.0\.1:(\d+); database [^;]+; processes (\d+); pid (\d+)")
SECRET = {"ORBIT_SECRET_KEY": "a-production-secret-for-the-tests"}

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc"),
]


@pytest.fixture
def env(django_db_setup: None, django_db_blocker: Any) -> dict[str, str]:
    with django_db_blocker.unblock():
        made = server_env()
    made.pop("ORBIT_HTTP_ADDR", None)
    return {**made, **SECRET}


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or reaped between open and read
        return False
    return state != "Z"


def wait_for(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def established_per_child(port: int, pids: list[int]) -> dict[int, int]:
    """How many of the established connections to `port` each process holds."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # 01: ESTABLISHED
            inodes.add(f"socket:[{fields[9]}]")
    held = {}
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        held[pid] = sum(1 for fd in fds.iterdir() if _readlink(fd) in inodes)
    return held


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


class Served:
    def __init__(self, env: dict[str, str], tmp_path: Path, processes: int = 2) -> None:
        self.port = free_port()
        self.stdout, self.stderr = tmp_path / "stdout", tmp_path / "stderr"
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "manage.py", "serve", "-p", str(self.port), "--processes", str(processes)],
                cwd=ROOT,
                env={**env, "ORBIT_HTTP_ADDR": "127.0.0.1:8080"},
                stdout=out,
                stderr=err,
            )
        line = wait_for(self.start_line, 30, "the start-up line")
        self.match = START_LINE.fullmatch(line)
        assert self.match, line

    def start_line(self) -> str | None:
        assert self.process.poll() is None, self.stderr.read_text()
        text = self.stdout.read_text()
        return text.splitlines()[0] if "\n" in text else None

    def get(self, path: str = "/healthz") -> int:
        return httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=5).status_code

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=40)


@pytest.fixture
def served(env: dict[str, str], tmp_path: Path):
    made = Served(env, tmp_path)
    try:
        yield made
    finally:
        if made.process.poll() is None:
            for child in children(made.process.pid):
                os.kill(child, signal.SIGKILL)
            made.process.kill()
            made.process.wait()


def test_two_processes_share_the_address_and_both_accept(served: Served):
    assert int(served.match[1]) == served.port and served.match[2] == "2"
    assert int(served.match[3]) == served.process.pid  # the supervisor's
    kids = children(served.process.pid)
    assert len(kids) == 2 and all(alive(pid) for pid in kids)
    assert served.get("/healthz") == 200 and served.get("/readyz") == 200
    # Connections kept open: the kernel hands them to both children.
    for _ in range(5):
        connections = []
        try:
            for _ in range(40):
                sock = socket.create_connection(("127.0.0.1", served.port), timeout=5)
                connections.append(sock)
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
                assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            held = established_per_child(served.port, kids)
        finally:
            for sock in connections:
                sock.close()
        if all(held.values()):
            break
    assert sum(held.values()) == 40 and all(held.values()), held


def wake_up_directory(pid: int) -> Path:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    (found,) = [entry.split(b"=", 1)[1] for entry in environ if entry.startswith(b"ORBIT_WAKEUP_DIR=")]
    return Path(found.decode())


def test_the_children_find_each_other_for_wake_ups_and_the_directory_goes_at_stop(served: Served):
    kids = children(served.process.pid)
    directories = {wake_up_directory(pid) for pid in kids}
    assert len(directories) == 1, directories  # one directory for all of them
    (directory,) = directories
    wait_for(
        lambda: sorted(os.listdir(directory)) == sorted(f"{pid}.sock" for pid in kids),
        20,
        "a wake-up socket per child",
    )
    assert served.stop() == 0, served.stderr.read_text()
    assert not directory.exists()


def test_sigterm_stops_every_process_with_exit_0(served: Served):
    kids = children(served.process.pid)
    assert served.get() == 200
    assert served.stop() == 0, served.stderr.read_text()
    wait_for(lambda: not any(alive(pid) for pid in kids), 10, "every child gone")
    # The one start-up line, then daphne's access log (flushed as each child stops).
    lines = served.stdout.read_text().splitlines()
    assert lines[0] == served.match[0] and all('"GET /' in line for line in lines[1:]), lines
    assert "Traceback" not in served.stderr.read_text()


def test_a_killed_child_is_restarted_and_the_other_serves_meanwhile(served: Served):
    supervisor = served.process.pid
    originals = children(supervisor)
    for n, victim in enumerate(originals, 1):  # each original in turn: the other one answers meanwhile
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda victim=victim: not alive(victim), 5, "the killed child gone")
        assert served.get() == 200
        wait_for(lambda n=n: served.stderr.read_text().count("serving again") >= n, 20, "the new child serving")
        live = [pid for pid in children(supervisor) if alive(pid)]
        assert len(live) == 2 and victim not in live, live
        assert served.get() == 200
    errors = served.stderr.read_text()
    restarts = re.findall(
        r"orbit serve: server process \d \(pid (\d+)\) exited with signal SIGKILL; restarting", errors
    )
    assert sorted(map(int, restarts)) == sorted(originals), errors
    assert served.stop() == 0


def test_daphne_endpoint_options_are_refused_with_more_than_one_process(env: dict[str, str]):
    result = subprocess.run(
        [sys.executable, "manage.py", "serve", "--processes", "2", "-u", "/tmp/orbit.sock"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "orbit serve: -u cannot be combined with --processes above 1 (the processes share -b HOST -p PORT)"
    ]
