"""`orbit serve --processes N` started as a newcomer starts it (`manage.py serve`),
and the process tree read from /proc: shared by the supervisor and metrics tests."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.live import ROOT, free_port
from tests.support.tasks import wait_until

START_LINE = re.compile(r"orbit: serving on http://127\.0\.0\.1:(\d+); database [^;]+; processes (\d+); pid (\d+)")
SECRET = {"ORBIT_SECRET_KEY": "a-production-secret-for-the-tests"}


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or reaped between open and read
        return False
    return state != "Z"


class Served:
    def __init__(self, env: dict[str, str], tmp_path: Path, processes: int = 2, port: int | None = None) -> None:
        self.port = free_port() if port is None else port
        self.stdout, self.stderr = tmp_path / "stdout", tmp_path / "stderr"
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "manage.py", "serve", "-p", str(self.port), "--processes", str(processes)],
                cwd=ROOT,
                env={**env, "ORBIT_HTTP_ADDR": "127.0.0.1:8080"},
                stdout=out,
                stderr=err,
            )
        line = wait_until(self.start_line, 30, "the start-up line")
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
