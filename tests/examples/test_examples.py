"""The seed examples, run as a user runs them: a subprocess against a live server."""

import re

import pytest

from tests.support.examples import run_example

pytestmark = pytest.mark.django_db(transaction=True)

HEX = "[0-9a-f]{32}"


def test_resources_example_prints_the_seed_lines(orbit_server, tmp_path):
    result = run_example("resources.py", orbit_server, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 5, lines
    assert lines[0] == "backpressure=QUEUE_FULL http=429"
    assert lines[1] == "duplicate=true rejected_request_retried=true"
    assert re.fullmatch(f"task={HEX} state=SUCCEEDED attempts=1", lines[2])
    assert re.fullmatch(f"task={HEX} state=SUCCEEDED attempts=1", lines[3])
    assert lines[2] != lines[3]
    assert lines[4] == "unfinished=0 rate_per_second=1 worker_drained=true"


def test_keyed_concurrency_example_prints_the_seed_lines(orbit_server, tmp_path):
    result = run_example("keyed_concurrency.py", orbit_server, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "queues=2 completed=2 tokens_increasing=true",
        "resource_writes=2 stale_write_rejected=true worker_drained=true",
    ]


def test_pipeline_example_joins_the_sum_of_its_twenty_parts(orbit_server, tmp_path):
    result = run_example("pipeline.py", orbit_server, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "submitted=22 blocked=21 split_dependents=20",  # all but the split wait for what they depend on
        "parts=20 state=SUCCEEDED sum=500000500000 expected=500000500000",
        "worker_drained=true",
    ]
