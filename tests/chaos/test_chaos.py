"""The reliability harness (reliability/harness.py) in its short form.

It starts its own private MariaDB (never the shared one on 127.0.0.1:3306), two Orbit
servers and an API-only one, four SDK workers and HTTP submitters (tasks, and pipelines of
tasks that depend on tasks: reliability/pipelines.py), then kills a worker, a server and
MariaDB (kill -9, then a clean restart) under load, and checks the rows afterwards; then the
same with `--cells` (a directory and two cells, the chaos application in cell b and a
neighbour application with its own load in cell a). The full run:
`.venv/bin/python reliability/harness.py`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from reliability.mariadb import available

ROOT = Path(__file__).resolve().parent.parent.parent
TIMEOUT = 300

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(TIMEOUT + 30)]


def run_short_harness(tmp_path: Path, *options: str) -> dict:
    """Runs `harness.py --short` with `options`; its summary, once it exited 0 and said OK."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ORBIT_")}
    process = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "reliability" / "harness.py"),
            "--short",
            *options,
            "--summary",
            str(tmp_path / "s.json"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # one process group: a timeout takes every child down with it
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)  # the harness cleans up on SIGTERM
        try:
            output, _ = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        pytest.fail(f"chaos harness did not finish within {TIMEOUT} s:\n{output[-6000:]}")
    assert process.returncode == 0, output[-8000:]
    assert "chaos: OK" in output, output[-8000:]
    return json.loads((tmp_path / "s.json").read_text())


def assert_short_run_kept_every_invariant(summary: dict) -> None:
    """What every short run must show, on one database or on cells."""
    assert summary["ok"] and not summary["violations"]
    names = [event["name"] for event in summary["events"]]
    assert names == [
        "kill -9 worker",
        "SIGSTOP worker past its lease",
        "kill -9 server B",
        "kill -9 MariaDB",
        "SIGTERM restart of MariaDB",
        "MariaDB frozen (SIGSTOP: connections accepted, never answered)",
        "server B frozen mid-transaction (SIGSTOP of one process)",
    ]
    figures = summary["figures"]
    assert figures["orbit_check_exit"] == 0
    assert figures["tasks_accepted"] > 0 and figures["tasks_in_db"] == figures["tasks_accepted"]
    assert figures["submit_deduplicated_replays"] > 0  # the idempotency paths were exercised
    # Keys with a capacity and a rate were used up to their capacity (the checks hold them to it).
    holders = figures["key_holders"]
    assert holders["chaos/cap/*"]["holders_max"] == holders["chaos/cap/*"]["capacity"] == 3, holders
    assert holders["chaos/rated/*"]["capacity"] == 2 and holders["chaos/rated/*"]["grants"] > 0, holders
    assert all(rated["starts"] > 0 for rated in figures["rated_keys"].values()), figures["rated_keys"]
    for event in summary["events"]:
        if "MariaDB" in event["name"]:
            assert event["outage_probes"] > 0
            assert event["outage_probe_worst_s"] < 5
        if "mid-transaction" in event["name"]:
            # caught holding the application's counter row, which MariaDB freed within seconds,
            # and the other node refused nothing past the bound
            assert event["locks_released_s"] is not None and event["locks_released_s"] < 5, event
            assert event["server_A_answers"] > 0 and event["server_A_refused_after_8_s"] == 0, event
        if event["name"] == "SIGSTOP worker past its lease":
            # stopped past the lease: what it ran recovered as UNKNOWN, what it never started
            # expired or released, and the key's next holder took a recovered permit
            assert event["stopped_s"] > 10 and set(event["held_states"]) <= {"UNKNOWN", "EXPIRED", "RELEASED"}, event
            assert event["held_states"].get("UNKNOWN", 0) >= 1 and event["next_token"] > event["long_token"], event
        if event["name"] in ("kill -9 server B", "kill -9 MariaDB"):
            # a wide cancel's follow-up (past the inline budget) was in flight at the kill, and
            # another node, or a server after the restart, settled the rest from its row
            cut = event["follow_up"]
            assert cut["settlement_pending_at_kill"] and cut["follow_up_waiting_at_kill"], cut
            assert cut["blocked_at_kill"] == cut["dependents"] - 200, cut
            assert cut["settled_after_kill_s"] is not None, cut
            assert cut["follow_up_held_on"] in ("A", "B", "C"), cut
        if event["name"].startswith("MariaDB frozen"):
            assert event["submits_during_freeze"].get("503", 0) > 0, event
            assert event["submits_during_freeze"]["worst_s"] <= 5, event
            for server in ("A", "B", "C"):
                assert event[f"server_{server}_recovered_s"] is not None
    # Pipelines (SPEC §13) ran alongside: chains, fan-out/fan-in, a wide fan-out past the
    # inline budget; failed parents under CANCEL cut their dependents, under RUN let them run.
    pipelines = figures["pipelines"]
    assert pipelines["chains"] + pipelines["chains_stepwise"] >= 3 and pipelines["fan_ins"] >= 3, pipelines
    assert pipelines["wide_fan_outs"] >= 1 and pipelines["cut_follow_ups"] == 2, pipelines
    outcomes = figures["pipeline_outcomes"]
    assert outcomes["chains_completed"] > 0 and outcomes["chains_cut_short"] > 0, outcomes
    assert outcomes["joins_ran"] > 0 and outcomes["joins_cancelled"] > 0, outcomes
    assert outcomes["dependents_cancelled_dependency_failed"] > 0, outcomes
    assert outcomes["dependents_ran_after_a_failed_dependency"] > 0, outcomes
    wide = figures["pipeline_states_by_role"]["wide dependent"]
    assert wide == {"SUCCEEDED": 300 * pipelines["wide_fan_outs"]}, wide
    readiness = figures["pipeline_readiness"]
    assert readiness["measured"] > 300 and readiness["wide_max_s"] is not None, readiness


@pytest.mark.skipif(available() is not None, reason=f"no private MariaDB: {available()}")
def test_short_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    summary = run_short_harness(tmp_path)
    assert_short_run_kept_every_invariant(summary)


@pytest.mark.skipif(available() is not None, reason=f"no private MariaDB: {available()}")
def test_short_chaos_run_on_two_cells_keeps_every_invariant(tmp_path: Path) -> None:
    """The same run with a directory and two cells (SPEC §14): the chaos application in cell b,
    a neighbour application with its own load in cell a, through the same servers."""
    summary = run_short_harness(tmp_path, "--cells")
    assert_short_run_kept_every_invariant(summary)
    assert summary["cells"] == ["a", "b"]
    figures = summary["figures"]
    # The neighbour's load ran through every event: each task it saw accepted is there once and succeeded.
    neighbour = figures["neighbour"]
    assert neighbour["cell"] == "a" and neighbour["accepted"] > 0, neighbour
    assert neighbour["succeeded"] == neighbour["accepted"] == neighbour["tasks_in_db"], neighbour
    assert neighbour["lost"] == 0 and neighbour["duplicates"] == 0, neighbour
    assert neighbour["keyed_tasks"] > 0 and neighbour["submit_deduplicated_replays"] > 0, neighbour
    # Each application's rows in its own cell only; the directory holds none of a cell's tables.
    placement = figures["placement"]
    assert placement["directory"] == {"chaos": "b", "neighbour": "a"}, placement
    assert placement["misplaced_rows"] == 0 and placement["directory_cell_tables"] == [], placement
    for table in ("orbit_task", "orbit_attempt", "orbit_queue"):
        assert set(placement["rows"]["a"][table]) == {"neighbour"}, placement
        assert set(placement["rows"]["b"][table]) == {"chaos"}, placement
    assert placement["rows"]["a"]["orbit_task"]["neighbour"] == neighbour["tasks_in_db"], placement
    assert placement["rows"]["b"]["orbit_task"]["chaos"] == figures["tasks_in_db"], placement
