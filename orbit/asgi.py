"""The documented entry point `orbit.asgi:application`; the application is the
installation shell's (server.asgi)."""

from server.asgi import application

__all__ = ["application"]
