"""Console users for the tests, made without hashing their password once per test.

Django hashes a password with PBKDF2 (about half a second here) whenever a user
is made with one; the tests make users with the same few passwords over and
over. The hash of each password is computed once per session and stored as the
user's password: a real PBKDF2 hash of that password (the live server checks it
at a browser's login exactly as any other), with one salt for the session
instead of one per user."""

from __future__ import annotations

import functools
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import make_password


@functools.cache
def password_hash(raw: str) -> str:
    """make_password(raw) with the configured (first) hasher, once per password per session."""
    return make_password(raw)


def make_user(username: str, email: str, password: str, *, superuser: bool = False, **extra: Any) -> Any:
    """The user create_user (create_superuser) makes with that password, with the session's hash of it."""
    manager = get_user_model().objects
    create = manager.create_superuser if superuser else manager.create_user
    user = create(username, email, None, **extra)  # None: no hashing here
    user.password = password_hash(password)
    user.save(update_fields=["password"])
    return user
