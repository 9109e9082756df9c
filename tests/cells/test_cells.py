"""Cells (SPEC §14) end to end: placement, routing, a frozen cell confined to
its tenants, a move under load, and the commands an operator runs, on the
two-cell installation of tests/support/cells.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from orbit import cells
from orbit_sdk import APIError, SubmitTaskRequest, Worker
from tests.support.cells import (
    CELL_A_DB,
    CELL_B_DB,
    DIRECTORY_DB,
    DIRECTORY_TABLES,
    MARKS,
    SHARED,
    SUFFIX,
    Installation,
    column_values,
    shared_connection,
    shared_dsn,
    table_names,
)
from tests.support.concurrent import concurrently

pytestmark = MARKS


def test_migrate_gives_each_database_only_its_own_tables(installation: Installation) -> None:
    shared = shared_connection()
    cell_b = installation.private.connect()
    try:
        directory, cell_a, cell_b_tables = (
            table_names(shared, DIRECTORY_DB),
            table_names(shared, CELL_A_DB),
            table_names(cell_b, CELL_B_DB),
        )
    finally:
        shared.close()
        cell_b.close()
    assert DIRECTORY_TABLES <= directory
    assert "orbit_task" not in directory and "orbit_application" not in directory
    for cell in (cell_a, cell_b_tables):
        assert {"orbit_task", "orbit_attempt", "orbit_application", "orbit_credential", "orbit_event"} <= cell
        assert not cell & DIRECTORY_TABLES
        assert "auth_user" not in cell
    assert cell_a == cell_b_tables


def test_bootstrap_places_by_cell_or_by_fewest_applications(installation: Installation) -> None:
    shared = shared_connection()
    try:
        cursor = shared.cursor()
        cursor.execute(f"SELECT name, cell FROM `{DIRECTORY_DB}`.orbit_cell_placement")  # noqa: S608
        placed = dict(cursor.fetchall())
    finally:
        shared.close()
    assert placed["alpha"] == "a" and placed["beta"] == "b"
    # each goes to the cell with the fewest applications, a tie to the first cell (the
    # installation is the package's: other modules' applications count too)
    held = {cell: list(placed.values()).count(cell) for cell in ("a", "b")}
    expected = {}
    for name in ("gamma", "delta"):
        expected[name] = min(held, key=lambda cell: (held[cell], cell))
        held[expected[name]] += 1
        assert installation.bootstrap(name)["application_id"]
    listing = installation.manage("orbit_cells").stdout
    assert "cell a (" in listing and "cell b (" in listing, listing
    cell_a, cell_b = listing.split("cell b (")
    assert "alpha" in cell_a and "beta" in cell_b, listing
    for name, cell in expected.items():
        assert name in (cell_a if cell == "a" else cell_b), (name, cell, listing)
    assert listing.count("  reachable;") == 2, listing


def test_bootstrap_refuses_an_unknown_cell_and_a_second_cell_for_one_application(installation: Installation) -> None:
    refused = concurrently(  # two refusals, neither changing anything the other reads
        {
            "unknown": lambda: installation.manage(
                "orbit_bootstrap", "--application", "epsilon", "--namespace", "n", "--environment", "e", "--queue", "q",
                "--output", str(installation.tmp / "epsilon.json"), "--cell", "c", check=False,
            ),
            "elsewhere": lambda: installation.manage(
                "orbit_bootstrap", "--application", "alpha", "--namespace", "n", "--environment", "e", "--queue", "q",
                "--output", str(installation.tmp / "alpha-again.json"), "--cell", "b", check=False,
            ),
        }
    )  # fmt: skip
    unknown, elsewhere = refused["unknown"], refused["elsewhere"]
    assert unknown.returncode == 1 and "--cell: unknown cell 'c'; cells: a, b" in unknown.stderr, unknown.stderr
    assert elsewhere.returncode == 1 and "application 'alpha' is in cell 'a'" in elsewhere.stderr, elsewhere.stderr


def test_orbit_application_creates_and_lists_by_cell(installation: Installation) -> None:
    created = installation.manage("orbit_application", "create", "epsilon", "--cell", "b").stdout
    assert created.startswith("application epsilon created (id ") and created.strip().endswith(", cell b)"), created
    # Once epsilon exists, these only read it: at once.
    after = concurrently(
        {
            "again": lambda: installation.manage("orbit_application", "create", "epsilon"),
            "elsewhere": lambda: installation.manage(
                "orbit_application", "create", "epsilon", "--cell", "a", check=False
            ),
            "list": lambda: installation.manage("orbit_application", "list"),
        }
    )
    again = after["again"].stdout
    assert again.startswith("application epsilon exists (id ") and ", cell b)" in again, again
    elsewhere = after["elsewhere"]
    assert elsewhere.returncode == 1 and "application 'epsilon' is in cell 'b'" in elsewhere.stderr
    listed = dict(line.split("\t")[1:] for line in after["list"].stdout.splitlines())
    assert listed["epsilon"] == "b" and listed["alpha"] == "a" and listed["beta"] == "b", listed
    cell_b = installation.private.connect()
    try:
        assert "epsilon" in column_values(cell_b, CELL_B_DB, "orbit_application", "name")
    finally:
        cell_b.close()


def test_each_application_runs_in_its_cell_and_leaves_rows_only_there(installation: Installation) -> None:
    done: dict[str, list[str]] = {"alpha": [], "beta": []}
    workers = []
    for name in done:
        credential = installation.credentials[name]

        def handle(execution: Any, name: str = name) -> dict[str, str]:
            done[name].append(execution.task.id)
            return {"ran_for": name}

        worker = Worker(installation.server.url, credential["token"], [credential["queue_id"]], {"h": handle}, 4)  # type: ignore[union-attr]
        threading.Thread(target=worker.run, kwargs={"handle_signals": False}, daemon=True).start()
        workers.append(worker)
    submitted: dict[str, list[str]] = {}
    try:
        for name in done:
            with installation.client(name) as client:
                request = SubmitTaskRequest(
                    queue_id=installation.credentials[name]["queue_id"], handler="h", handler_version="v1",
                    payload_version="v1", payload={},
                )  # fmt: skip
                submitted[name] = [client.submit_task(f"{name}-run-{n}", request).task.id for n in range(20)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(len(done[name]) < 20 for name in done):
            time.sleep(0.05)
    finally:
        for worker in workers:
            worker.stop()
    assert {name: sorted(ids) for name, ids in done.items()} == {name: sorted(ids) for name, ids in submitted.items()}
    with installation.client("alpha") as client:
        assert client.get_task(submitted["alpha"][0]).state == "SUCCEEDED"
        queues = client.list_queues().items
        assert [queue.id for queue in queues] == [installation.credentials["alpha"]["queue_id"]]

    shared = shared_connection()
    cell_b = installation.private.connect()
    try:
        rows = {
            "a": {table: column_values(shared, CELL_A_DB, table, "id") for table in ("orbit_task", "orbit_attempt")},
            "b": {table: column_values(cell_b, CELL_B_DB, table, "id") for table in ("orbit_task", "orbit_attempt")},
        }
        namespaces = {
            "a": column_values(shared, CELL_A_DB, "orbit_event", "namespace_id")
            | column_values(shared, CELL_A_DB, "orbit_idempotency_record", "namespace_id"),
            "b": column_values(cell_b, CELL_B_DB, "orbit_event", "namespace_id")
            | column_values(cell_b, CELL_B_DB, "orbit_idempotency_record", "namespace_id"),
        }
    finally:
        shared.close()
        cell_b.close()
    assert set(submitted["alpha"]) <= rows["a"]["orbit_task"] and not set(submitted["alpha"]) & rows["b"]["orbit_task"]
    assert set(submitted["beta"]) <= rows["b"]["orbit_task"] and not set(submitted["beta"]) & rows["a"]["orbit_task"]
    assert len(rows["a"]["orbit_attempt"]) >= 20 and len(rows["b"]["orbit_attempt"]) >= 20
    alpha_ns, beta_ns = (installation.credentials[name]["namespace_id"] for name in ("alpha", "beta"))
    assert alpha_ns in namespaces["a"] and beta_ns not in namespaces["a"]
    assert beta_ns in namespaces["b"] and alpha_ns not in namespaces["b"]


def test_a_bootstrap_that_cannot_write_its_file_makes_no_row_in_the_cell(installation: Installation) -> None:
    (installation.tmp / "a-directory").mkdir()
    failed = installation.manage(
        "orbit_bootstrap", "--application", "eta", "--namespace", "n", "--environment", "e", "--queue", "q",
        "--output", str(installation.tmp / "a-directory"), "--overwrite", "--cell", "b", check=False,
    )  # fmt: skip
    assert failed.returncode == 1 and "Is a directory" in failed.stderr, failed.stderr
    cell_b = installation.private.connect()
    try:
        # The application, namespace, queue and credential are made in one transaction of its cell.
        assert "eta" not in column_values(cell_b, CELL_B_DB, "orbit_application", "name")
    finally:
        cell_b.close()
    # The placement stays (placements are written first): bootstrap again completes it there.
    assert installation.bootstrap("eta")["application_id"]
    assert installation.manage("orbit_check").returncode == 0


def test_a_cell_the_directory_names_but_orbit_cells_leaves_out_is_one_line(installation: Installation) -> None:
    """A command on an application placed in a cell missing from ORBIT_CELLS raised
    a LookupError traceback (or blamed a --cell nobody gave)."""
    only_b = json.dumps({"b": installation.private.dsn(CELL_B_DB)})
    credential_id = installation.credentials["alpha"]["token"].split("_")[1]
    revoked = installation.manage("orbit_credential", "revoke", credential_id, check=False, ORBIT_CELLS=only_b)
    created = installation.manage(
        "orbit_bootstrap", "--application", "alpha", "--namespace", "n", "--environment", "e", "--queue", "q",
        "--output", str(installation.tmp / "alpha-elsewhere.json"), check=False, ORBIT_CELLS=only_b,
    )  # fmt: skip
    for result, command in ((revoked, "orbit_credential"), (created, "orbit_bootstrap")):
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        line = "cell 'a' is not in ORBIT_CELLS, yet the directory places applications there"
        assert result.stderr == f"manage.py {command}: {line}\n"
    assert installation.client("alpha").list_queues().items  # nothing was revoked


def test_orbit_check_finds_an_application_in_a_cell_the_directory_does_not_name(installation: Installation) -> None:
    application_id = installation.bootstrap("theta", "a")["application_id"]
    shared = shared_connection()
    placements = f"`{DIRECTORY_DB}`.orbit_cell_placement"
    try:
        shared.cursor().execute(f"UPDATE {placements} SET cell = 'b' WHERE application_id = %s", (application_id,))  # noqa: S608
        shared.commit()
        drifted = installation.manage("orbit_check", check=False)
        shared.cursor().execute(f"DELETE FROM {placements} WHERE application_id = %s", (application_id,))  # noqa: S608
        shared.commit()
        unknown = installation.manage("orbit_check", check=False)
    finally:
        shared.cursor().execute(
            f"REPLACE INTO {placements} (application_id, name, cell, moving_to, moving_from, move_phase, created_at, "  # noqa: S608
            "updated_at) VALUES (%s, 'theta', 'a', '', '', '', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
            (application_id,),
        )
        shared.commit()
        shared.close()
    assert drifted.returncode == 1, drifted.stdout
    assert f"cell a: application {application_id}: in cell a but the directory places it in b" in drifted.stderr
    assert unknown.returncode == 1, unknown.stdout
    assert f"cell a: application {application_id}: in cell a but not in the directory" in unknown.stderr
    assert installation.manage("orbit_check").returncode == 0


def test_readyz_lists_each_cell(installation: Installation) -> None:
    answer = httpx.get(f"{installation.server.url}/readyz", timeout=5)  # type: ignore[union-attr]
    assert answer.status_code == 200
    assert answer.json()["data"] == {"status": "ready", "cells": {"a": "ready", "b": "ready"}}


def test_a_frozen_cell_answers_503_for_its_tenants_only_and_recovers(installation: Installation) -> None:
    # Both credentials known to the server before the freeze, as for any busy tenant.
    assert installation.submit("alpha", "warm-alpha").status_code == 201
    assert installation.submit("beta", "warm-beta").status_code == 201
    installation.private.freeze()
    frozen_at = time.monotonic()
    beta_answers: list[tuple[int, float]] = []
    alpha_answers: list[tuple[int, float]] = []

    def beta_submits() -> None:
        for n in range(2):
            began = time.monotonic()
            status = installation.submit("beta", f"frozen-beta-{n}").status_code
            beta_answers.append((status, time.monotonic() - began))

    try:
        beta = threading.Thread(target=beta_submits)
        beta.start()
        n = 0
        while time.monotonic() - frozen_at < 10:
            began = time.monotonic()
            status = installation.submit("alpha", f"frozen-alpha-{n}").status_code
            alpha_answers.append((status, time.monotonic() - began))
            n += 1
        ready = httpx.get(f"{installation.server.url}/readyz", timeout=5)  # type: ignore[union-attr]
        scrape, scrape_seconds = installation.scrape()
        beta.join(timeout=30)
        time.sleep(max(0.0, 12 - (time.monotonic() - frozen_at)))
    finally:
        installation.private.thaw()
    assert len(alpha_answers) >= 20
    assert all(status == 201 for status, _ in alpha_answers), alpha_answers
    assert max(seconds for _, seconds in alpha_answers) < 1.5, alpha_answers
    assert [status for status, _ in beta_answers] == [503, 503], beta_answers
    assert max(seconds for _, seconds in beta_answers) < 5.5, beta_answers
    assert ready.status_code == 200 and ready.json()["data"]["cells"] == {"a": "ready", "b": "database unreachable"}
    # /metrics leaves the frozen cell out after waiting 2 s for it (CELL_SCRAPE_SECONDS) and says so.
    assert scrape.status_code == 200 and scrape_seconds < 3.0, (scrape.status_code, scrape_seconds)
    assert 'orbit_cell_up{cell="b"} 0.0' in scrape.text and 'application="alpha"' in scrape.text
    # After the thaw beta is served again: a new submit, and a retried one (its key was never accepted).
    deadline = time.monotonic() + 30
    while installation.submit("beta", "thawed-beta").status_code != 201:
        assert time.monotonic() < deadline, "beta not served after the thaw"
        time.sleep(0.5)
    assert installation.submit("beta", "frozen-beta-0").status_code == 201


def test_a_killed_cell_answers_503_for_its_tenants_only_and_recovers(installation: Installation) -> None:
    assert installation.submit("alpha", "before-kill-alpha").status_code == 201
    assert installation.submit("beta", "before-kill-beta").status_code == 201
    installation.private.stop(kill=True)  # kill -9: InnoDB recovers on the next start
    try:
        alpha: list[tuple[int, float]] = []
        for n in range(20):
            began = time.monotonic()
            alpha.append((installation.submit("alpha", f"killed-alpha-{n}").status_code, time.monotonic() - began))
        began = time.monotonic()
        beta = installation.submit("beta", "killed-beta")
        beta_seconds = time.monotonic() - began
        ready = httpx.get(f"{installation.server.url}/readyz", timeout=5)  # type: ignore[union-attr]
        scrape, scrape_seconds = installation.scrape()
        listing = installation.manage("orbit_cells", check=False)
    finally:
        installation.private.start()
    # The report names the dead cell, and its status says something is wrong.
    assert listing.returncode == 1 and listing.stderr == "CommandError: cell b does not answer\n", listing
    assert "  unreachable: " in listing.stdout.split("cell b (")[1] and "  reachable; " in listing.stdout
    # The scrape answers without the dead cell: its queues are missing and orbit_cell_up says so.
    assert scrape.status_code == 200 and scrape_seconds < 3.0, (scrape.status_code, scrape_seconds)
    assert 'orbit_cell_up{cell="a"} 1.0' in scrape.text and 'orbit_cell_up{cell="b"} 0.0' in scrape.text
    assert 'application="alpha"' in scrape.text and 'application="beta"' not in scrape.text
    assert all(status == 201 for status, _ in alpha) and max(seconds for _, seconds in alpha) < 1.5, alpha
    assert beta.status_code == 503 and beta.json()["error"]["code"] == "UNAVAILABLE" and beta_seconds < 5.5
    assert ready.status_code == 200 and ready.json()["data"]["cells"] == {"a": "ready", "b": "database unreachable"}
    deadline = time.monotonic() + 30
    while installation.submit("beta", "restarted-beta").status_code != 201:
        assert time.monotonic() < deadline, "beta not served after its cell restarted"
        time.sleep(0.5)
    assert installation.submit("beta", "killed-beta").status_code == 201  # refused, so never accepted: new now


@pytest.mark.parametrize(
    ("cells", "message"),
    [
        ("{not json", "ORBIT_CELLS must be a JSON object of cell names to mysql:// DSNs"),
        ("[]", "ORBIT_CELLS must be a non-empty JSON object of cell names to mysql:// DSNs"),
        ('{"A": "mysql://root:@127.0.0.1:3306/x"}', "ORBIT_CELLS: cell name 'A' must be 1-32 of a-z"),
        ('{"a": "sqlite:///x"}', "ORBIT_CELLS: cell 'a' must be a mysql://user:pass@host:port/db DSN"),
    ],
)
def test_a_bad_orbit_cells_is_refused_by_name(installation: Installation, cells: str, message: str) -> None:
    result = installation.manage("check", check=False, ORBIT_CELLS=cells)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


def test_two_cells_on_one_database_are_refused(installation: Installation) -> None:
    same = json.dumps({"a": shared_dsn(CELL_A_DB), "b": shared_dsn(CELL_A_DB)})
    result = installation.manage("check", check=False, ORBIT_CELLS=same)
    assert result.returncode != 0 and "ORBIT_CELLS: cell 'b' is the same database as cell 'a'" in result.stderr


def test_two_cells_on_one_database_by_different_names_are_refused_by_serve_and_moves(
    installation: Installation,
) -> None:
    # given cell b written as cell a's database on the same server by another of its names
    other_name = "localhost" if SHARED["HOST"] == "127.0.0.1" else "127.0.0.1"
    same = json.dumps({"a": shared_dsn(CELL_A_DB), "b": shared_dsn(CELL_A_DB).replace(SHARED["HOST"], other_name, 1)})
    results = concurrently(
        {
            "serve": lambda: installation.manage(
                "serve", "-b", "127.0.0.1", "-p", "0", check=False, ORBIT_CELLS=same, ORBIT_SECRET_KEY="k" * 50
            ),
            "move": lambda: installation.manage(
                "orbit_move_application", "no-such-app", "--to", "b", check=False, ORBIT_CELLS=same
            ),
        }
    )
    # then neither runs: a move between them would remove the rows it had just copied
    for result in results.values():
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert result.stderr.count("\n") == 1, result.stderr
        assert 'ORBIT_CELLS["b"] is the same database as ORBIT_CELLS["a"]' in result.stderr, result.stderr


def test_without_orbit_cells_there_is_no_cell_to_choose(installation: Installation, tmp_path: Path) -> None:
    # An installation of its own, on one database (not a cell's: its rows would be no directory's).
    plain_db = f"orbit_cells_plain_{SUFFIX}"
    shared = shared_connection()
    shared.cursor().execute(f"CREATE DATABASE `{plain_db}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
    try:
        env = {"ORBIT_CELLS": "", "ORBIT_MYSQL_DSN": shared_dsn(plain_db)}
        installation.manage("migrate", "-v0", **env)
        # The refused bootstrap makes nothing, so the create beside it finds what it would alone.
        results = concurrently(
            {
                "bootstrap": lambda: installation.manage(
                    "orbit_bootstrap", "--application", "zeta", "--namespace", "n", "--environment", "e",
                    "--queue", "q", "--output", str(tmp_path / "z.json"), "--cell", "a", check=False, **env,
                ),
                "create": lambda: installation.manage("orbit_application", "create", "zeta", **env),
            }
        )  # fmt: skip
        result = results["bootstrap"]
        assert result.returncode == 1
        assert "--cell: ORBIT_CELLS is not set; there is one cell, the default database" in result.stderr
        plain = results["create"].stdout
        assert plain.startswith("application zeta created (id ") and "cell" not in plain, plain
    finally:
        shared.cursor().execute(f"DROP DATABASE IF EXISTS `{plain_db}`")
        shared.close()


def test_a_second_move_of_one_application_is_refused_while_the_first_runs(installation: Installation) -> None:
    # given an application in cell b with accepted tasks
    installation.bootstrap("twice", "b")
    keys = [f"twice-{n}" for n in range(5)]
    for key in keys:
        assert installation.submit("twice", key).status_code == 201
    # when the same move is run twice at once
    first = installation.prestart("orbit_move_application", "twice", "--to", "a", "--timeout", "30")
    second = installation.prestart("orbit_move_application", "twice", "--to", "a", "--timeout", "30")
    results = concurrently({"first": lambda: first.run(check=False), "second": lambda: second.run(check=False)})
    # then one moves it and the other is refused in one line, touching nothing
    moved = [result for result in results.values() if result.returncode == 0]
    refused = [result for result in results.values() if result.returncode != 0]
    assert len(moved) == 1 and "now served from cell a" in moved[0].stdout, results
    assert len(refused) == 1 and refused[0].returncode == 1, results
    stderr = refused[0].stderr
    assert "Traceback" not in stderr and stderr.count("\n") == 1, stderr
    assert "a move of twice is running in another process; run it again once that one has ended" in stderr
    # and every accepted task is in cell a, served from there (once the server's cached
    # placement answers "moved", read again)
    for key in keys:
        replay = installation.submit("twice", key)
        if replay.status_code == 503:
            replay = installation.submit("twice", key)
        assert replay.status_code == 200 and replay.json()["data"]["deduplicated"] is True, replay.text


def test_a_move_under_load_loses_nothing_and_key_tokens_continue(installation: Installation) -> None:
    credential = installation.bootstrap("mover", "b")
    tokens: list[int] = []
    ran: list[str] = []

    def handle(execution: Any) -> None:
        assert execution.concurrency_token is not None
        tokens.append(execution.concurrency_token)
        ran.append(execution.task.id)
        time.sleep(0.01)

    worker = Worker(installation.server.url, credential["token"], [credential["queue_id"]], {"h": handle}, 4)  # type: ignore[union-attr]
    threading.Thread(target=worker.run, kwargs={"handle_signals": False}, daemon=True).start()
    accepted: dict[str, str] = {}
    refusals: list[tuple[str, float]] = []
    stop = threading.Event()

    def submitter() -> None:
        request = SubmitTaskRequest(
            queue_id=credential["queue_id"], handler="h", handler_version="v1", payload_version="v1", payload={},
            concurrency_key="account/1",
        )  # fmt: skip
        with installation.client("mover") as client:
            n = 0
            while not stop.is_set() or n < 10:
                key = f"mover-{n}"
                while True:  # as the SDK's caller does: the same key again after Retry-After
                    try:
                        accepted[key] = client.submit_task(key, request).task.id
                        break
                    except APIError as refused:
                        assert refused.code == "UNAVAILABLE" and refused.status_code == 503, refused
                        refusals.append((refused.message, refused.retry_after.total_seconds()))
                        time.sleep(max(refused.retry_after.total_seconds(), 0.2))
                n += 1
                time.sleep(0.02)

    thread = threading.Thread(target=submitter)
    # The commands' start-ups overlap the load before and after the move; each runs at its turn.
    move = installation.prestart("orbit_move_application", "mover", "--to", "a", "--timeout", "30")
    thread.start()
    try:
        time.sleep(1.5)
        moved = move.run()
        after_the_move = {
            "listing": installation.prestart("orbit_cells"),
            "check": installation.prestart("orbit_check"),
            "again": installation.prestart("orbit_move_application", "mover", "--to", "a"),
        }
        time.sleep(1.5)
        stop.set()
        thread.join(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(set(ran)) < len(accepted):
            time.sleep(0.1)
    finally:
        stop.set()
        worker.stop()
    assert "now served from cell a" in moved.stdout, moved.stdout
    assert refusals and {message for message, _ in refusals} <= {cells.MOVING, cells.MOVED_AWAY}, refusals
    assert all(seconds == 1 for _, seconds in refusals), refusals
    before = [token for token, task_id in zip(tokens, ran, strict=True) if task_id in accepted.values()]
    assert sorted(set(ran)) == sorted(accepted.values()), "every accepted task ran, once"
    assert len(ran) == len(set(ran))
    assert before == sorted(before) and len(set(before)) == len(before), "one key: tokens strictly increase"
    # The move is over: these three only read, so they run at once.
    finished = concurrently({name: command.run for name, command in after_the_move.items()})
    listing = finished["listing"].stdout
    assert "mover" in listing.split("cell b (")[0], listing
    shared = shared_connection()
    cell_b = installation.private.connect()
    try:
        in_a = column_values(shared, CELL_A_DB, "orbit_task", "id")
        in_b = column_values(cell_b, CELL_B_DB, "orbit_task", "id")
        names_b = column_values(cell_b, CELL_B_DB, "orbit_application", "name")
    finally:
        shared.close()
        cell_b.close()
    assert set(accepted.values()) <= in_a and not set(accepted.values()) & in_b
    assert "mover" not in names_b
    check = finished["check"]
    assert "orbit_check: ok" in check.stdout and "in cells a, b" in check.stdout
    # Run again: the move finished, nothing more to do.
    again = finished["again"]
    assert "mover is in cell a already; nothing to move" in again.stdout


CRASH_AT_SWITCH = """
from orbit.models import CellPlacement
from server import moves

real_save = CellPlacement.save

def save(self, *args, **kwargs):
    if self.move_phase == moves.COPIED:
        raise SystemExit("crash: the copy is committed, the directory not switched")
    real_save(self, *args, **kwargs)

CellPlacement.save = save
moves.move_application("crashy", "a", timeout=30, say=print)
"""

CRASH_AT_CLEANUP = """
from server import moves

real_remove = moves._remove

def remove(model, owned, alias):
    if alias == "cell_a":  # the source's rows, after the switch (the target's leftovers go first)
        raise SystemExit("crash: switched, the old rows not removed")
    return real_remove(model, owned, alias)

moves._remove = remove
moves.move_application("crashy", "b", timeout=30, say=print)
"""


def test_an_interrupted_move_is_finished_by_running_it_again(installation: Installation) -> None:
    # Each command below waits for the one before: each starts up during the one before
    # (most of them wait out a move's settle), and begins its work at its turn.
    crash_at_switch = installation.prestart("shell", "-c", CRASH_AT_SWITCH)
    credential = installation.bootstrap("crashy", "b")
    with installation.client("crashy") as client:
        request = SubmitTaskRequest(
            queue_id=credential["queue_id"], handler="h", handler_version="v1", payload_version="v1", payload={},
            concurrency_key="account/9",
        )  # fmt: skip
        submitted = [client.submit_task(f"crashy-{n}", request).task.id for n in range(5)]

    def tasks_in(connection: Any, database: str) -> list[str]:
        cursor = connection.cursor()
        cursor.execute(f"SELECT id FROM `{database}`.orbit_task WHERE namespace_id = %s", (credential["namespace_id"],))  # noqa: S608
        return sorted(row[0] for row in cursor.fetchall())

    def where_tasks_are() -> tuple[list[str], list[str]]:
        shared, cell_b = shared_connection(), installation.private.connect()
        try:
            return tasks_in(shared, CELL_A_DB), tasks_in(cell_b, CELL_B_DB)
        finally:
            shared.close()
            cell_b.close()

    # Crashed between the target's commit and the directory's switch: both cells hold the rows.
    finish = installation.prestart("orbit_move_application", "crashy", "--to", "a")
    crashed = crash_at_switch.run(check=False)
    assert crashed.returncode != 0 and "crash: the copy is committed" in crashed.stderr, crashed.stderr[-2000:]
    in_a, in_b = where_tasks_are()
    assert in_a == in_b == sorted(submitted)
    assert installation.submit("crashy", "during-the-crashed-move").status_code == 503
    # Run again: the leftover copy is replaced, not doubled, and the move completes.
    crash_at_cleanup = installation.prestart("shell", "-c", CRASH_AT_CLEANUP)
    finished = finish.run()
    assert "now served from cell a" in finished.stdout, finished.stdout
    in_a, in_b = where_tasks_are()
    assert in_a == sorted(submitted) and in_b == []
    after = [installation.submit("crashy", "after-the-move") for _ in range(2)]
    assert [answer.status_code for answer in after] in ([201, 200], [503, 201]), after

    # Back to b, crashed after the switch, before the old rows were removed.
    finish = installation.prestart("orbit_move_application", "crashy", "--to", "b")
    crashed = crash_at_cleanup.run(check=False)
    assert crashed.returncode != 0 and "crash: switched" in crashed.stderr, crashed.stderr[-2000:]
    in_a, in_b = where_tasks_are()
    assert len(in_a) == len(in_b) == 6
    # The directory names b: served there, after one 503 from a node that still had a cached.
    answers = [installation.submit("crashy", "served-from-b") for _ in range(2)]
    assert [answer.status_code for answer in answers] in ([201, 200], [503, 201]), answers
    if answers[0].status_code == 503:
        assert answers[0].json()["error"]["message"] == cells.MOVING and answers[0].headers["Retry-After"] == "1"
    check = installation.prestart("orbit_check")
    again = finish.run()
    assert "rows removed from cell a; now served from cell b" in again.stdout, again.stdout
    in_a, in_b = where_tasks_are()
    assert in_a == [] and len(in_b) == 7
    assert "orbit_check: ok" in check.run().stdout
