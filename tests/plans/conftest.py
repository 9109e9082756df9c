from __future__ import annotations

import pytest

from tests.conftest import Tenant, api_client
from tests.support.factories import ALL_SCOPES, make_credential


@pytest.fixture
def planner(tenant: Tenant) -> Tenant:
    """The tenant's namespace with a credential that also holds plans:manage."""
    issued = make_credential(tenant.namespace, scopes=[*ALL_SCOPES, "plans:manage"])
    return Tenant(namespace=tenant.namespace, token=issued.token, client=api_client(issued.token))
