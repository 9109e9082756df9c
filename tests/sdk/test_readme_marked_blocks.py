"""sdk/README.md's marked blocks that print (dependencies; blockers and keys) run as written
against a live server set up as `scripts/run` sets it up (the demo worker serving its queue),
and each prints what the comments of its print() lines say."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.readme import (
    like_scripts_run_fixture,  # noqa: F401 - fixture "like_scripts_run"
    python_blocks,
    run_block,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("mark", "script"),
    [("dependencies", "dependencies.py"), ("blockers and keys", "blockers_and_keys.py")],
)
def test_the_marked_block_prints_what_it_says(like_scripts_run: Path, mark: str, script: str) -> None:  # noqa: F811
    (code,) = [code for block_mark, code in python_blocks() if block_mark == mark]
    result = run_block(code, like_scripts_run, script)
    assert result.returncode == 0, f"{code}\n{result.stdout}{result.stderr}"
    # Each print's comment is its documented output.
    documented = [line.split("  # ", 1)[1] for line in code.splitlines() if line.lstrip().startswith("print(")]
    assert len(documented) >= 2
    assert result.stdout.splitlines() == documented
