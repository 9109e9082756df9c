"""Orbit Python SDK: the HTTP ``Client`` / ``AsyncClient`` and the WebSocket ``Worker``. No Django import.

Submitting (``key`` is the Idempotency-Key: re-send with the same key, never a second task)::

    credentials = orbit_sdk.load_credentials(path)  # path=None: $ORBIT_CREDENTIALS_FILE
    with orbit_sdk.Client(credentials.url, credentials.token) as client:
        request = orbit_sdk.SubmitTaskRequest(queue_id, "object.update", "v1", "v1", {"object_ref": "objects/42"},
                                              concurrency_key="object/42")
        accepted = client.submit_task("update-object-42-operation-001", request)
        results = client.submit_tasks({"update-object-43-op-1": request2, ...})  # one transaction

Dependencies (SPEC §13; in a batch, an item names an earlier one by its ref)::

    split = orbit_sdk.BatchItem("split-1", split_request, ref="split")
    part = orbit_sdk.BatchItem("part-1", orbit_sdk.SubmitTaskRequest(..., depends_on=[split.depends_on_ref]))
    client.submit_tasks([split, part])  # part is BLOCKED until split has succeeded
    # part's handler reads execution.dependencies[0].output: what split returned

Working::

    def update(execution: orbit_sdk.Execution) -> dict[str, str]:
        # runs only after task.start.ok; execution.concurrency_token is an int for keyed tasks
        return {"written_with_token": str(execution.concurrency_token)}

    worker = orbit_sdk.Worker(credentials.url, credentials.token, [queue_id], {("object.update", "v1"): update})
    worker.run()  # until SIGTERM/SIGINT, drain() or stop(): graceful
    # or, inside another program: worker.start(); ...; worker.stop(); worker.join()

Fencing the real write (the resource refuses a stale token, in one transaction)::

    guard = orbit_sdk.fencing.Guard(connection, "postgresql")  # sqlite3, psycopg, MySQLdb/PyMySQL, Django
    guard.for_execution(execution).write("update-42-op-1", lambda conn: ...)  # StaleToken if superseded

sdk/README.md has a quickstart that runs as written against ``scripts/run``.
"""

from orbit_sdk import fencing as fencing  # the resource-side guard; a submodule, so not in __all__
from orbit_sdk._attempts import Execution
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
    BatchItem,
    BatchItemResult,
    Blocker,
    CancelTaskResult,
    ConcurrencyKey,
    ConcurrencyKeyHolder,
    ConfigureApplicationResult,
    ConfigureKeyPolicyRequest,
    ConfigureQueueRequest,
    CreateKeyPolicyRequest,
    CreatePlanRequest,
    CreateQueueRequest,
    CreateQueueResult,
    Dependency,
    Event,
    EventPage,
    KeyMatch,
    KeyPolicy,
    KeyPolicyResult,
    KeyRate,
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
    TaskBlockers,
    TaskInfo,
    TaskLink,
    UpdatePlanRequest,
)
from orbit_sdk._worker import Worker

__version__ = "0.1.0"

__all__ = [
    "APIError",
    "Application",
    "AsyncClient",
    "Attempt",
    "BatchItem",
    "BatchItemResult",
    "Blocker",
    "CancelRequested",
    "CancelTaskResult",
    "Client",
    "ConcurrencyKey",
    "ConcurrencyKeyHolder",
    "ConfigureApplicationResult",
    "ConfigureKeyPolicyRequest",
    "ConfigureQueueRequest",
    "CreateKeyPolicyRequest",
    "CreatePlanRequest",
    "CreateQueueRequest",
    "CreateQueueResult",
    "Credentials",
    "CredentialsError",
    "Dependency",
    "Event",
    "EventPage",
    "Execution",
    "KeyMatch",
    "KeyPolicy",
    "KeyPolicyResult",
    "KeyRate",
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
    "TaskBlockers",
    "TaskInfo",
    "TaskLink",
    "TransportError",
    "UnknownOutcome",
    "UpdatePlanRequest",
    "Worker",
    "load_credentials",
]
