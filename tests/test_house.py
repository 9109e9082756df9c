"""The house's arrows run down only: the shell (server/, console/) → the apps
(queues, tasks, plans, workers) → the foundation (orbit/), which imports no app;
and no verb imports the HTTP kit. Read from the source, function-local imports too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APPS = ("queues", "tasks", "plans", "workers")
SHELL = ("server", "console")
# The documented entry points deployments name (`orbit.asgi:application`,
# `python -m orbit.serve`, `DJANGO_SETTINGS_MODULE=orbit.settings`): each only
# re-exports the shell's module.
ENTRY_SHIMS = {"orbit/asgi.py": "server.asgi", "orbit/serve.py": "server.serve", "orbit/settings.py": "server.settings"}
# The verbs: every permit and counter change, and what they decide with.
VERBS = ["tasks/actions", "queues/actions.py", "queues/locks.py", "plans/actions.py", "orbit/applications.py"]


def imports_of(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def sources(*places: str) -> list[Path]:
    paths: list[Path] = []
    for place in places:
        path = ROOT / place
        paths.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return [path for path in paths if "migrations" not in path.parts]


def reaching(paths: list[Path], packages: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in paths
        for line, module in imports_of(path)
        if module.split(".")[0] in packages
    ]


def test_the_foundation_imports_no_app_and_no_shell():
    foundation = [path for path in sources("orbit") if str(path.relative_to(ROOT)) not in ENTRY_SHIMS]
    assert len(foundation) > 30
    assert reaching(foundation, APPS + SHELL) == []


def test_the_entry_shims_only_re_export_the_shell():
    for shim, target in ENTRY_SHIMS.items():
        modules = {module for _, module in imports_of(ROOT / shim)}
        assert {module for module in modules if module.split(".")[0] != "__future__"} <= {
            target,
            *(f"{target}.{name}" for name in ("*", "application", "main")),
        }, (shim, modules)


def test_the_apps_import_neither_the_shell_nor_the_console():
    assert reaching(sources(*APPS), SHELL) == []


def test_no_verb_imports_the_http_kit():
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sources(*VERBS)
        for line, module in imports_of(path)
        if module == "orbit.api" or module.startswith("orbit.api.") or module.startswith("rest_framework")
    ]
    assert wrong == []
