"""Build hook of the server distribution (its metadata is pyproject.toml's).

The console's templates live at the repo's top level (templates/, found there
through settings.TEMPLATES' DIRS); a wheel carries them inside the orbit
package as orbit/templates/, where Django's app template loader finds them
in an installed server."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

TEMPLATES = Path(__file__).resolve().parent / "templates"


class BuildWithConsoleTemplates(build_py):
    def run(self) -> None:
        super().run()
        if TEMPLATES.is_dir() and not self.editable_mode:
            shutil.copytree(TEMPLATES, Path(self.build_lib) / "orbit" / "templates", dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildWithConsoleTemplates})
