from tests.conftest import post_json


def test_seed_create_then_replay(tenant):
    body = {"name": "images", "max_concurrency": 8, "rate_per_second": 100}
    first = post_json(tenant.client, "/v1/queues", body, key="queue-images-v1")
    assert first.status_code == 201, first.content
    data = first.json()["data"]
    assert data["deduplicated"] is False
    queue = data["queue"]
    assert queue["unfinished_tasks"] == "0" and queue["revision"] == "1"
    assert queue["max_unfinished_tasks"] == 100000
    again = post_json(tenant.client, "/v1/queues", body, key="queue-images-v1")
    assert again.status_code == 200
    assert again.json()["data"] == {"deduplicated": True, "queue": queue}
