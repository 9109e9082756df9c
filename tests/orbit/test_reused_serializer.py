"""StrictSerializer.validated reuses one instance per thread: no call may see
another call's data, result or errors."""

import pytest

from orbit.errors import InvalidArgument
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
    with pytest.raises(InvalidArgument) as first:
        SubmitTaskInput.validated(body(priority=42))
    assert first.value.message.startswith("priority: ")
    good = SubmitTaskInput.validated(body(payload={"n": 2}))
    assert good["payload"] == {"n": 2} and good["priority"] == 5
    with pytest.raises(InvalidArgument) as second:
        SubmitTaskInput.validated(body(handler=""))
    assert second.value.message.startswith("handler: ")
    again = SubmitTaskInput.validated(body(payload={"n": 3}))
    assert again["payload"] == {"n": 3} and good["payload"] == {"n": 2}
