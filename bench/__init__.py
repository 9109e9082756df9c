"""Orbit's benchmarks, one package run from the repository root with ``python -m``.

    python3 -m bench.run_all --quick                 # Orbit against its peers (bench/README.md)
    .venv/bin/python -m bench.trips_per_task         # frames and rounds per task
    .venv/bin/python -m bench.verb_costs             # ms and statements per verb
    .venv/bin/python -m bench.console_at_scale       # the console at 1,000,000 tasks
    .venv/bin/python -m bench.start_ahead_kill       # kill -9 while Starts are handed ahead

The working directory is the repository root, which ``-m`` puts first on the import path,
so ``bench.*``, Orbit's packages and ``reliability`` import from there without any
path edits; ``orbit_sdk`` is installed (editable, from ``sdk/``) in both ``.venv`` and
``bench/.venv``.
"""
