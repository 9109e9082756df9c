"""The operational surface's edges: a malformed configuration value stops the
start in one line naming it (docs/decisions.md: "A malformed value stops the
start, naming it"; README, Production: "one line on stderr and exit status 1,
never a traceback"), and the supervisor listens on the port it was given or
on none. Run as an operator runs them: `manage.py serve` in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from server import supervisor
from tests.support.live import ROOT


def serve(**overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ORBIT_SECRET_KEY": "a-production-secret-for-the-tests", **overrides}
    return subprocess.run(
        [sys.executable, "manage.py", "serve", "--processes", "1", "-b", "127.0.0.1", "-p", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ORBIT_DB_THREADS", "abc"),
        ("ORBIT_DB_THREADS", "0"),
        ("ORBIT_DB_THREADS", "-3"),
        ("ORBIT_DB_THREADS", "\u00b2"),  # a digit to str.isdigit(), none to int()
        ("ORBIT_LOG_LEVEL", "LOUD"),
        # A switch mistyped must not silently mean on or off: "no" would sweep.
        ("ORBIT_MAINTENANCE", "no"),
        ("ORBIT_MAINTENANCE", "false"),
        ("ORBIT_DEBUG", "true"),
        ("ORBIT_TLS", "yes"),
    ],
)
def test_a_malformed_setting_stops_the_start_in_one_line_naming_it(name: str, value: str) -> None:
    result = serve(**{name: value})
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("orbit serve: ") and name in lines[0], lines[0]


@pytest.mark.parametrize("port", [65536, 70000, 99999])
def test_the_supervisor_refuses_a_port_out_of_range(port: int) -> None:
    """getaddrinfo wraps a port modulo 65536: 99999 listened on 34463 and
    65536 on an ephemeral port, announced as serving, where the single-process
    path refuses the same port ("port must be 0-65535")."""
    with pytest.raises(supervisor.ListenError, match=str(port)):
        sock = supervisor.listen("127.0.0.1", port)
        sock.close()
