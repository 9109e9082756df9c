"""The Python blocks of sdk/README.md, as the README and typing tests read them."""

from __future__ import annotations

import re

from tests.support.live import ROOT

README = ROOT / "sdk" / "README.md"


BLOCK = re.compile(r"(?:<!-- readme-test: (?P<mark>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.DOTALL)


SIGNATURE = "signature of "


def python_blocks() -> list[tuple[str, str]]:
    return [(match["mark"] or "", match["code"]) for match in BLOCK.finditer(README.read_text())]
