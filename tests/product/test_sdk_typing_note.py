"""sdk/README.md's "passes `mypy --strict`" gives the command that shows it in a checkout:
run exactly as written there, from the repository root, it passes."""

from __future__ import annotations

import os
import re
import subprocess

from tests.support.live import ROOT

COMMAND = re.compile(r"`(MYPYPATH=sdk [^`]*mypy --strict -p\s+orbit_sdk)`")


def test_the_sdk_readmes_mypy_command_passes():
    readme = (ROOT / "sdk" / "README.md").read_text()
    found = COMMAND.search(readme)
    assert found, "sdk/README.md no longer gives its mypy command"
    command = " ".join(found[1].split())  # the sentence wraps it over two lines
    # The cache only (tests/sdk/test_typing.py's): not part of the command a reader types.
    env = {**os.environ, "MYPY_CACHE_DIR": str(ROOT / ".local" / "mypy-cache")}
    result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
