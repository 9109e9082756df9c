#!/usr/bin/env python
"""Django's management commands with Orbit's settings, in the repo; installed,
the same command line is `orbit` (orbit/cli.py), `serve` included."""

from orbit.cli import main

if __name__ == "__main__":
    main()
