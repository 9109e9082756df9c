"""The tests' own layout: helpers the tests share live in tests/support/, and
no test module imports another test module (only tests.support and conftest
modules), so a test file can be read, moved or deleted on its own."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# Helper modules of tests/fencing (another change is under way there): to move
# to tests/support/ with it. Nothing may join this set.
NOT_YET_MOVED = frozenset({"tests.fencing.dbs", "tests.fencing.procs", "tests.fencing.worker_proc"})


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports (function-local imports too), relative ones resolved."""
    package = module_of(path).rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # `from tests.x import y` may name a module y
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names if module.startswith("tests"))
    return found


def allowed(module: str) -> bool:
    parts = module.split(".")
    if parts[0] != "tests" or len(parts) == 1:
        return True
    if parts[1] == "support" or parts[-1] == "conftest" or module in NOT_YET_MOVED:
        return True
    # `from tests.support import x` / `from tests.conftest import name`: the module part decides
    return parts[-2] in ("support", "conftest") if len(parts) > 2 else False


def is_module(module: str) -> bool:
    base = TESTS.parent.joinpath(*module.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def test_no_test_module_imports_another_test_module():
    checked = sorted(TESTS.rglob("test_*.py")) + sorted((TESTS / "support").rglob("*.py"))
    assert len(checked) > 50
    wrong = [
        f"{path.relative_to(TESTS.parent)}:{line} imports {module}"
        for path in checked
        for line, module in imported_modules(path)
        if not allowed(module) and is_module(module)
    ]
    assert wrong == [], "\n".join(["move shared helpers to tests/support/:", *wrong])


def test_shared_helpers_live_in_tests_support():
    helpers = [
        path.relative_to(TESTS.parent)
        for path in TESTS.rglob("*.py")
        if not path.name.startswith("test_")
        and path.name not in ("__init__.py", "conftest.py")
        and path.parent != TESTS / "support"
        and module_of(path) not in NOT_YET_MOVED
    ]
    assert helpers == [], helpers
