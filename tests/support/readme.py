"""The Python blocks of sdk/README.md, as the README and typing tests read them, and the
working directory `scripts/run` would leave for them to run in."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import call_command

from tasks.models import WorkerIdentity
from tests.support.live import ROOT, LiveServer
from tests.support.tasks import wait_until

README = ROOT / "sdk" / "README.md"


BLOCK = re.compile(r"(?:<!-- readme-test: (?P<mark>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.DOTALL)


SIGNATURE = "signature of "


def python_blocks() -> list[tuple[str, str]]:
    return [(match["mark"] or "", match["code"]) for match in BLOCK.finditer(README.read_text())]


def bootstrap_demo(credentials: Path) -> None:
    """The credential scripts/run writes to .local/dev.credentials.json (its url from ORBIT_URL)."""
    call_command(
        "orbit_bootstrap",
        application="demo",
        namespace="default",
        environment="development",
        queue="demo",
        worker_access=True,
        output=str(credentials),
    )


@pytest.fixture(name="like_scripts_run")
def like_scripts_run_fixture(
    orbit_server: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """A working directory whose .local/dev.credentials.json is what scripts/run writes, for
    this live server, with the demo worker scripts/run starts serving its queue."""
    (tmp_path / ".local").mkdir()
    credentials = tmp_path / ".local" / "dev.credentials.json"
    monkeypatch.setenv("ORBIT_URL", orbit_server.url)  # the file's url, as scripts/run exports it
    bootstrap_demo(credentials)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ORBIT_CREDENTIALS_FILE": str(credentials)}
    demo = subprocess.Popen(
        [sys.executable, "examples/demo_worker.py"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # As a reader who runs scripts/run waits for its banner: the demo worker is connected
        # before a block asks about its queue (else a blocker says NO_WORKER).
        def connected() -> bool:
            assert demo.poll() is None, "the demo worker exited before it connected"
            return WorkerIdentity.objects.exists()

        wait_until(connected, 30, what="the demo worker to connect")
        yield tmp_path
    finally:
        demo.terminate()
        demo.wait(timeout=10)


def run_block(code: str, cwd: Path, name: str) -> subprocess.CompletedProcess[str]:
    script = cwd / name
    script.write_text(code)
    # No ORBIT_* variables: the blocks must find everything where they say they do.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return subprocess.run([sys.executable, name], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
