"""README.md's snippets run as a newcomer runs them, in order, against a live server set up
the way `scripts/run` sets it up: a credential bootstrapped into `.local/dev.credentials.json`
and the demo worker serving its queue. The `sh` blocks run in one bash session (a second
terminal), the `python` blocks as saved scripts, all from a copy of the repository root whose
`.local/` is the test's own, so a developer's credentials file is never touched.

Every fenced block is either run or marked, on the line right before it, with
`<!-- not run: REASON -->`: a new snippet cannot go untested by accident."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import pytest

from orbit import cells
from tests.support.live import LIVE_METRICS_TOKEN, ROOT, LiveServer, server_env
from tests.support.readme import bootstrap_demo

pytestmark = pytest.mark.django_db(transaction=True)

README = ROOT / "README.md"
HEX = re.compile("[0-9a-f]{32}")
FENCE = re.compile(r"^```(?P<lang>[^\n`]*)\n(?P<code>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>[^>]*?\S[^>]*?) -->")
ANSWER_ABOVE = "the answer of the block above"
RUNNABLE = ("sh", "python")
FIRST_BLOCK = (
    "scripts/run     # Orbit on embedded SQLite + a demo worker, no setup needed\n"
    "scripts/test    # the test suite on MariaDB (starts it, throwaway database)\n"
)


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    code: str
    not_run: str | None  # the reason, for a block marked not run

    @property
    def runs(self) -> bool:
        return self.not_run is None


def readme_blocks() -> list[Block]:
    text = README.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = NOT_RUN.fullmatch(before.strip())
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(line, match["lang"].strip(), match["code"], mark["reason"] if mark else None))
    return blocks


def documents(output: str) -> list[Any]:
    """Every JSON value printed, in order (curl's answers end without a newline)."""
    decoder = json.JSONDecoder()
    values, index = [], 0
    while True:
        while index < len(output) and output[index].isspace():
            index += 1
        if index == len(output):
            return values
        value, index = decoder.raw_decode(output, index)
        values.append(value)


def data(output: str) -> Any:
    (answer,) = documents(output)
    assert set(answer) == {"request_id", "data"}, answer
    return answer["data"]


def like(documented: Any, actual: Any) -> bool:
    """The documented example, where "…" stands for any value."""
    if documented == "…":
        return True
    if isinstance(documented, dict):
        return (
            isinstance(actual, dict)
            and set(documented) == set(actual)
            and all(like(value, actual[name]) for name, value in documented.items())
        )
    return documented == actual and type(documented) is type(actual)


class Shell:
    """One bash session, as a reader's terminal: variables and functions carry over."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        self.numbers = count()
        self.stderr = open(cwd / ".local" / "readme-shell.stderr", "w+")  # noqa: SIM115
        self.process = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)

    def run(self, code: str, timeout: float = 60) -> tuple[int, str, str]:
        number = next(self.numbers)
        script = self.cwd / ".local" / f"readme-block-{number}.sh"
        script.write_text(code)
        done = f"@@readme-block-{number}-done@@"
        errors_from = self.stderr.tell()
        assert self.process.stdin is not None
        # The block's commands read no terminal: stdin is the session's own command stream.
        self.process.stdin.write(f"source {script} </dev/null\nprintf '\\n{done} %s\\n' \"$?\"\n")
        self.process.stdin.flush()
        lines, deadline = [], time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"block still running after {timeout} s:\n{code}\n{''.join(lines)}") from None
            if line.startswith(done):
                status = int(line.split()[1])
                break
            lines.append(line)
        output = "".join(lines)
        output = output[:-1] if output.endswith("\n") else output  # the newline before the mark
        self.stderr.seek(errors_from)
        errors = self.stderr.read()
        return status, output, errors

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.stderr.close()


@dataclass
class Checkout:
    """A copy of the repository root (links to the real entries) with a `.local/` of its own."""

    root: Path
    credentials: Path
    demo_line: str


@pytest.fixture
def like_scripts_run(orbit_server: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Checkout]:
    root = tmp_path / "orbit"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name != ".local":
            (root / entry.name).symlink_to(entry)
    (root / ".local").mkdir(mode=0o700)
    credentials = root / ".local" / "dev.credentials.json"
    monkeypatch.setenv("ORBIT_URL", orbit_server.url)  # the file's url, as scripts/run exports it
    bootstrap_demo(credentials)
    demo = subprocess.Popen(
        [sys.executable, "examples/demo_worker.py"],
        cwd=ROOT,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ORBIT_CREDENTIALS_FILE": str(credentials)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    # A reader starts typing once scripts/run's demo worker has printed its task.
    first: queue.Queue[str] = queue.Queue()
    assert demo.stdout is not None
    threading.Thread(target=lambda: first.put(demo.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
    try:
        demo_line = first.get(timeout=30)
        assert re.fullmatch(r"demo worker: task [0-9a-f]{32} SUCCEEDED output=.*\n", demo_line), demo_line
        yield Checkout(root, credentials, demo_line)
    finally:
        demo.terminate()
        demo.wait(timeout=10)


def reader_env() -> dict[str, str]:
    """A reader's shell: no ORBIT_* of the test process, the server's database selection (as a
    shell beside scripts/run has: its defaults, or the ORBIT_MYSQL_DSN, and ORBIT_CELLS, given to both), and the
    metrics token the server was started with (the README's metrics section sets it so)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("ORBIT_", "DJANGO_"))}
    server = server_env()
    for name in ("ORBIT_MYSQL_DSN", "ORBIT_CELLS", "ORBIT_SQLITE_PATH"):
        if name in server:
            env[name] = server[name]
    env["ORBIT_METRICS_TOKEN"] = server.get("ORBIT_METRICS_TOKEN", LIVE_METRICS_TOKEN)
    return env


def run_python(code: str, cwd: Path, name: str) -> tuple[int, str, str]:
    (cwd / name).write_text(code)
    # No ORBIT_* variables: the blocks find everything where they say they do.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    result = subprocess.run([sys.executable, name], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout, result.stderr


def python_file_name(block: Block, index: int) -> str:
    """The name the text before the block tells the reader to save it as, if any."""
    text = README.read_text().splitlines()
    before = " ".join(text[max(0, block.line - 12) : block.line - 1])
    named = re.findall(r"Save this as `([\w.]+\.py)`", before)
    return named[-1] if named else f"readme_block_{index}.py"


def test_every_block_is_run_or_marked_not_run():
    blocks = readme_blocks()
    assert blocks, "no fenced blocks found"
    assert blocks[0].code == FIRST_BLOCK and blocks[0].lang == "sh", "the README opens with the two commands"
    assert README.read_text().split("```", 1)[0].count("\n#") == 0, "nothing but the title before the two commands"
    unmarked = [f"line {b.line}: ```{b.lang}" for b in blocks if b.runs and b.lang not in RUNNABLE]
    assert not unmarked, f"mark these <!-- not run: REASON --> or make them sh/python blocks that run: {unmarked}"
    # Each runnable block has its checks in test_the_readme_runs_as_written: a new one needs its own.
    assert [b.lang for b in blocks if b.runs] == EXPECTED_RUNNABLE, "a block was added or removed: check it below"


EXPECTED_RUNNABLE = ["sh"] * 6 + ["python"] * 2 + ["sh"] * 11


def test_the_readme_runs_as_written(like_scripts_run: Checkout, orbit_server: LiveServer):
    root = like_scripts_run.root
    blocks = readme_blocks()
    shell = Shell(root, reader_env())
    outputs: list[str] = []
    try:
        for index, block in enumerate(blocks):
            if block.not_run is not None:
                if block.not_run.startswith(ANSWER_ABOVE):
                    documented = json.loads(block.code)
                    (actual,) = documents(outputs[-1])
                    assert like(documented, actual), f"line {block.line}: documented\n{block.code}\nactual\n{actual}"
                continue
            if block.lang == "sh":
                status, output, errors = shell.run(block.code)
            else:
                status, output, errors = run_python(block.code, root, python_file_name(block, index))
            assert status == 0, f"line {block.line} exited {status}:\n{block.code}\n{output}\n{errors}"
            outputs.append(output.rstrip("\n"))
    finally:
        shell.close()
    assert len(outputs) == len(EXPECTED_RUNNABLE)
    (
        first,
        create_hello,
        hello_again,
        submitted,
        read_back,
        attempts,
        sdk,
        dependencies,
        mint,
        _seed_queue,  # compared with the documented answer above
        configure_retire,
        application,
        plan,
        events,
        key_policy,
        examples,
        probes,
        metrics,
        check,
    ) = outputs
    credentials = json.loads(like_scripts_run.credentials.read_text())

    # Your first task, with curl.
    assert first == f"{orbit_server.url} {credentials['queue_id']}"
    hello = data(create_hello)
    assert hello["deduplicated"] is False and hello["queue"]["name"] == "hello"
    assert hello["queue"]["max_concurrency"] == 2 and hello["queue"]["rate_per_second"] == 10
    assert hello["queue"]["max_unfinished_tasks"] == 100000 and hello["queue"]["revision"] == "1"
    assert hello_again == hello["queue"]["id"]
    accepted = data(submitted)
    assert accepted["deduplicated"] is False
    task = accepted["task"]
    assert task["state"] == "WAITING" and task["attempts"] == 0 and task["max_attempts"] == 3
    assert task["queue_id"] == credentials["queue_id"] and task["handler"] == "echo"
    done = data(read_back)
    assert done["id"] == task["id"] and done["state"] == "SUCCEEDED" and done["attempts"] == 1
    assert done["output"] == {"echo": {"hi": 1}, "attempt": 1}
    (attempt,) = data(attempts)["items"]
    assert attempt["state"] == "SUCCEEDED" and attempt["epoch"] == 1 and attempt["number"] == 1
    assert attempt["worker_id"] and attempt["started_at"] and attempt["lease_expires_at"]

    # Your first task, with the SDK.
    assert sdk.splitlines() == ["SUCCEEDED {'resized': 42}"]

    # Tasks that wait for tasks: the join is BLOCKED at submit, then runs after its parts.
    assert dependencies.splitlines() == ["BLOCKED", "SUCCEEDED ['SUCCEEDED', 'SUCCEEDED', 'SUCCEEDED']"]

    # HTTP API: the development credential may not manage plans or the application (so the
    # README has the reader mint one that may), the minted one may.
    dev = {"Authorization": f"Bearer {credentials['token']}"}
    for path in ("/v1/plans", f"/v1/applications/{credentials['application_id']}"):
        refused = httpx.get(orbit_server.url + path, headers=dev)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "PERMISSION_DENIED", path
    assert re.fullmatch(r"wrote \.local/admin\.credentials\.json \(credential [0-9a-f]{32}\)", mint), mint
    admin = json.loads((root / ".local" / "admin.credentials.json").read_text())
    assert admin["url"] == orbit_server.url and admin["namespace_id"] == credentials["namespace_id"]
    assert {"plans:manage", "applications:manage", "queues:manage", "tasks:read"} <= set(admin["scopes"])
    paused, retired = (answer["data"]["queue"] for answer in documents(configure_retire))
    assert paused["id"] == hello["queue"]["id"] and paused["paused"] is True and paused["revision"] == "2"
    assert retired["revision"] == "3" and retired.get("retired_at")
    quotas = data(application)
    assert quotas["id"] == credentials["application_id"] and quotas["name"] == "demo"
    assert quotas["max_active_attempts"] == 100000 and quotas["max_unfinished_tasks"] == 10000000
    assert {"active_attempts", "unfinished_tasks", "revision"} <= set(quotas)
    created = data(plan)
    assert created["deduplicated"] is False and created["plan"]["name"] == "nightly"
    assert created["plan"]["state"] == "ACTIVE" and created["plan"]["version"] == 1
    assert created["plan"]["revision"] == "1" and created["plan"]["next_fire_at"].endswith(":30:00Z")
    first_page, second_page = (answer["data"] for answer in documents(events))
    assert [item["cursor"] for item in first_page["items"]] == ["1", "2"] and first_page["next_cursor"] == "2"
    assert [item["type"] for item in first_page["items"]] == ["queue.created", "task.state_changed"]
    assert first_page["items"][1]["data"]["state"] == "WAITING"
    assert [item["cursor"] for item in second_page["items"]] == ["3", "4"] and second_page["next_cursor"] == "4"
    policy = data(key_policy)["policy"]
    assert policy["match"] == {"prefix": "customer/"} and policy["capacity"] == 5 and policy["revision"] == "1"
    assert policy["rate"] == {"starts": 10, "per_seconds": 1, "burst": 5}
    assert {"keys:manage"} <= set(admin["scopes"]) and "keys:manage" in credentials["scopes"]

    # Examples: the seeds' lines.
    lines = examples.splitlines()
    assert len(lines) == 10, examples
    assert lines[0] == "backpressure=QUEUE_FULL http=429"
    assert lines[1] == "duplicate=true rejected_request_retried=true"
    for line in lines[2:4]:
        assert re.fullmatch(r"task=[0-9a-f]{32} state=SUCCEEDED attempts=1", line), line
    assert lines[4] == "unfinished=0 rate_per_second=1 worker_drained=true"
    assert lines[5:] == [
        "queues=2 completed=2 tokens_increasing=true",
        "resource_writes=2 stale_write_rejected=true worker_drained=true",
        "submitted=22 blocked=21 split_dependents=20",
        "parts=20 state=SUCCEEDED sum=500000500000 expected=500000500000",
        "worker_drained=true",
    ]

    # Production: probes, metrics, orbit_check.
    health, ready = documents(probes)
    # On cells (ORBIT_TEST_CELLS=1), /readyz also gives each cell's state, as Cells says.
    in_cells = {"cells": dict.fromkeys(cells.names(), "ready")} if cells.configured() else {}
    assert health["data"] == {"status": "ok"} and ready["data"] == {"status": "ready", **in_cells}
    *gauges, tenant_status = metrics.splitlines()
    assert tenant_status == "403"
    labels = 'application="demo",environment="development",namespace="default",queue="demo"'
    assert f"orbit_queue_max_concurrency{{{labels}}} 8.0" in gauges, gauges
    assert f'orbit_queue_tasks{{{labels},state="WAITING"}} 0.0' in gauges, gauges
    where = f" in cells {', '.join(cells.names())}" if cells.configured() else ""
    assert check == f"orbit_check: ok (counters, permits, keys and tokens agree with the rows){where}"


def test_the_python_blocks_pass_mypy_strict(tmp_path: Path):
    sdk = ROOT / "sdk"
    names = []
    for index, block in enumerate(readme_blocks()):
        if block.runs and block.lang == "python":
            name = f"readme_block_{index}.py"
            (tmp_path / name).write_text(block.code)
            names.append(name)
    assert names
    # The editable install is an import hook mypy cannot follow: point it at the source.
    env = {**os.environ, "MYPYPATH": str(sdk), "MYPY_CACHE_DIR": str(ROOT / ".local" / "mypy-cache")}
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--config-file=", *names],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
