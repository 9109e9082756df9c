"""sdk/README.md's Python blocks run exactly as written against a live server set up as
`scripts/run` sets it up: a credential bootstrapped into `.local/dev.credentials.json` (the
blocks run with the folder holding it as their working directory) and the demo worker."""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import orbit_sdk
from tests.support.readme import (
    SIGNATURE,
    like_scripts_run_fixture,  # noqa: F401 - fixture "like_scripts_run"
    python_blocks,
    run_block,
)

pytestmark = pytest.mark.django_db(transaction=True)

LONG_RUNNING = "runs until SIGTERM"


def runnable_blocks() -> list[str]:
    return [code for mark, code in python_blocks() if not mark]


def test_the_readme_has_the_blocks_this_test_expects():
    marks = [mark for mark, _ in python_blocks()]
    assert len(runnable_blocks()) == 4
    assert marks.count(LONG_RUNNING) == 1
    assert [mark for mark in marks if mark.startswith(SIGNATURE)] == [f"{SIGNATURE}orbit_sdk.Worker"]


def test_every_runnable_block_runs_as_written(like_scripts_run: Path):
    outputs = []
    for index, code in enumerate(runnable_blocks()):
        result = run_block(code, like_scripts_run, f"block_{index}.py")
        assert result.returncode == 0, f"block {index}:\n{code}\n{result.stdout}{result.stderr}"
        outputs.append(result.stdout.splitlines())
    quickstart, async_client, batch, errors = outputs
    (line,) = quickstart
    assert re.fullmatch(r"[0-9a-f]{32} SUCCEEDED \{'greeting': 'hello, Ada'\}", line), line
    assert async_client == ["demo WAITING CANCELLED"]
    for accepted in batch[:2]:
        _key, status, task_id = accepted.split()
        assert status == "201" and re.fullmatch("[0-9a-f]{32}", task_id), accepted
    assert batch[2].split()[1:3] == ["400", "INVALID_ARGUMENT"] and "priority" in batch[2]
    assert errors[0].startswith("submitted ")
    assert errors[1].startswith("NOT_FOUND 404 ") and errors[1].endswith(" 0:00:00")


def test_the_worker_process_block_serves_until_sigterm_then_stops_gracefully(like_scripts_run: Path):
    (code,) = [code for mark, code in python_blocks() if mark == LONG_RUNNING]
    script = like_scripts_run / "worker.py"
    script.write_text(code)
    process = subprocess.Popen(
        [sys.executable, "worker.py"],
        cwd=like_scripts_run,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        credentials = like_scripts_run / ".local" / "dev.credentials.json"
        with orbit_sdk.Client.from_credentials_file(credentials) as client:
            queue_id = json.loads(credentials.read_text())["queue_id"]
            request = orbit_sdk.SubmitTaskRequest(queue_id, "greet", "v1", "v1", {"name": "Linus"})
            task = client.submit_task(f"readme-{uuid.uuid4()}", request).task
            deadline = time.monotonic() + 30
            while task.state != "SUCCEEDED" and time.monotonic() < deadline:
                time.sleep(0.1)
                task = client.get_task(task.id)
            assert task.state == "SUCCEEDED" and task.output == {"greeting": "hello, Linus"}
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert stdout.splitlines() == ["worker stopped"]


def test_the_documented_worker_signature_is_the_real_one():
    (code,) = [code for mark, code in python_blocks() if mark == f"{SIGNATURE}orbit_sdk.Worker"]
    documented = ast.parse(code.replace("orbit_sdk.Worker(", "def documented(", 1).rstrip() + ": ...\n").body[0]
    assert isinstance(documented, ast.FunctionDef)
    arguments = documented.args
    positional = [arg.arg for arg in arguments.args]
    keyword = [arg.arg for arg in arguments.kwonlyargs]
    defaults = dict(zip(positional[len(positional) - len(arguments.defaults) :], arguments.defaults, strict=True))
    defaults.update({arg.arg: value for arg, value in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)})

    real = inspect.signature(orbit_sdk.Worker)
    assert positional == [
        name for name, p in real.parameters.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    assert keyword == [name for name, p in real.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    for name, value in defaults.items():
        assert value is not None and ast.literal_eval(value) == real.parameters[name].default, name
