"""Kept for deployments that name `DJANGO_SETTINGS_MODULE=orbit.settings`: the
settings live in the installation's shell, server.settings."""

from server.settings import *  # noqa: F403
