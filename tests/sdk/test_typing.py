"""The SDK passes `mypy --strict` (its [tool.mypy] in sdk/pyproject.toml), and its types say
what the clients return: a value from Client, a coroutine of that value from AsyncClient."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

SDK = Path(__file__).resolve().parents[2] / "sdk"


def mypy(*args: str, cwd: Path = SDK) -> subprocess.CompletedProcess[str]:
    # The editable install is an import hook mypy cannot follow: point it at the source.
    # One cache for every run here (typeshed is most of the work); .local/ is not committed.
    env = {**os.environ, "MYPYPATH": str(SDK), "MYPY_CACHE_DIR": str(SDK.parent / ".local" / "mypy-cache")}
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_sdk_passes_mypy_strict():
    result = mypy()  # files and strictness from sdk/pyproject.toml
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


def test_callers_see_the_verbs_types(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        textwrap.dedent(
            """
            import orbit_sdk

            async def use(client: orbit_sdk.Client, aclient: orbit_sdk.AsyncClient) -> None:
                reveal_type(client.get_task("t"))
                reveal_type(await aclient.get_task("t"))
                reveal_type(aclient.submit_tasks({"k": orbit_sdk.SubmitTaskRequest("q", "h", "v1", "v1", {})}))
                client.get_task(42)

            def resize(execution: orbit_sdk.Execution) -> dict[str, int]:
                return {"resized": 1}

            # Handler tables built before the worker are typed by the keys they hold.
            by_version = {("image.resize", "v1"): resize}
            orbit_sdk.Worker("http://127.0.0.1:8080", "orb_x_y", ["q"], by_version)
            any_version = {"image.resize": resize}
            orbit_sdk.Worker.from_credentials_file(["q"], any_version, path="c.json")
            """
        )
    )
    result = mypy("--strict", "--config-file=", str(sample), cwd=tmp_path)
    out = result.stdout
    assert 'sample.py:5: note: Revealed type is "orbit_sdk._models.Task"' in out, out
    assert 'sample.py:6: note: Revealed type is "orbit_sdk._models.Task"' in out, out
    assert 'Revealed type is "typing.Coroutine[Any, Any, list[orbit_sdk._models.BatchItemResult]]"' in out, out
    assert 'sample.py:8: error: Argument 1 has incompatible type "int"; expected "str"' in out, out
    # the handler tables built first pass: no error after line 8
    assert not [line for line in out.splitlines() if re.match(r"sample\.py:(9|\d\d+): error", line)], out


def test_the_readme_blocks_pass_mypy_strict(tmp_path):
    """What sdk/README.md shows exists, with the types it is used with (run: tests/sdk/test_readme.py)."""
    from tests.support.readme import SIGNATURE, python_blocks

    names = []
    for index, (mark, code) in enumerate(python_blocks()):
        if not mark.startswith(SIGNATURE):
            (tmp_path / f"block_{index}.py").write_text(code)
            names.append(f"block_{index}.py")
    result = mypy("--strict", "--config-file=", *names, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
