import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: starts its own MariaDB, servers and workers and breaks them (slow)")
