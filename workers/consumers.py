"""The worker protocol over WebSocket (docs/protocol.md).

The consumer only dispatches frames to action calls and back: workers.frames
reads and refuses them, and every state and counter change happens in
tasks.actions / tasks.actions.identities."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from autobahn.exception import Disconnected
from channels.consumer import get_handler_name
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.layers import get_channel_layer
from django.db import DatabaseError

from orbit import cells
from orbit.api.errors import translate
from orbit.db.pool import DATABASE_TOO_SLOW, REQUEST_DEADLINE_SECONDS, run_db
from orbit.errors import (
    LeaseLost,
    OrbitError,
    PermissionDenied,
    StateConflict,
    TaskCancelled,
    Unauthenticated,
    Unavailable,
)
from orbit.fields import new_id
from orbit.metrics import FRAMES_RECEIVED, FRAMES_SENT
from orbit.principal import (
    Minted,
    Principal,
    authenticate_token,
    enter_cell_of_header,
    known_credential,
    token_from_header,
)
from tasks.actions import dispatch, endings, rounds
from tasks.actions.context import ANY_VERSION, LEASE_BATCH_MAX, WorkerContext
from tasks.actions.dispatch import LeaseOutcome
from tasks.actions.identities import (
    HEARTBEAT_SECONDS,
    application_here,
    end_session,
    mark_session_alive,
    register_worker,
)
from tasks.actions.rounds import SUPERSEDED
from tasks.models import AttemptState
from tasks.wakeups import registry
from workers import frames

logger = logging.getLogger("orbit.workers")

DEFAULT_LEASE_SECONDS = 30
# Frames as json.dumps(..., separators=(",", ":")) writes them, without an
# encoder made for each.
compact_json = json.JSONEncoder(separators=(",", ":")).encode
RENEW_SECONDS = 10
# Dispatchers poll this often for work created by other server processes.
POLL_INTERVAL_SECONDS = 0.25
# A busy worker's dispatcher waits this long after a freed slot before leasing.
LEASE_GATHER_SECONDS = 0.01
# A connection that reads nothing gets nothing more: at most this many
# assignments (and, past UNACKED_MAX_BYTES of them, none more) go out before
# the worker acknowledges one (task.assign.ack, or any frame naming the attempt).
UNACKED_MAX = 16
UNACKED_MAX_BYTES = 1024 * 1024
# An assignment unacknowledged this long (or until its lease ends, if sooner)
# marks a connection that does not read: it is closed and its unstarted leases
# are released at once, so none of them expires into a new lease for it.
ACK_TIMEOUT_SECONDS = 10.0
# An authenticated connection that has not sent hello this long is closed: an
# open socket costs the server memory, and a worker says hello at once.
HELLO_TIMEOUT_SECONDS = 10.0
# A connection's requests run side by side, up to twice its capacity (a renew
# and a result in flight for each slot) and this many more; a burst beyond
# that waits its turn in arrival order, so one connection cannot queue work on
# the database pool ahead of every other connection's. A request still
# waiting when its deadline (from its arrival) passes is answered UNAVAILABLE.
REQUESTS_SIDE_BY_SIDE_MARGIN = 32
TOO_MANY_IN_FLIGHT = (
    "this connection's earlier requests held every turn for {seconds:g} s (at most {turns} run at once); retry later"
)

# The release reason of what a closed connection never acknowledged.
TAKEN_BACK_ON_CLOSE = "connection closed before the assignment was acknowledged"
NEVER_SENT = "leased by a round that outlived its request's deadline; never sent"

CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_CONFLICT = 4409
CLOSE_TIMEOUT = 4408  # assignments not acknowledged, or no hello, in time
CLOSE_MOVED = 4503  # the application moved to another cell: reconnect (to the new one)


def _authenticated_in_cell(token: str) -> tuple[Principal, str | None]:
    """The token's principal and the cell its authentication entered (None without cells)."""
    return authenticate_token(token), cells.entered()


@dataclass
class Unacknowledged:
    epoch: int
    overdue_at: float  # time.monotonic()
    size: int  # bytes of the task.assign frame


def handler_of(entry: dict[str, Any]) -> tuple[str, str]:
    """An assignment's handler and version."""
    return entry["task"]["handler"], entry["task"]["handler_version"]


def seconds_until(rfc3339: str) -> float:
    return (datetime.fromisoformat(rfc3339.replace("Z", "+00:00")) - datetime.now(UTC)).total_seconds()


class WorkerConsumer(AsyncWebsocketConsumer):
    principal: Principal | None = None
    credential: Minted | None = None
    worker: WorkerContext | None = None
    heartbeat: asyncio.Task | None = None
    hello_deadline: asyncio.Task | None = None

    # The scope as Channels passes it (the stubs' scope type is private to them).
    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Channels' AsyncConsumer.__call__ without a channel layer (Orbit
        configures none): each frame is awaited from `receive` and dispatched,
        in order, instead of through a new task and an asyncio.wait per frame
        (await_many_dispatch, which multiplexes the client and a channel layer)."""
        if get_channel_layer(self.channel_layer_alias) is not None:
            await super().__call__(scope, receive, send)
            return
        self.scope = scope
        self.channel_layer = None  # type: ignore[assignment]  # none configured; the stubs assume a layer
        self.base_send = send
        with contextlib.suppress(StopConsumer):
            while True:
                await self.dispatch(await receive())

    async def connect(self) -> None:
        await self.accept()
        self.capacity = 0
        self.held: set[str] = set()
        self.unacked: dict[str, Unacknowledged] = {}
        # Held attempts known to be RUNNING: a result for one of them frees its
        # slot, so its round may lease into that slot (on_result's hand-off).
        self.running: set[str] = set()
        # Each held attempt's handler and version: a result with start_next
        # starts ahead, into the slot it frees, a task its worker serves for
        # sure (dispatch.lease's `starting`).
        self.handlers: dict[str, tuple[str, str]] = {}
        # Held attempts of keyed tasks: their result releases a key to hand on,
        # with or without start_next.
        self.keyed: set[str] = set()
        # Held attempts whose result's hand-off is in flight (on_result).
        self.ending: set[str] = set()
        # Started ahead and sent, not yet acknowledged, by epoch: their handler
        # has not run here, so their Start is taken back if the worker hands
        # them back or the connection goes first (disconnect).
        self.undelivered: dict[str, int] = {}
        self.closed = False
        # The close handshake has begun (the server's close frame sent, or a
        # frame found the connection closing): nothing more reaches the worker,
        # so nothing more is leased or handed on for it. `closed` follows once
        # the connection is gone (disconnect).
        self.closing = False
        self.unacked_bytes = 0
        self.draining = False
        self.wake = asyncio.Event()
        self.dispatcher: asyncio.Task | None = None
        self.inflight: set[asyncio.Task] = set()
        # Turns for the requests that run side by side (made again at the hello, which sets the capacity).
        self.turns = asyncio.Semaphore(self.turn_count)
        # Held by the dispatcher from lease to sent assignments, and by drain:
        # so drain.ok is never followed by an assignment leased before it
        # (drain also waits for the hand-offs in flight, on_result).
        self.lease_lock = asyncio.Lock()
        # Hand-offs in flight (each may add one assignment), those of them
        # that take only what they start (never an unacknowledged one), and
        # the slots their results freed whose assignment is not sent yet (on_result).
        self.handoffs = 0
        self.started_handoffs = 0
        self.reserved = 0
        self.no_handoffs = asyncio.Event()
        self.no_handoffs.set()
        self.handoff_sending = asyncio.Lock()
        headers = dict(self.scope.get("headers") or [])
        raw = headers.get(b"authorization")
        authorization = raw.decode("latin-1") if raw else None
        try:
            self.token = token_from_header(authorization)
            await enter_cell_of_header(authorization)  # its cell's pool, not the directory's
            principal, cell = await run_db(_authenticated_in_cell, self.token)
            self.principal = principal
            # Every later call of this connection (its task's context) runs in the application's cell.
            cells.enter(cell)
            self.credential = known_credential(self.token)
            principal.require("workers:connect")
            self.hello_deadline = asyncio.create_task(self.close_without_hello())
        except Unavailable as error:  # the database did not answer in time: try again, nothing is wrong
            await self.send_error(None, error)
            await self.close(code=1011)
            self.principal = None
        except OrbitError as error:
            await self.send_error(None, error)
            await self.close(code=CLOSE_FORBIDDEN if isinstance(error, PermissionDenied) else CLOSE_UNAUTHENTICATED)
            self.principal = None
        except DatabaseError as exc:
            await self.send_error(None, translate(exc) or OrbitError("internal error"))
            await self.close(code=1011)
            self.principal = None

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels' dispatch, without closing the event-loop thread's stale
        Django connections before every frame (a thread hop per frame): this
        consumer never uses that thread's connection. Its database work runs on
        orbit.db.pool's pool, whose threads keep and check their own."""
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    async def disconnect(self, code: int) -> None:
        # Disconnecting releases nothing delivered: leases run out or results
        # arrive as usual. What was started ahead and never acknowledged was
        # never run: it goes back to its queue now, not to review at expiry.
        self.closed = True
        registry.unregister(self.wake)
        await self.hand_back(
            [{"attempt_id": held, "epoch": epoch, "state": "RUNNING"} for held, epoch in self.undelivered.items()],
            reason=TAKEN_BACK_ON_CLOSE,
        )
        for task in (self.dispatcher, self.heartbeat, self.hello_deadline):
            if task is not None:
                task.cancel()
        if self.worker is not None and self.worker.identity_id is not None:
            # run_db is bounded by the request deadline; the database may be
            # down: the session then goes stale instead.
            with contextlib.suppress(Exception):
                await run_db(end_session, identity_id=self.worker.identity_id, session_id=self.worker.session_id)

    async def close_without_hello(self) -> None:
        await asyncio.sleep(HELLO_TIMEOUT_SECONDS)
        if self.worker is None and not self.closed:
            message = f"no hello within {HELLO_TIMEOUT_SECONDS:g} s of connecting"
            await self.send_json({"type": "error", "code": "HELLO_TIMEOUT", "message": message})
            await self.close(code=CLOSE_TIMEOUT)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        FRAMES_RECEIVED.inc()
        if self.principal is None:
            return
        try:
            message = frames.decode(text_data, bytes_data)
        except frames.UnreadableFrame as refused:
            await self.send_error(refused.request_id, refused.error)
            return
        kind = message.get("type")
        if (isinstance(kind, str) and kind in self.ANSWERED_IN_TURN) or self.worker is None:
            await self.handle(message)
        else:
            # Frames of one connection are independent requests (a worker with
            # capacity N has up to N attempts in flight): run them side by side
            # on the database pool instead of one after another.
            task = asyncio.create_task(self.handle_in_turn(message, asyncio.get_running_loop().time()))
            self.inflight.add(task)
            task.add_done_callback(self.inflight.discard)

    async def handle_in_turn(self, message: dict[str, Any], arrived: float) -> None:
        """Handles a request once one of the connection's turns is free: at
        once when one is (no timer), else within its deadline from `arrived`
        (the event loop's clock), the wait included."""
        turns = self.turns
        deadline = None
        if turns.locked():
            deadline = arrived + REQUEST_DEADLINE_SECONDS
            try:
                async with asyncio.timeout_at(deadline):
                    await turns.acquire()
            except TimeoutError:
                busy = Unavailable(TOO_MANY_IN_FLIGHT.format(seconds=REQUEST_DEADLINE_SECONDS, turns=self.turn_count))
                await self.send_error(message.get("id"), busy)
                return
        else:
            await turns.acquire()  # free: returns at once
        try:
            await self.handle(message, deadline=deadline)
        finally:
            turns.release()

    @property
    def turn_count(self) -> int:
        """How many of the connection's requests run side by side (its capacity is 0 before the hello)."""
        return 2 * self.capacity + REQUESTS_SIDE_BY_SIDE_MARGIN

    async def handle(self, message: dict[str, Any], deadline: float | None = None) -> None:
        """Answers one request. A `deadline` (the event loop's clock) bounds
        it whatever its kind: it waited for its turn, and is answered within
        the request deadline from its arrival."""
        request_id = message.get("id")
        kind = message.get("type")
        handler = self.HANDLERS.get(kind) if isinstance(kind, str) else None
        try:
            if handler is None:
                raise frames.unknown_type(kind)
            frames.check_request_id(kind, request_id)
            if kind != "hello" and self.worker is None:
                raise StateConflict("send hello first")
            if deadline is None and kind in self.BOUND_BY_THEIR_OWN_DEADLINES:
                reply = await handler(self, message)
            else:
                if deadline is None:
                    deadline = asyncio.get_running_loop().time() + REQUEST_DEADLINE_SECONDS
                try:
                    async with asyncio.timeout_at(deadline):
                        reply = await handler(self, message)
                except TimeoutError:
                    raise Unavailable(DATABASE_TOO_SLOW) from None
            if reply is not None:
                await self.send_json({"type": f"{kind}.ok", "reply_to": request_id, **reply})
        except Exception as exc:  # every failure becomes an error frame, never a dropped connection
            error = translate(exc)
            if error is None:
                logger.exception("worker message %s failed", kind)
                error = OrbitError("internal error")
            await self.send_error(request_id, error)
            if kind == "hello" and isinstance(error, StateConflict) and self.worker is None:
                await self.close(code=CLOSE_CONFLICT)
            elif isinstance(error, Unauthenticated):  # revoked since the handshake
                await self.close(code=CLOSE_UNAUTHENTICATED)

    async def send_json(self, content: dict[str, Any]) -> None:
        await self.send(text_data=compact_json(content))

    # AsyncWebsocketConsumer.send's signature, which the stubs too mark as overriding AsyncConsumer's.
    async def send(  # type: ignore[override]
        self, text_data: str | None = None, bytes_data: bytes | None = None, close: bool = False
    ) -> None:
        FRAMES_SENT.inc()
        try:
            await super().send(text_data=text_data, bytes_data=bytes_data, close=close)
        except Disconnected:
            # The close handshake has begun: the worker would never read the
            # frame. Raised on, it would end the consumer before its disconnect.
            self.closing = True

    async def close(self, code: int | bool | None = None, reason: str | None = None) -> None:
        self.closing = True
        await super().close(code=code, reason=reason)

    async def send_error(self, request_id: Any, error: OrbitError) -> None:
        frame: dict[str, Any] = {"type": "error", "code": error.code, "message": error.message, **error.details}
        if frames.answerable(request_id):  # an id the request was refused for is not echoed
            frame["reply_to"] = request_id
        await self.send_json(frame)

    # --- messages -------------------------------------------------------

    async def on_hello(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.worker is not None:
            raise StateConflict("hello was already received on this connection")
        hello = frames.hello(message)
        principal = self.principal
        assert principal is not None
        principal.require("workers:consume")
        session_id = new_id()
        handlers = tuple((h["handler"], h.get("handler_version", ANY_VERSION)) for h in hello.get("handlers", []))
        queue_ids = list(dict.fromkeys(hello["queues"]))
        identity_id = await run_db(
            register_worker,
            principal=principal,
            worker_id=hello["worker_id"],
            session_id=session_id,
            concurrency_keys=hello["concurrency_keys"],
            queue_ids=queue_ids,
            handlers=handlers,
            capacity=hello["capacity"],
        )
        self.worker = WorkerContext(
            namespace_id=principal.namespace_id,
            application_id=principal.application_id,
            worker_id=hello["worker_id"],
            session_id=session_id,
            queue_ids=tuple(queue_ids),
            handlers=handlers,
            concurrency_keys=hello["concurrency_keys"],
            identity_id=identity_id,
            consumable=principal.queue_ids,
            credential=self.credential,
            cell=cells.entered(),
        )
        self.capacity = hello["capacity"]
        self.turns = asyncio.Semaphore(self.turn_count)
        held = await run_db(dispatch.held_assignments, worker=self.worker)
        if self.closing:
            # Decided while the connection closed (its hello deadline, say): no
            # lease loop or heartbeat for a connection that is going. Its
            # disconnect, handled next, ends the session.
            raise StateConflict("the connection closed during its hello")
        self.held = {entry["attempt_id"] for entry in held}
        self.running = {entry["attempt_id"] for entry in held if entry["state"] == "RUNNING"}
        self.handlers, self.keyed = {}, set()
        for entry in held:
            self.track(entry["attempt_id"], entry)
        registry.register(self.wake, asyncio.get_running_loop(), queue_ids, idle=lambda: not self.held)
        self.dispatcher = asyncio.create_task(self.dispatch_loop())
        self.heartbeat = asyncio.create_task(self.heartbeat_loop())
        return {
            "session_id": session_id,
            "lease_seconds": DEFAULT_LEASE_SECONDS,
            "renew_seconds": RENEW_SECONDS,
            "held": held,
        }

    async def on_ack(self, message: dict[str, Any]) -> None:
        self.acknowledged(frames.field(message, "attempt_id", str))
        return None

    def acknowledged(self, attempt_id: str) -> None:
        self.undelivered.pop(attempt_id, None)
        entry = self.unacked.pop(attempt_id, None)
        if entry is None:
            return
        held_back = len(self.unacked) + 1 >= UNACKED_MAX or self.unacked_bytes >= UNACKED_MAX_BYTES
        self.unacked_bytes -= entry.size
        if held_back:  # the dispatcher waits for this room; otherwise an ack changes nothing it decides on
            self.wake.set()

    def attempt_ref(self, message: dict[str, Any]) -> frames.AttemptRef:
        ref = frames.attempt_ref(message)
        self.acknowledged(ref["attempt_id"])  # a frame naming the attempt shows it was read
        return ref

    async def on_start(self, message: dict[str, Any]) -> dict[str, Any]:
        ref = self.attempt_ref(message)
        try:
            assert self.worker is not None
            receipt = await rounds.approve_start_async(worker=self.worker, **ref)
            self.running.add(ref["attempt_id"])
            return receipt
        except (LeaseLost, TaskCancelled):
            await self.forget_if_gone(ref["attempt_id"])
            raise

    async def on_renew(self, message: dict[str, Any]) -> dict[str, Any]:
        ref = self.attempt_ref(message)
        try:
            return await run_db(dispatch.renew_lease, worker=self.worker, **ref)
        except OrbitError:
            await self.forget_if_gone(ref["attempt_id"])
            raise

    async def forget_if_gone(self, attempt_id: str) -> None:
        """Frees the slot only if the attempt is really gone: a request with a
        wrong epoch must not make the server forget an attempt this worker still
        holds (it would then assign past capacity, or close a draining
        connection that still holds work)."""
        assert self.worker is not None
        held = await run_db(dispatch.held_attempt_ids, worker=self.worker)
        if attempt_id not in held:
            self.forget(attempt_id)

    async def on_resume(self, message: dict[str, Any]) -> dict[str, Any]:
        ref = self.attempt_ref(message)
        entry = await run_db(dispatch.resume_attempt, worker=self.worker, **ref)
        self.held.add(ref["attempt_id"])
        if entry["state"] == "RUNNING":
            self.running.add(ref["attempt_id"])
        self.track(ref["attempt_id"], entry)
        return {"assignment": entry}

    async def on_result(self, message: dict[str, Any]) -> dict[str, Any] | None:
        ref = self.attempt_ref(message)
        fields = frames.result(message)
        start_ahead_for = self.handlers.get(ref["attempt_id"]) if frames.start_next(message) else None
        assert self.worker is not None
        report = endings.ResultReport(worker=self.worker, **fields, **ref)
        # The slot a result frees is filled in its own round when the worker
        # will run at once what it is given (start_next: the lease starts it
        # ahead) or when the result releases a key (handed on at once). An
        # unkeyed result without start_next leaves its slot to the
        # dispatcher, which waits a moment to lease for several at once: what
        # it leases would wait for a Start round of its own anyway.
        # A copy of a result already on its way (a replay) frees no second
        # slot: it is only answered, from the record.
        leaving = ref["attempt_id"] in self.running and ref["attempt_id"] not in self.ending
        hands_off = ref["attempt_id"] in self.keyed or start_ahead_for is not None
        started_only = False
        if hands_off and leaving and self.free_slots(leaving=1) <= 0:
            # Past the bounds on unacknowledged assignments, a result that sent
            # its next Start ahead still hands off, taking only what it starts.
            started_only = start_ahead_for is not None and self.free_slots(leaving=1, started=True) > 0
            hands_off = started_only
        if not hands_off or not leaving or self.draining:
            reply = await rounds.record_result_async(report)
            if ref["attempt_id"] not in self.ending:
                # (the hand-off in flight frees that slot once its lease is in)
                self.forget(ref["attempt_id"])
            return reply
        self.ending.add(ref["attempt_id"])
        # Hand-off: the result's round also leases one task for this
        # connection, so the key the result releases goes on to its next task
        # in the same transaction (and with start_next the next task starts
        # there too), and the assignment leaves right behind the answer
        # instead of a wake-up and a round later. Several results' hand-offs
        # run side by side, each into its own result's slot.
        self.handoffs += 1
        self.started_handoffs += started_only
        self.no_handoffs.clear()
        assignments: list[dict[str, Any]] = []
        sent: set[str] = set()
        try:
            recorded, leased = await rounds.record_result_and_lease_async(
                report, limit=1, start_ahead_for=start_ahead_for, started_only=started_only
            )
            assignments = leased.assignments if isinstance(leased, LeaseOutcome) else []
            if isinstance(recorded, BaseException):
                # Refused: its attempt may still hold the slot, and its hand-off
                # took nothing (rounds.LeaseRequest.after).
                raise recorded
            # The answer and the assignment go out together, not interleaved
            # with another hand-off's (one write, as the loop sends them).
            async with self.handoff_sending:
                # A lease decided after the result that found nothing left
                # over: the dispatcher would find nothing either.
                exhausted = isinstance(leased, LeaseOutcome) and not leased.more
                self.forget(ref["attempt_id"], wake=not exhausted)
                # The freed slot stays taken until its assignment is sent
                # (send_assignment counts it held before it awaits).
                self.reserved += len(assignments)
                unsent = len(assignments)
                try:
                    await self.send_json({"type": "task.result.ok", "reply_to": message.get("id"), **recorded})
                    for entry in assignments:
                        if self.closed or self.closing:
                            break
                        self.reserved -= 1
                        unsent -= 1
                        await self.send_assignment(entry)
                        sent.add(entry["attempt_id"])
                finally:
                    self.reserved -= unsent
            if isinstance(leased, BaseException) and not isinstance(leased, Exception):
                raise leased  # cancelled: the connection is closing
            # A refused lease (superseded, revoked, database down) is the
            # dispatcher's to find out and act on at its next lease.
        finally:
            if self.closed or self.closing:
                # The connection went while this hand-off decided or sent:
                # what it never delivered goes back (a Start included).
                await self.hand_back(
                    [e for e in assignments if e["attempt_id"] not in sent or e["attempt_id"] in self.undelivered],
                    reason=TAKEN_BACK_ON_CLOSE,
                )
            self.ending.discard(ref["attempt_id"])
            self.handoffs -= 1
            self.started_handoffs -= started_only
            if not self.handoffs:
                self.no_handoffs.set()
        return None

    async def hand_back(self, assignments: list[dict[str, Any]], reason: str) -> None:
        """Releases leases this connection will not deliver, taking back the
        Start of those started ahead."""
        if not assignments:
            return  # e.g. a connection closed before its hello: nothing was leased for it
        assert self.worker is not None
        for entry in assignments:
            self.undelivered.pop(entry["attempt_id"], None)
            with contextlib.suppress(Exception):  # ended meanwhile: nothing to hand back
                await run_db(
                    endings.release_attempt,
                    worker=self.worker,
                    attempt_id=entry["attempt_id"],
                    epoch=entry["epoch"],
                    reason=reason,
                    undelivered_start=entry.get("state") == "RUNNING",
                )

    def free_slots(self, leaving: int = 0, *, started: bool = False) -> int:
        """Assignments this connection may be sent now (`leaving`: held
        attempts whose end is being recorded): its capacity, less the slots
        of hand-offs about to send their assignment, and the bounds on what it
        has not acknowledged yet, less what the hand-offs in flight may add.
        `started`: assignments that arrive started, which the bounds on
        unacknowledged ones do not limit (a started one is never unacknowledged)."""
        room = self.capacity - len(self.held) - self.reserved + leaving
        if started:
            return room
        if self.unacked_bytes >= UNACKED_MAX_BYTES:
            return 0
        return min(room, UNACKED_MAX - len(self.unacked) - (self.handoffs - self.started_handoffs))

    async def on_release(self, message: dict[str, Any]) -> dict[str, Any]:
        # Read before attempt_ref counts this frame as the acknowledgement
        # (and refuses an attempt_id that is no string: a list is no key).
        attempt_id = message.get("attempt_id")
        undelivered = isinstance(attempt_id, str) and attempt_id in self.undelivered
        ref = self.attempt_ref(message)
        reason = frames.release_reason(message)
        reply = await run_db(
            endings.release_attempt, worker=self.worker, reason=reason, undelivered_start=undelivered, **ref
        )
        self.forget(ref["attempt_id"])
        return reply

    async def on_drain(self, message: dict[str, Any]) -> dict[str, Any]:
        await run_db(authenticate_token, self.token)  # revocation takes effect at every request
        async with self.lease_lock:
            self.draining = True
        # A hand-off that began before the drain sends its assignments before drain.ok.
        await self.no_handoffs.wait()
        self.wake.set()
        return {}

    # Frames handled before the next one is read: hello (nothing else may
    # run before it), and the ack, which reads no row (a task per frame would
    # cost more than its handling).
    ANSWERED_IN_TURN = frozenset({"hello", "task.assign.ack"})
    # Frames whose handling needs no deadline of its own: the ack awaits
    # nothing, and a result awaits only its round (and, on a closing
    # connection, the hand-back of its hand-off), each within the request
    # deadline already. A timer each was ~5% of the event loop in a drain.
    BOUND_BY_THEIR_OWN_DEADLINES = frozenset({"task.assign.ack", "task.result"})

    HANDLERS = {
        "hello": on_hello,
        "task.assign.ack": on_ack,
        "task.start": on_start,
        "task.renew": on_renew,
        "task.resume": on_resume,
        "task.result": on_result,
        "task.release": on_release,
        "drain": on_drain,
    }

    # --- dispatch -------------------------------------------------------

    def track(self, attempt_id: str, entry: dict[str, Any]) -> None:
        """Notes a held attempt's handler and version, and whether its task is keyed."""
        self.handlers[attempt_id] = handler_of(entry)
        if "concurrency_token" in entry:
            self.keyed.add(attempt_id)

    def forget(self, attempt_id: str, *, wake: bool = True) -> None:
        self.held.discard(attempt_id)
        self.running.discard(attempt_id)
        self.handlers.pop(attempt_id, None)
        self.keyed.discard(attempt_id)
        if wake:
            self.wake.set()

    async def dispatch_loop(self) -> None:
        """Leases while there is free capacity; sleeps until woken or the poll interval."""
        assert self.worker is not None
        while not self.closing:
            try:
                wait = POLL_INTERVAL_SECONDS
                if await self.close_if_not_reading():  # draining or not: a drain leases nothing more
                    return
                if self.draining:
                    if not self.held:
                        await self.close(code=1000)
                        return
                else:
                    free = self.free_slots()
                    if free > 0:
                        async with self.lease_lock:
                            assignments = []
                            if not self.draining:
                                try:
                                    outcome = await rounds.lease_for_worker_async(worker=self.worker, limit=free)
                                except StateConflict as superseded:
                                    await self.close_superseded(superseded)
                                    return
                                except Unauthenticated as revoked:
                                    await self.send_error(None, revoked)
                                    await self.close(code=CLOSE_UNAUTHENTICATED)
                                    return
                                except Unavailable as unavailable:
                                    if unavailable.message == cells.MOVING:
                                        # Intake stopped while the application moves: its running
                                        # attempts still report here; leases wait for the move.
                                        await asyncio.sleep(unavailable.retry_after or 1)
                                        continue
                                    if unavailable.message != cells.MOVED_AWAY:
                                        raise
                                    await self.close_moved(unavailable)
                                    return
                                assignments = outcome.assignments
                                if outcome.rate_reopens_in is not None:
                                    # Come back when the start window reopens, not a poll later.
                                    wait = min(wait, max(outcome.rate_reopens_in, 0.001))
                            for entry in assignments:
                                await self.send_assignment(entry)
                        if len(assignments) == min(free, LEASE_BATCH_MAX):
                            continue  # a full batch: there may be more right now
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), wait)
                    if self.held and self.capacity - len(self.held) < min(self.capacity, LEASE_BATCH_MAX) // 2:
                        # Busy worker, one slot freed: let a few more results land
                        # so one lease transaction fills several slots.
                        await asyncio.sleep(LEASE_GATHER_SECONDS)
                    continue
                await self.on_idle()
            except asyncio.CancelledError:
                raise
            except Exception:  # database down or similar: keep the connection, retry later
                logger.warning("dispatch cycle failed", exc_info=True)
                await asyncio.sleep(1.0)

    async def send_assignment(self, entry: dict[str, Any]) -> None:
        frame = compact_json({"type": "task.assign", "id": entry["attempt_id"], **entry})
        if entry.get("state") == "RUNNING":
            # Started with its lease, at the worker's word (a result's
            # start_next): it asked for this one in a frame of its own, so it
            # is not counted as unacknowledged; but until it is acknowledged,
            # no handler has run it (disconnect takes it back).
            self.running.add(entry["attempt_id"])
            self.undelivered[entry["attempt_id"]] = entry["epoch"]
        else:
            bound = min(ACK_TIMEOUT_SECONDS, seconds_until(entry["lease_expires_at"]))
            self.unacked[entry["attempt_id"]] = Unacknowledged(entry["epoch"], time.monotonic() + bound, len(frame))
            self.unacked_bytes += len(frame)
        self.held.add(entry["attempt_id"])
        self.track(entry["attempt_id"], entry)
        await self.send(text_data=frame)

    async def close_if_not_reading(self) -> bool:
        """Closes a connection that left an assignment unacknowledged past its
        bound, releasing its unacknowledged (so unstarted) leases now: their
        tasks go to workers that read, not back to this one after expiry."""
        now = time.monotonic()
        if not any(entry.overdue_at <= now for entry in self.unacked.values()):
            return False
        assert self.worker is not None
        unacked, self.unacked, self.unacked_bytes = self.unacked, {}, 0
        for attempt_id, entry in unacked.items():
            with contextlib.suppress(Exception):  # started, ended or expired meanwhile: nothing to hand back
                await run_db(
                    endings.release_attempt,
                    worker=self.worker,
                    attempt_id=attempt_id,
                    epoch=entry.epoch,
                    reason="assignment not acknowledged",
                )
        message = (
            f"{len(unacked)} assignments not acknowledged within {ACK_TIMEOUT_SECONDS:g} s"
            " (or before their lease ended); their leases were released"
        )
        await self.send_json({"type": "error", "code": "ACK_TIMEOUT", "message": message})
        await self.close(code=CLOSE_TIMEOUT)
        return True

    async def close_moved(self, error: Unavailable) -> None:
        """The application moved to another cell and this connection entered the
        old one: the worker's reconnect enters the new one."""
        await self.send_error(None, error)
        await self.close(code=CLOSE_MOVED)

    async def close_superseded(self, error: StateConflict) -> None:
        """A newer connection of this worker_id took over (this one is a
        half-open leftover, or its worker reconnected): it leases no more."""
        await self.send_error(None, error)
        await self.close(code=CLOSE_CONFLICT)

    async def on_idle(self) -> None:
        """Reconciles held attempts with the database (leases recovered
        elsewhere), and hands back what this connection's own rounds leased
        for it but it never sent: a round that outlives its request's deadline
        commits after its caller was answered UNAVAILABLE, and what it leased
        (a result's hand-off, started ahead, or the dispatcher's lease) was
        never delivered. Only with no lease or hand-off of its own in flight,
        whose assignments are on their way."""
        assert self.worker is not None
        found = await run_db(dispatch.held_attempts, worker=self.worker)
        never_sent = []
        if not self.handoffs and not self.lease_lock.locked() and not self.closing:
            never_sent = [
                {"attempt_id": attempt.attempt_id, "epoch": attempt.epoch, "state": attempt.state}
                for attempt in found
                if attempt.session_id == self.worker.session_id
                and attempt.attempt_id not in self.held
                and (attempt.state == AttemptState.LEASED or attempt.started_ahead)
            ]
            await self.hand_back(never_sent, reason=NEVER_SENT)
        gone = {entry["attempt_id"] for entry in never_sent}
        self.held = {attempt.attempt_id for attempt in found} - gone
        self.running &= self.held
        self.handlers = {attempt_id: pair for attempt_id, pair in self.handlers.items() if attempt_id in self.held}
        self.keyed &= self.held

    async def heartbeat_loop(self) -> None:
        """Marks the session alive (workers.actions: a live session is not
        taken over by a credential of another range) and re-checks the
        credential between requests (each grant re-checks it anyway)."""
        assert self.worker is not None and self.worker.identity_id is not None and self.principal is not None
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            try:
                current = await run_db(
                    mark_session_alive, identity_id=self.worker.identity_id, session_id=self.worker.session_id
                )
                if not current:
                    if cells.configured() and not await run_db(application_here, self.principal.application_id):
                        # Moved to another cell with the identity's row: not superseded, elsewhere.
                        await self.close_moved(Unavailable(cells.MOVED_AWAY, retry_after=1))
                    else:
                        await self.close_superseded(StateConflict(SUPERSEDED))
                    return
                await run_db(authenticate_token, self.token)
            except Unavailable:  # database too slow: the next beat tries again
                logger.warning("worker heartbeat: database did not answer in time")
            except OrbitError as error:
                await self.send_error(None, error)
                await self.close(code=CLOSE_UNAUTHENTICATED)
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # database down: the next beat tries again
                logger.warning("worker heartbeat failed", exc_info=True)
