#!/usr/bin/env python
"""Django's management commands with Orbit's settings, in the repo; installed,
the same command line is `orbit` (server/cli.py), `serve` included."""

from server.cli import main

if __name__ == "__main__":
    main()
