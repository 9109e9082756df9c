"""The cells' commands (SPEC §14): bad input is one clear line,
never a traceback; the move's deadline; a move to a cell that is down."""

from __future__ import annotations

import json
import time

from tests.support.cells import MARKS, Installation, shared_dsn

pytestmark = MARKS


def one_line(result: object) -> str:
    stderr = result.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in stderr and stderr.count("\n") == 1, stderr[-3000:]
    return stderr


def test_bad_input_to_the_commands_is_one_clear_line(installation: Installation) -> None:
    installation.manage("orbit_application", "create", "cmdbad", "--cell", "a")
    move = lambda *args: installation.manage("orbit_move_application", *args, check=False)  # noqa: E731
    unknown_cell = move("cmdbad", "--to", "c")
    assert unknown_cell.returncode == 1 and "unknown cell 'c'; cells: a, b" in one_line(unknown_cell)
    unknown_app = move("no-such-app", "--to", "b")
    assert unknown_app.returncode == 1 and "no application 'no-such-app'" in one_line(unknown_app)
    same = move("cmdbad", "--to", "a")
    assert same.returncode == 0 and "cmdbad is in cell a already; nothing to move" in same.stdout, same
    for timeout in ("0", "nan"):
        bad = move("cmdbad", "--to", "b", "--timeout", timeout)
        assert bad.returncode != 0 and "--timeout" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    unknown_cell_create = installation.manage("orbit_application", "create", "cmdbad2", "--cell", "zz", check=False)
    assert unknown_cell_create.returncode == 1 and "unknown cell 'zz'" in one_line(unknown_cell_create)
    # A cell whose DSN names no database, or a database that does not exist.
    cells = json.loads(installation.env["ORBIT_CELLS"])
    for broken in (shared_dsn(""), shared_dsn("orbit_cells_no_such_db")):
        listing = installation.manage("orbit_cells", check=False, ORBIT_CELLS=json.dumps({**cells, "c": broken}))
        assert listing.returncode == 1 and "Traceback" not in listing.stderr, listing.stderr[-3000:]
        assert "c" in listing.stderr, listing.stderr


def test_a_short_timeout_moves_an_application_with_nothing_running(installation: Installation) -> None:
    # --timeout bounds the wait for running attempts (after the requests in flight end): none runs here.
    installation.manage("orbit_application", "create", "cmdidle", "--cell", "b")
    moved = installation.manage("orbit_move_application", "cmdidle", "--to", "a", "--timeout", "3", check=False)
    assert moved.returncode == 0 and "now served from cell a" in moved.stdout, moved.stdout + moved.stderr


def test_a_move_to_a_cell_that_is_down_leaves_the_application_served(installation: Installation) -> None:
    installation.bootstrap("cmddown", "a")
    assert installation.submit("cmddown", "cmddown-before").status_code == 201
    installation.private.stop(kill=True)
    try:
        moved = installation.manage("orbit_move_application", "cmddown", "--to", "b", "--timeout", "30", check=False)
        after = installation.submit("cmddown", "cmddown-during")
    finally:
        installation.private.start()
        # Run again with b back: the move is finished, leaving the shared installation as it was.
        deadline = time.monotonic() + 30
        while installation.submit("beta", "cmddown-beta-back").status_code != 201:
            assert time.monotonic() < deadline, "beta not served after its cell restarted"
            time.sleep(0.5)
        finished = installation.manage("orbit_move_application", "cmddown", "--to", "b", "--timeout", "30")
        assert "now served from cell b" in finished.stdout, finished.stdout
    assert moved.returncode == 1 and "Traceback" not in moved.stderr, moved.stderr[-3000:]
    assert 'ORBIT_CELLS["b"]' in moved.stderr or "cell b" in moved.stderr, moved.stderr
    # Nothing moved, so the application is served where it is (it was stopped, 503, until b came back).
    assert after.status_code == 201, (after.status_code, after.text, moved.stderr)
