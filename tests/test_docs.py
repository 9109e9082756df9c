"""The documents hold to the tree and to a newcomer's reading.

- Every path docs/architecture names exists: a backticked file or directory (`orbit/db/`,
  `tasks/actions/dispatch.py`, or a bare `rounds.py` in a table row under that row's first
  path) and a backticked dotted name of a project module (`orbit.db.rows.holding`, whose
  last name must appear in that module).
- README.md and docs/ carry no issue numbers: they describe the product, not its history.
- Every relative link in README.md and docs/**/*.md points at a file or directory that exists.

Pure file reads: no database, no server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = sorted((ROOT / "docs" / "architecture").glob("*.md"))
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# Top-level entries a repository-relative path starts with; anything else in backticks
# (`/v1/tasks`, `application/json`, `*/*`) is not a path of the tree.
TOP_LEVEL = {entry.name for entry in ROOT.iterdir() if not entry.name.startswith(".")}
PACKAGES = {name for name in TOP_LEVEL if (ROOT / name / "__init__.py").is_file()}
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/?")
FILE_SUFFIXES = (".py", ".md", ".html", ".json", ".txt", ".toml", ".sql", ".cfg", ".in")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
# "issue 25", "issue #25", "Issue 25's", "issues 20 and 21"
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
# Markdown links: [text](target), skipping images' and references' edge cases we do not use.
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose(path: Path) -> str:
    """The document with its fenced code blocks blanked (commands and answers are not
    claims), lines kept where they were so messages name the right line."""
    return FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), path.read_text())


def named_paths(line: str) -> list[str]:
    """The repository paths one line names. In a table row, a bare name (`rounds.py`,
    `mysql/`) is read under the directory of the row's first repository path, as the
    "Where things live" tables write them."""
    tokens = [token.strip() for token in CODE.findall(line)]
    rooted = [token for token in tokens if PATH.fullmatch(token) and token.split("/")[0] in TOP_LEVEL]
    rooted = [token for token in rooted if "/" in token or token.endswith(FILE_SUFFIXES)]
    base = ""
    if line.lstrip().startswith("|") and rooted:
        first = rooted[0]
        base = first if first.endswith("/") else (first.rsplit("/", 1)[0] + "/" if "/" in first else "")
    paths = []
    for token in tokens:
        if not PATH.fullmatch(token) or token.startswith("."):
            continue
        if token.split("/")[0] in TOP_LEVEL and ("/" in token or token.endswith(FILE_SUFFIXES)):
            paths.append(token)
        elif base and ("/" in token or token.endswith(FILE_SUFFIXES)):
            paths.append(base + token)
    return paths


def module_file(dotted: str) -> tuple[Path, list[str]] | None:
    """The longest prefix of a dotted name that is a module or package of the tree, and
    the names after it; None when even its package is not one of the tree's."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:end])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, parts[end:]
    return None


def architecture_references() -> list[tuple[str, int, str]]:
    found = []
    for document in ARCHITECTURE:
        for number, line in enumerate(prose(document).splitlines(), 1):
            for path in named_paths(line):
                found.append((relative(document), number, path))
            for token in CODE.findall(line):
                token = token.strip().removesuffix("()")
                if DOTTED.fullmatch(token) and token.split(".")[0] in PACKAGES:
                    found.append((relative(document), number, "module:" + token))
    return found


def test_architecture_names_paths_at_all() -> None:
    """The scanner finds what the pages cite (guards the check below against reading nothing)."""
    named = {reference for _, _, reference in architecture_references()}
    assert {"orbit/db/", "tasks/actions/rounds.py", "module:orbit.locking.LOCK_ORDER"} <= named


@pytest.mark.parametrize("document", ARCHITECTURE, ids=relative)
def test_every_path_named_in_architecture_exists(document: Path) -> None:
    missing = []
    for source, number, reference in architecture_references():
        if source != relative(document):
            continue
        if reference.startswith("module:"):
            dotted = reference.removeprefix("module:")
            resolved = module_file(dotted)
            if resolved is None:
                missing.append(f"line {number}: {dotted} (no such module)")
                continue
            module, names = resolved
            if len(names) > 2:
                missing.append(f"line {number}: {dotted} (no module {'.'.join(dotted.split('.')[:-2])})")
            elif names and not re.search(rf"\b{re.escape(names[0])}\b", module.read_text()):
                missing.append(f"line {number}: {dotted} ({names[0]} is not in {relative(module)})")
        elif not (ROOT / reference).exists() or (reference.endswith("/") and not (ROOT / reference).is_dir()):
            missing.append(f"line {number}: {reference}")
    assert not missing, f"{relative(document)} names what the tree does not have:\n" + "\n".join(missing)


@pytest.mark.parametrize("document", DOCUMENTS, ids=relative)
def test_no_issue_numbers(document: Path) -> None:
    text = document.read_text()
    hits = [
        f"line {text.count(chr(10), 0, match.start()) + 1}: {match.group(0)}" for match in ISSUE_NUMBER.finditer(text)
    ]
    assert not hits, f"{relative(document)} names issues; say what the code does and why instead:\n" + "\n".join(hits)


@pytest.mark.parametrize("document", DOCUMENTS, ids=relative)
def test_relative_links_resolve(document: Path) -> None:
    broken = []
    for target in LINK.findall(prose(document)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (document.parent / path).exists():
            broken.append(target)
    assert not broken, f"{relative(document)} links to files that do not exist: {broken}"
