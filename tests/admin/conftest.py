import pytest
from django.contrib.auth import get_user_model


@pytest.fixture
def operator(client):
    """A logged-in superuser's client."""
    user = get_user_model().objects.create_superuser("operator", "op@example.com", "pw")
    client.force_login(user)
    return client
