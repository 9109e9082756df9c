"""examples/ run as a user runs them: a subprocess against a live server, with a
credential bootstrapped for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from django.core.management import call_command

from tests.support.live import ROOT


def run_example(name: str, orbit_server: Any, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """examples/`name` with a fresh credential for `orbit_server`; `env` adds to its environment."""
    credentials = tmp_path / "credentials.json"
    call_command(
        "orbit_bootstrap",
        application="examples",
        namespace="default",
        environment="test",
        queue="initial",
        worker_access=True,
        output=str(credentials),
    )
    base = {"PATH": "/usr/bin:/bin", "ORBIT_URL": orbit_server.url, "ORBIT_CREDENTIALS_FILE": str(credentials)}
    return subprocess.run(
        [sys.executable, f"examples/{name}"],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
