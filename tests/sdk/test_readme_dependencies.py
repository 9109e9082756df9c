"""sdk/README.md's dependencies block runs as written against a live server set up as
`scripts/run` sets it up (the demo worker running its echo tasks), and prints what its comments say."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.readme import (
    like_scripts_run_fixture,  # noqa: F401 - fixture "like_scripts_run"
    python_blocks,
    run_block,
)

pytestmark = pytest.mark.django_db(transaction=True)

MARK = "dependencies"


def test_the_dependencies_block_prints_what_it_says(like_scripts_run: Path) -> None:  # noqa: F811
    (code,) = [code for mark, code in python_blocks() if mark == MARK]
    result = run_block(code, like_scripts_run, "dependencies.py")
    assert result.returncode == 0, f"{code}\n{result.stdout}{result.stderr}"
    # Each print's comment is its documented output.
    documented = [line.split("  # ", 1)[1] for line in code.splitlines() if line.lstrip().startswith("print(")]
    assert len(documented) >= 2
    assert result.stdout.splitlines() == documented
