"""StrictSerializer.validated reuses one instance per thread: no call may see
another call's data, result or errors."""

import pytest
from rest_framework.exceptions import ValidationError

from tasks.serializers import SubmitTaskInput


def body(**overrides):
    return {
        "queue_id": "q" * 32,
        "handler": "h",
        "handler_version": "v1",
        "payload_version": "v1",
        "payload": {"n": 1},
        **overrides,
    }


def test_each_call_is_judged_on_its_own_data():
    with pytest.raises(ValidationError) as first:
        SubmitTaskInput.validated(body(priority=42))
    assert "priority" in first.value.detail
    good = SubmitTaskInput.validated(body(payload={"n": 2}))
    assert good["payload"] == {"n": 2} and good["priority"] == 5
    with pytest.raises(ValidationError) as second:
        SubmitTaskInput.validated(body(handler=""))
    assert set(second.value.detail) == {"handler"}
    again = SubmitTaskInput.validated(body(payload={"n": 3}))
    assert again["payload"] == {"n": 3} and good["payload"] == {"n": 2}
