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
from tests.support.serve_processes import SECRET, Served, alive, children
from tests.support.tasks import wait_until

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
    wait_until(
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
    wait_until(lambda: not any(alive(pid) for pid in kids), 10, "every child gone")
    # The one start-up line, then daphne's access log (flushed as each child stops).
    lines = served.stdout.read_text().splitlines()
    assert lines[0] == served.match[0] and all('"GET /' in line for line in lines[1:]), lines
    assert "Traceback" not in served.stderr.read_text()


def test_a_hang_up_is_ignored_by_the_children_and_stops_the_supervisor_as_sigterm_does(served: Served):
    """A terminal's hang-up reaches the whole process group: the children keep
    serving until the supervisor, on its own SIGHUP, stops them gracefully."""
    kids = children(served.process.pid)
    for child in kids:
        os.kill(child, signal.SIGHUP)
    time.sleep(0.5)
    assert all(alive(pid) for pid in kids) and served.get() == 200
    served.process.send_signal(signal.SIGHUP)
    assert served.process.wait(timeout=40) == 0, served.stderr.read_text()
    wait_until(lambda: not any(alive(pid) for pid in kids), 10, "every child gone")
    assert "Traceback" not in served.stderr.read_text() and "exited with" not in served.stderr.read_text()


def test_a_killed_child_is_restarted_and_the_other_serves_meanwhile(served: Served):
    supervisor = served.process.pid
    originals = children(supervisor)
    for n, victim in enumerate(originals, 1):  # each original in turn: the other one answers meanwhile
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda victim=victim: not alive(victim), 5, "the killed child gone")
        assert served.get() == 200
        wait_until(lambda n=n: served.stderr.read_text().count("serving again") >= n, 20, "the new child serving")
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


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_children_of_a_killed_supervisor_die_with_it_even_stopped_and_a_new_one_serves(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A frozen child (SIGSTOP: it cannot act on SIGTERM) must not outlive a
    supervisor killed with SIGKILL and keep the port from the next one."""
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = Served(env, tmp_path / "first", processes=2)
    kids = children(first.process.pid)
    try:
        assert len(kids) == 2 and first.get() == 200
        os.kill(kids[0], signal.SIGSTOP)
        wait_until(lambda: state(kids[0]) == "T", 5, "the child stopped")
        first.process.kill()
        first.process.wait(timeout=10)
        wait_until(lambda: not any(alive(pid) for pid in kids), 5, "both children gone with their supervisor")
        second = Served(env, tmp_path / "second", processes=2, port=first.port)
        try:
            assert second.get() == 200
        finally:
            assert second.stop() == 0, second.stderr.read_text()
    finally:
        kill_all(kids)


# A server child left behind by a supervisor that is gone (as one of an Orbit
# before the parent-death signal was SIGKILL left it): `python -m orbit.serve
# --fd N` on the port, its supervisor's pid in its environment, that supervisor
# gone. The launcher binds as the supervisor does and exits at once.
LEFTOVER_LAUNCHER = """
import os, socket, subprocess, sys
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", int(sys.argv[1])))
sock.listen(16)
env = {**os.environ, "ORBIT_SERVE_SUPERVISOR": str(os.getpid())}
child = subprocess.Popen(
    [sys.executable, "-m", "orbit.serve", "--fd", str(sock.fileno()), "orbit.asgi:application"],
    env=env, pass_fds=(sock.fileno(),), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
print(child.pid, flush=True)
"""


def test_a_new_supervisor_reclaims_the_port_from_a_frozen_leftover_child(env: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    launched = subprocess.run(
        [sys.executable, "-c", LEFTOVER_LAUNCHER, str(port)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    leftover = int(launched.stdout)
    try:
        wait_until(lambda: _answers(port), 30, "the leftover child serving")
        os.kill(leftover, signal.SIGSTOP)
        wait_until(lambda: state(leftover) == "T", 5, "the leftover stopped")
        assert not _answers(port)  # it accepts and never answers
        served = Served(env, tmp_path, processes=2, port=port)
        try:
            assert served.get() == 200
            assert not alive(leftover)
            assert f"pid {leftover}" in served.stderr.read_text()  # the supervisor says whom it killed
        finally:
            assert served.stop() == 0, served.stderr.read_text()
    finally:
        kill_all([leftover])


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_port_held_by_another_program_still_fails_with_the_clear_message(env: dict[str, str]) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "manage.py", "serve", "-p", str(port), "--processes", "2"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1 and result.stdout == "", result
        assert result.stderr.splitlines()[-1] == (
            f"orbit serve: Listen failure: Couldn't listen on 127.0.0.1:{port}: [Errno 98] Address already in use."
        ), result.stderr
        assert time.monotonic() - started < 20  # refused at once, not after a reclaim's retries
        holder.settimeout(0.2)
        with pytest.raises(TimeoutError):
            holder.accept()  # untouched, still listening
