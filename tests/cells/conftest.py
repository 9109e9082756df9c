from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cells import Installation, running_installation


@pytest.fixture(scope="package")
def installation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installation]:
    yield from running_installation(tmp_path_factory)
