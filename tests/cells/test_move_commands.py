"""The cells' commands (SPEC §14): bad input is one clear line,
never a traceback; the move's deadline; a move to a cell that is down."""

from __future__ import annotations

import json
import socket
import time

from tests.support.cells import MARKS, Installation, shared_dsn
from tests.support.concurrent import concurrently

pytestmark = MARKS


def one_line(result: object) -> str:
    stderr = result.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in stderr and stderr.count("\n") == 1, stderr[-3000:]
    return stderr


def test_bad_input_to_the_commands_is_one_clear_line(installation: Installation) -> None:
    installation.manage("orbit_application", "create", "cmdbad", "--cell", "a")
    move = lambda *args: installation.manage("orbit_move_application", *args, check=False)  # noqa: E731
    # A cell whose DSN names no database, or a database that does not exist.
    cells = json.loads(installation.env["ORBIT_CELLS"])
    broken = {"no database": shared_dsn(""), "no such database": shared_dsn("orbit_cells_no_such_db")}
    # Each command is refused (or has nothing to do) on its own: they run at once, each checked as alone.
    results = concurrently(
        {
            "unknown cell": lambda: move("cmdbad", "--to", "c"),
            "unknown application": lambda: move("no-such-app", "--to", "b"),
            "same cell": lambda: move("cmdbad", "--to", "a"),
            "timeout 0": lambda: move("cmdbad", "--to", "b", "--timeout", "0"),
            "timeout nan": lambda: move("cmdbad", "--to", "b", "--timeout", "nan"),
            "create in an unknown cell": lambda: installation.manage(
                "orbit_application", "create", "cmdbad2", "--cell", "zz", check=False
            ),
            **{
                f"cells with {name}": lambda dsn=dsn: installation.manage(
                    "orbit_cells", check=False, ORBIT_CELLS=json.dumps({**cells, "c": dsn})
                )
                for name, dsn in broken.items()
            },
        }
    )
    unknown_cell = results["unknown cell"]
    assert unknown_cell.returncode == 1 and "unknown cell 'c'; cells: a, b" in one_line(unknown_cell)
    unknown_app = results["unknown application"]
    assert unknown_app.returncode == 1 and "no application 'no-such-app'" in one_line(unknown_app)
    same = results["same cell"]
    assert same.returncode == 0 and "cmdbad is in cell a already; nothing to move" in same.stdout, same
    for timeout in ("0", "nan"):
        bad = results[f"timeout {timeout}"]
        assert bad.returncode != 0 and "--timeout" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    unknown_cell_create = results["create in an unknown cell"]
    assert unknown_cell_create.returncode == 1 and "unknown cell 'zz'" in one_line(unknown_cell_create)
    for name in broken:
        listing = results[f"cells with {name}"]
        assert listing.returncode == 1 and "Traceback" not in listing.stderr, listing.stderr[-3000:]
        assert "c" in listing.stderr, listing.stderr


def test_a_short_timeout_moves_an_application_with_nothing_running(installation: Installation) -> None:
    # --timeout bounds the wait for running attempts (after the requests in flight end): none runs here.
    move = installation.prestart("orbit_move_application", "cmdidle", "--to", "a", "--timeout", "3")
    installation.manage("orbit_application", "create", "cmdidle", "--cell", "b")
    moved = move.run(check=False)
    assert moved.returncode == 0 and "now served from cell a" in moved.stdout, moved.stdout + moved.stderr


def test_a_move_to_a_cell_that_is_down_leaves_the_application_served(installation: Installation) -> None:
    move = installation.prestart("orbit_move_application", "cmddown", "--to", "b", "--timeout", "30")
    installation.bootstrap("cmddown", "a")
    assert installation.submit("cmddown", "cmddown-before").status_code == 201
    installation.private.stop(kill=True)
    try:
        moved = move.run(check=False)
        after = installation.submit("cmddown", "cmddown-during")
    finally:
        # The second run's start-up overlaps b's restart (it reads nothing before run()).
        move_again = installation.prestart("orbit_move_application", "cmddown", "--to", "b", "--timeout", "30")
        installation.private.start()
        # Run again with b back: the move is finished, leaving the shared installation as it was.
        deadline = time.monotonic() + 30
        while installation.submit("beta", "cmddown-beta-back").status_code != 201:
            assert time.monotonic() < deadline, "beta not served after its cell restarted"
            time.sleep(0.5)
        finished = move_again.run()
        assert "now served from cell b" in finished.stdout, finished.stdout
    assert moved.returncode == 1 and "Traceback" not in moved.stderr, moved.stderr[-3000:]
    assert 'ORBIT_CELLS["b"]' in moved.stderr or "cell b" in moved.stderr, moved.stderr
    # Nothing moved, so the application is served where it is (it was stopped, 503, until b came back).
    assert after.status_code == 201, (after.status_code, after.text, moved.stderr)


def test_a_connection_lost_mid_command_is_one_line_once_every_cell_answers_again(installation: Installation) -> None:
    # (a cell frozen long enough for the client to give up, thawed before the error is explained:
    # every database answers when the command looks for the one at fault)
    code = (
        "from django.db import OperationalError; raise OperationalError(2013, 'Lost connection to server during query')"
    )
    result = installation.manage("shell", "-c", code, check=False)
    assert result.returncode == 1
    assert "lost its database connection (Lost connection to server during query); run it again" in one_line(result)


def test_a_cell_that_does_not_answer_is_named_by_its_setting_not_as_the_directory(installation: Installation) -> None:
    # given a third cell on a port where no server listens
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    cells = {**json.loads(installation.env["ORBIT_CELLS"]), "c": f"mysql://root@127.0.0.1:{dead_port}/orbit_cells_c"}
    # when an application is placed there
    result = installation.manage(
        "orbit_application", "create", "deadcell", "--cell", "c", check=False, ORBIT_CELLS=json.dumps(cells)
    )
    # then the one line names that cell's server and setting (it named the directory's)
    assert result.returncode == 1
    line = one_line(result)
    assert f"cannot reach the database server at 127.0.0.1:{dead_port}" in line and 'ORBIT_CELLS["c"]' in line, line
