"""Orbit Python SDK: the HTTP ``Client`` and the WebSocket ``Worker``. No Django import.

Submitting::

    with orbit_sdk.Client.from_credentials_file() as client:  # $ORBIT_CREDENTIALS_FILE
        accepted = client.submit_task(
            "update-object-42-operation-001",  # Idempotency-Key: re-send with the same key
            orbit_sdk.SubmitTaskRequest(queue_id, "object.update", "v1", "v1", {"object_ref": "objects/42"},
                                        concurrency_key="object/42"),
        )

Working::

    def update(execution: orbit_sdk.Execution) -> dict:
        # runs only after task.start.ok; execution.concurrency_token is an int for keyed tasks
        return {"written_with_token": str(execution.concurrency_token)}

    worker = orbit_sdk.Worker(url, token, [queue_id], {("object.update", "v1"): update}, capacity=4)
    worker.run()  # until worker.drain() (from any thread or a handler) or worker.stop()
"""

from orbit_sdk._client import AsyncClient, Client
from orbit_sdk._credentials import Credentials, load_credentials
from orbit_sdk._exceptions import (
    APIError,
    CancelRequested,
    CredentialsError,
    OrbitError,
    ProtocolError,
    RetryableError,
    TransportError,
    UnknownOutcome,
)
from orbit_sdk._models import (
    Application,
    Attempt,
    BatchItemResult,
    CancelTaskResult,
    ConfigureApplicationResult,
    ConfigureQueueRequest,
    CreatePlanRequest,
    CreateQueueRequest,
    CreateQueueResult,
    Event,
    EventPage,
    Page,
    Plan,
    PlanResult,
    PlanTrigger,
    Queue,
    ResolveTaskResult,
    RetryPolicy,
    SubmitTaskRequest,
    SubmitTaskResult,
    Task,
    TaskInfo,
    UpdatePlanRequest,
)
from orbit_sdk._worker import Execution, Worker

__version__ = "0.1.0"

__all__ = [
    "APIError",
    "Application",
    "AsyncClient",
    "Attempt",
    "BatchItemResult",
    "CancelRequested",
    "CancelTaskResult",
    "Client",
    "ConfigureApplicationResult",
    "ConfigureQueueRequest",
    "CreatePlanRequest",
    "CreateQueueRequest",
    "CreateQueueResult",
    "Credentials",
    "CredentialsError",
    "Event",
    "EventPage",
    "Execution",
    "OrbitError",
    "Page",
    "Plan",
    "PlanResult",
    "PlanTrigger",
    "ProtocolError",
    "Queue",
    "ResolveTaskResult",
    "RetryPolicy",
    "RetryableError",
    "SubmitTaskRequest",
    "SubmitTaskResult",
    "Task",
    "TaskInfo",
    "TransportError",
    "UnknownOutcome",
    "UpdatePlanRequest",
    "Worker",
    "load_credentials",
]
