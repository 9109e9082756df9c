"""What the server distribution declares, checked without building it (the
slow, built-and-installed check is test_install.py)."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from django.conf import settings

from server.cli import split_addr
from tests.support.live import ROOT

TEST_TOOLS = {"pytest", "pytest-django", "pytest-timeout", "pytest-asyncio", "factory-boy", "ruff", "schemathesis"}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def name_of(requirement: str) -> str:
    return re.split(r"[=<>;\[ ]", requirement, maxsplit=1)[0].lower()


def normalized(requirement: str) -> str:
    return requirement.replace(" ", "").replace("'", '"')


def test_the_distribution_pins_exactly_the_runtime_requirements():
    runtime = requirement_lines(ROOT / "requirements.txt")
    assert sorted(map(normalized, pyproject()["project"]["dependencies"])) == sorted(map(normalized, runtime))
    assert not {name_of(line) for line in runtime} & TEST_TOOLS


def test_the_dev_requirements_add_the_test_tools_to_the_runtime_ones():
    dev = requirement_lines(ROOT / "requirements-dev.txt")
    assert dev[0] == "-r requirements.txt"
    assert {"pytest", "pytest-django", "pytest-timeout", "pytest-asyncio", "factory-boy", "ruff"} <= {
        name_of(line) for line in dev[1:]
    }
    setup = (ROOT / "scripts" / "setup").read_text()
    assert "-r requirements-dev.txt" in setup and "requirements-dev.txt" in setup.split("sha256sum")[0]


def test_every_package_of_the_installed_apps_is_in_the_distribution():
    include = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    local_apps = [app for app in settings.INSTALLED_APPS if (ROOT / app / "__init__.py").is_file()]
    assert set(local_apps) == {"orbit", "queues", "tasks", "workers", "plans", "server", "console"}
    for app in local_apps:
        for init in (ROOT / app).rglob("__init__.py"):
            package = ".".join(init.parent.relative_to(ROOT).parts)
            assert any(fnmatch.fnmatchcase(package, pattern) for pattern in include), package
    for stray in ("tests", "bench", "examples", "scripts", "sdk", "orbit_sdk"):
        assert not any(fnmatch.fnmatchcase(stray, pattern) for pattern in include), stray
    assert pyproject()["project"]["scripts"] == {"orbit": "server.cli:main"}


def test_the_serve_address_comes_from_orbit_http_addr():
    assert split_addr("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert split_addr("0.0.0.0:9000") == ("0.0.0.0", 9000)
    assert split_addr("[::1]:8081") == ("::1", 8081)


def test_commands_make_the_default_sqlite_directory(tmp_path, monkeypatch):
    # Installed, the default SQLite file is ./.local/orbit.sqlite3: `orbit migrate` must be able to create it.
    from server.cli import make_local_dir

    monkeypatch.delenv("ORBIT_SQLITE_PATH", raising=False)
    make_local_dir("orbit.db.mysql", tmp_path / "not-for-mysql")
    assert not (tmp_path / "not-for-mysql").exists()
    make_local_dir("django.db.backends.sqlite3", tmp_path / ".local")
    assert (tmp_path / ".local").is_dir() and (tmp_path / ".local").stat().st_mode & 0o777 == 0o700
