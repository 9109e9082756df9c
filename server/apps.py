from django.apps import AppConfig


class ServerConfig(AppConfig):
    """The installation's shell: settings, URLs, serving, and the bootstrap and
    credential commands. It sits above the apps; nothing below imports it."""

    name = "server"
