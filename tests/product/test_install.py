"""The two distributions, installed as a new user would: from a fresh copy of
the repo (its HEAD, via git archive), each into a fresh virtualenv of its own.

- `pip install .` gives an `orbit` command that migrates a new MariaDB
  database, bootstraps a credential and serves it: /readyz answers 200.
- `pip install ./sdk`, where `import django` fails, gives a Client that
  submits a task and a Worker that completes it, against that server.

Slow (two virtualenvs from PyPI, one build of mysqlclient unless pip's wheel
cache has it): one venv per distribution for the module, shared by its tests."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import time
import tomllib
import uuid
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.probes import database_settings, open_connection
from tests.support.live import ROOT, free_port

pytestmark = [pytest.mark.mysql_only, pytest.mark.django_db]

METRICS_TOKEN = "install-test-metrics-token"


def run(command: list[str | Path], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result


def pip_env() -> dict[str, str]:
    """pip's own configuration (index, cache) as the user has it; nothing of this test process's Python."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def make_venv(path: Path, *requirements: str | Path) -> Path:
    run([sys.executable, "-m", "venv", path])
    run([path / "bin" / "pip", "install", "-q", *requirements], env=pip_env())
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repo's HEAD, as a clone would check it out (no .venv, no .local, no build output)."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD"], capture_output=True, check=True)
    target = tmp_path_factory.mktemp("clone")
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as bundle:
        bundle.extractall(target, filter="data")
    return target


@pytest.fixture(scope="module")
def venvs(source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both virtualenvs, each made as before, the two at once (each waits on pip most of its time)."""
    root = tmp_path_factory.mktemp("venvs")
    with ThreadPoolExecutor(2) as pool:
        server = pool.submit(make_venv, root / "server", source)
        sdk = pool.submit(make_venv, root / "sdk", source / "sdk")
        return {"server": server.result(), "sdk": sdk.result()}


@pytest.fixture(scope="module")
def server_venv(venvs: dict[str, Path]) -> Path:
    return venvs["server"]


@pytest.fixture(scope="module")
def sdk_venv(venvs: dict[str, Path]) -> Path:
    return venvs["sdk"]


@pytest.fixture(scope="module")
def database_dsn(django_db_setup: None, django_db_blocker: Any) -> Iterator[str]:
    """A new, empty MariaDB database on the test server, dropped afterwards."""
    with django_db_blocker.unblock():
        base = database_settings()
        name = f"orbit_install_{uuid.uuid4().hex[:12]}"
        admin = open_connection(base, 5)
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
        try:
            yield f"mysql://{base['USER']}:{base['PASSWORD']}@{base['HOST']}:{base['PORT']}/{name}"
        finally:
            with admin.cursor() as cursor:
                cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
            admin.close()


@dataclass
class InstalledServer:
    url: str
    credentials: Path
    start_line: str
    env: dict[str, str]
    bin: Path


@pytest.fixture(scope="module")
def installed_server(
    server_venv: Path, database_dsn: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InstalledServer]:
    """`orbit migrate`, `orbit orbit_bootstrap`, `orbit serve`, from a directory
    that is not the repo: everything comes from the installed distribution."""
    workdir = tmp_path_factory.mktemp("site")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "PATH": f"{server_venv / 'bin'}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", str(workdir)),
        "LANG": "C.UTF-8",
        "ORBIT_MYSQL_DSN": database_dsn,
        "ORBIT_SECRET_KEY": "install-test-secret-" + uuid.uuid4().hex,
        "ORBIT_URL": url,
        "ORBIT_METRICS_TOKEN": METRICS_TOKEN,
    }
    orbit = server_venv / "bin" / "orbit"
    run([orbit, "migrate", "-v0"], cwd=workdir, env=env)
    credentials = workdir / "worker.credentials.json"
    run(
        [
            orbit,
            "orbit_bootstrap",
            "--application", "install-test",
            "--namespace", "default",
            "--environment", "production",
            "--queue", "jobs",
            "--worker-access",
            "--output", credentials,
        ],
        cwd=workdir,
        env=env,
    )  # fmt: skip
    stdout, stderr = workdir / "serve.stdout", workdir / "serve.stderr"
    with stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen(
            [str(orbit), "serve", "-b", "127.0.0.1", "-p", str(port)], cwd=workdir, env=env, stdout=out, stderr=err
        )
    try:
        deadline = time.monotonic() + 60
        while not stdout.read_text().endswith("\n"):
            assert process.poll() is None, stderr.read_text()
            assert time.monotonic() < deadline, "orbit serve printed no start-up line"
            time.sleep(0.05)
        yield InstalledServer(url, credentials, stdout.read_text().splitlines()[0], env, server_venv / "bin")
    finally:
        process.terminate()
        process.wait(timeout=20)
    assert stderr.read_text() == ""  # a production secret key: no warning, and nothing else


def site_packages(venv: Path) -> Path:
    (path,) = (venv / "lib").glob("python3*/site-packages")
    return path


def test_pip_install_dot_installs_the_apps_with_runtime_dependencies_only(server_venv: Path):
    listed = run([server_venv / "bin" / "pip", "list", "--format=json"], env=pip_env()).stdout
    installed = {package["name"].lower() for package in json.loads(listed)}
    assert {"django", "djangorestframework", "channels", "daphne", "mysqlclient", "orbit"} <= installed
    for test_tool in ("pytest", "pytest-django", "pytest-asyncio", "pytest-timeout", "factory-boy", "ruff", "httpx"):
        assert test_tool not in installed, test_tool
    packages = site_packages(server_venv)
    for app in ("orbit", "queues", "tasks", "workers", "plans"):
        assert (packages / app / "migrations" / "0001_initial.py").is_file(), app
    assert (packages / "server" / "management" / "commands" / "orbit_bootstrap.py").is_file()
    assert (packages / "tasks" / "management" / "commands" / "orbit_check.py").is_file()
    for stray in ("tests", "bench", "examples", "scripts", "sdk", "orbit_sdk"):
        assert not (packages / stray).exists(), stray


def test_the_installed_server_migrates_bootstraps_and_answers_readyz(installed_server: InstalledServer):
    pid = r"\d+"
    assert re.fullmatch(
        rf'orbit: serving on {re.escape(installed_server.url)}; database mysql "orbit_install_[0-9a-f]+" '
        rf"at 127\.0\.0\.1:3306; processes \d+; pid {pid}",
        installed_server.start_line,
    ), installed_server.start_line
    ready = httpx.get(f"{installed_server.url}/readyz", timeout=5)
    assert ready.status_code == 200 and ready.json()["data"] == {"status": "ready"}, ready.text
    assert httpx.get(f"{installed_server.url}/healthz", timeout=5).status_code == 200
    credentials = json.loads(installed_server.credentials.read_text())
    assert credentials["url"] == installed_server.url and credentials["token"].startswith("orb_")
    check = run([installed_server.bin / "orbit", "orbit_check"], env=installed_server.env, cwd=installed_server.bin)
    assert "ok" in check.stdout


SDK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time, uuid
    from orbit_sdk import Client, SubmitTaskRequest, Worker

    assert "django" not in sys.modules
    credentials = json.load(open(os.environ["ORBIT_CREDENTIALS_FILE"]))
    url, token, queue_id = credentials["url"], credentials["token"], credentials["queue_id"]

    def double(execution):
        return {"doubled": execution.payload["n"] * 2}

    worker = Worker(url, token, [queue_id], {("double", "v1"): double}, capacity=2)
    worker.start()
    with Client(url, token) as client:
        request = SubmitTaskRequest(queue_id, "double", "v1", "v1", {"n": 21})
        task = client.submit_task("install-test-" + uuid.uuid4().hex, request).task
        deadline = time.monotonic() + 30
        while True:
            current = client.get_task(task.id)
            if current.state not in ("WAITING", "LEASED", "RUNNING") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    worker.stop(timeout=10)
    worker.join(timeout=15)
    print(json.dumps({"state": current.state, "output": current.output, "django": "django" in sys.modules}))
    """
)


def test_the_sdk_alone_submits_a_task_and_its_worker_completes_it(
    sdk_venv: Path, installed_server: InstalledServer, tmp_path: Path
):
    python = sdk_venv / "bin" / "python"
    no_django = subprocess.run([python, "-c", "import django"], capture_output=True, text=True, cwd=tmp_path)
    assert no_django.returncode != 0 and "ModuleNotFoundError" in no_django.stderr
    listed = run([sdk_venv / "bin" / "pip", "list", "--format=json"], env=pip_env()).stdout
    installed = {package["name"].lower() for package in json.loads(listed)}
    assert "orbit-sdk" in installed and {"httpx", "websockets"} <= installed
    env = {
        "PATH": f"{sdk_venv / 'bin'}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "ORBIT_CREDENTIALS_FILE": str(installed_server.credentials),
    }
    result = run([python, "-c", SDK_SCRIPT], cwd=tmp_path, env=env, timeout=90)
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"state": "SUCCEEDED", "output": {"doubled": 42}, "django": False}, result.stderr


def test_both_distributions_build_versioned_wheels(server_venv: Path, source: Path, tmp_path: Path):
    pip = server_venv / "bin" / "pip"
    for project in (source, source / "sdk"):
        run([pip, "wheel", "-q", "--no-deps", "-w", tmp_path, project], env=pip_env(), cwd=tmp_path)
    wheels = sorted(path.name for path in tmp_path.glob("*.whl"))
    assert wheels == ["orbit-0.1.0-py3-none-any.whl", "orbit_sdk-0.1.0-py3-none-any.whl"], wheels
    with zipfile.ZipFile(tmp_path / "orbit-0.1.0-py3-none-any.whl") as wheel:
        tops = {name.split("/")[0] for name in wheel.namelist()}
        entry_points = wheel.read("orbit-0.1.0.dist-info/entry_points.txt").decode()
    assert tops == {"orbit", "queues", "tasks", "workers", "plans", "server", "console", "orbit-0.1.0.dist-info"}, tops
    assert "orbit = server.cli:main" in entry_points
    with zipfile.ZipFile(tmp_path / "orbit_sdk-0.1.0-py3-none-any.whl") as wheel:
        names = wheel.namelist()
    assert "orbit_sdk/py.typed" in names and {name.split("/")[0] for name in names} == {
        "orbit_sdk",
        "orbit_sdk-0.1.0.dist-info",
    }


def test_the_sdk_declares_a_websockets_with_what_it_calls():
    """The worker reads ClientConnection.close_code (websockets.asyncio), which websockets
    added in 14.1; an older one ended the worker on the server's first close."""
    dependencies = tomllib.loads((ROOT / "sdk" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "websockets>=14.1" in dependencies, dependencies
