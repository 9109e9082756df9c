from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    """The operator console: every app's admin pages, the dashboard, /metrics.
    It reads the apps; no app imports it."""

    name = "console"
