"""The attempts a worker holds, from ``task.assign`` to an acknowledged result.

Life of an attempt inside :class:`Attempts`::

    task.assign ──ack──▶ leased ──task.start──▶ running ──handler──▶ reporting ──task.result.ok──▶ gone
         │                 │  RATE_LIMITED: wait retry_after_ms, ask again (same attempt, epoch)
         │                 │  QUEUE_PAUSED: back off and ask again for up to one lease, then release
         │                 │  LEASE_LOST / TASK_CANCELLED: dropped, the server already ended it
         │                 └─ draining, or a protocol error: task.release
         └─ state RUNNING (its Start went ahead with a result): ──▶ running

Every result asks the server to start what its answer hands on (``start_next``) unless the
worker drains or stops: such an assignment arrives already started (``state`` RUNNING,
``attempt_number``), and runs at once, one request and one reply fewer per task.

Invariants the code relies on:

* Business code runs only after the server approved that attempt's Start: ``task.start.ok``, or
  an assignment that arrives started. Never once that approval's lease has ended by this machine's
  clock: checked when the frame is read and again where the handler begins.
* A result is re-sent, same content, until ``task.result.ok`` (or a definite refusal), across
  reconnects; the server answers replays from its record.
* Every held attempt (leased, running or reporting) is renewed once a third of its remaining
  lease has passed (never later than ``renew_seconds``), so short leases are kept too. A renewal
  answered "not now" (UNAVAILABLE, INTERNAL) is asked again after a doubling delay, still within
  a third of what is left of the lease; any other unexpected answer waits for the next turn.
* A renewal that reports ``cancel_requested``, or a lost lease, reaches the handler through
  its :class:`Execution`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from orbit_sdk._connection import Abandoned, Connection, Link, NoAnswer
from orbit_sdk._exceptions import CancelRequested, ProtocolError, RetryableError, UnknownOutcome
from orbit_sdk._models import Dependency, TaskInfo
from orbit_sdk._protocol import (
    TRANSIENT_CODES,
    Assignment,
    attempt_frame,
    changes,
    error_code,
    failure,
    ids_of,
    lease_end,
    parse_assignment,
    retry_after,
    success,
)
from orbit_sdk.fencing import headers_for


class WorkerSettings(Protocol):
    """What the attempts read of their Worker (orbit_sdk._worker.Worker)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def namespace_id(self) -> str | None: ...
    @property
    def concurrency_keys(self) -> bool: ...


logger = logging.getLogger("orbit_sdk.worker")

Handler = Callable[["Execution"], Any]

RENEW_TICK_SECONDS = 0.25  # how often the renewer looks for attempts whose renewal is due
MIN_RENEW_DELAY = 0.2  # seconds; floor for a renewal's delay when a lease is nearly over
QUEUE_PAUSED_BACKOFF = 0.5  # seconds before asking Start again on a paused queue; doubles up to renew_seconds
TRANSIENT_BACKOFF = 0.5  # seconds after UNAVAILABLE/INTERNAL; doubles up to renew_seconds
# A task no handler of this worker serves is handed back after this long, not at once: with
# bare handler names the hello advertises every handler, and the server would assign the same
# task straight back (a lease and release a few milliseconds apart, forever).
NO_HANDLER_HOLD_SECONDS = 1.0


class Execution:
    """What a handler gets: the task, its attempt, and the cancellation signal.

    The signal is set when a renewal reports ``cancel_requested`` or when the lease is lost;
    check it with :attr:`cancelled`, :meth:`raise_if_cancelled`, :meth:`wait_cancelled`
    (blocking, for sync handlers) or ``await`` :meth:`until_cancelled` (async handlers).
    """

    def __init__(
        self,
        worker: WorkerSettings,
        assignment: Assignment,
        attempt_number: int,
        lease_expires_at: datetime.datetime | None,
    ) -> None:
        self.worker = worker
        self.task: TaskInfo = assignment.task
        self.attempt_id: str = assignment.attempt_id
        self.attempt_number: int = attempt_number
        self.epoch: int = assignment.epoch
        self.concurrency_token: int | None = assignment.concurrency_token
        # The permit's slot (0…N−1) on a key of capacity N > 1; None under capacity 1. The
        # fencing guard fences (key, slot), so holders of different slots both write.
        self.concurrency_slot: int | None = assignment.concurrency_slot
        # The task's dependencies in depends_on order, each with its final state and output, as
        # the assignment carried them (SPEC §13): what a join reads. Empty without dependencies.
        self.dependencies: tuple[Dependency, ...] = assignment.dependencies
        # The lease's end as the server last confirmed it: every renewal refreshes it, so a
        # resource can refuse a write from a worker paused past it (orbit_sdk.fencing).
        self.lease_expires_at: datetime.datetime | None = lease_expires_at
        # The credential's namespace (the key's scope): from Worker(namespace_id=...), which
        # Worker.from_credentials_file fills in; None when the worker was not told.
        self.namespace_id: str | None = worker.namespace_id
        self._cancel_requested = False
        self._lease_lost = False
        self._signal_threads = threading.Event()
        self._signal_loop = asyncio.Event()

    def __repr__(self) -> str:
        return f"<Execution attempt={self.attempt_id} task={self.task.id} number={self.attempt_number}>"

    @property
    def payload(self) -> Any:
        return self.task.payload

    @property
    def concurrency_key(self) -> str | None:
        return self.task.concurrency_key

    def fence_headers(self, operation_id: str) -> dict[str, str]:
        """Headers that let a fenced service (``orbit_sdk.fencing`` middleware) guard this write."""
        return headers_for(self, operation_id)

    @property
    def cancel_requested(self) -> bool:
        """The task was cancelled while running (learnt from a renewal): stop and report."""
        return self._cancel_requested

    @property
    def lease_lost(self) -> bool:
        """The server no longer counts this attempt as ours; a result is kept only as late evidence."""
        return self._lease_lost

    @property
    def cancelled(self) -> bool:
        return self._cancel_requested or self._lease_lost

    def raise_if_cancelled(self) -> None:
        if self.cancelled:
            why = "cancel requested" if self._cancel_requested else "lease lost"
            raise CancelRequested(f"attempt {self.attempt_id}: {why}")

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Block (in a sync handler's thread) until cancelled or ``timeout``; True if cancelled."""
        return self._signal_threads.wait(timeout)

    async def until_cancelled(self) -> None:
        """Return once cancelled (for async handlers, on the worker's event loop)."""
        await self._signal_loop.wait()

    def _signal(self) -> None:
        self._signal_threads.set()
        self._signal_loop.set()

    def _mark_cancel_requested(self) -> None:
        self._cancel_requested = True
        self._signal()

    def _mark_lease_lost(self) -> None:
        self._lease_lost = True
        self._signal()


class Attempt:
    """One held attempt, as this process knows it."""

    def __init__(self, assignment: Assignment, handler: Handler | None, generation: int, renew_ceiling: float) -> None:
        self.assignment = assignment
        self.handler = handler
        self.generation = generation  # the connection on which the server last confirmed it
        self.phase = "leased"  # leased → running → reporting
        self.lost = False
        self.cancel_requested = False
        self.release_reason: str | None = None  # set when a protocol error is found before Start
        self.renewing = False
        self.renew_backoff = TRANSIENT_BACKOFF  # after a renewal answered "not now"; doubles
        self.execution: Execution | None = None
        self.attempt_number = assignment.attempt_number or 0
        self.lease_expires_at = assignment.lease_expires_at
        self.wake = asyncio.Event()
        self.renew_due = 0.0
        self.schedule_renewal(renew_ceiling)

    def schedule_renewal(self, ceiling: float) -> None:
        """Renew when a third of the remaining lease has passed, at most `ceiling` from now."""
        delay = ceiling
        if self.lease_expires_at is not None:
            remaining = (self.lease_expires_at - datetime.datetime.now(datetime.UTC)).total_seconds()
            delay = min(ceiling, max(MIN_RENEW_DELAY, remaining / 3))
        self.renew_due = time.monotonic() + delay

    @property
    def id(self) -> str:
        return self.assignment.attempt_id

    @property
    def epoch(self) -> int:
        return self.assignment.epoch

    async def sleep(self, seconds: float) -> None:
        """Sleep, but wake early when the attempt is lost, rejected or the worker drains."""
        try:
            await asyncio.wait_for(self.wake.wait(), timeout=max(seconds, 0.0))
        except TimeoutError:
            pass
        self.wake.clear()


def _lease_over(expires: datetime.datetime | None) -> bool:
    """The lease ended by this machine's clock (nodes run NTP). A frame that waited in the
    socket of a stopped process, or a handler thread that began late, would otherwise run
    business code after the server took the attempt back and gave the key a newer token."""
    return expires is not None and expires <= datetime.datetime.now(datetime.UTC)


class _LeaseOverBeforeBegin(Exception):
    """Raised in place of a handler whose lease ended before it could begin."""


def _not_run(why: str) -> dict[str, Any]:
    """The result of an approved attempt whose handler never began: a retry is safe."""
    return {"outcome": "FAILED", "retryable": True, "error": {"type": "NotRun", "message": why}}


def _begun_within_lease(handler: Handler) -> Handler:
    """`handler`, its lease checked as late as possible: just before it is called (on its own
    thread, for a sync one)."""

    def begin(execution: Execution) -> Any:
        if _lease_over(execution.lease_expires_at):
            raise _LeaseOverBeforeBegin(f"attempt {execution.attempt_id}: lease over before the handler began; not run")
        return handler(execution)

    return begin


def _is_async(handler: Handler) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(type(handler).__call__)


async def _in_daemon_thread(handler: Handler, execution: Execution) -> Any:
    """``handler(execution)`` on a daemon thread of its own; its value or exception, awaited.

    Not ``asyncio.to_thread``: the default executor is joined when ``asyncio.run`` ends, and
    its threads again at interpreter exit, so a handler sleeping 30 s would hold ``run()``
    (and the process) 30 s after a stop meant to be at once. Here a hard stop cancels the
    await and nothing joins the thread: the process may exit while it runs, and whatever it
    returns later is dropped (the attempt is left to its lease).
    """
    loop = asyncio.get_running_loop()
    # The outcome travels as a value, never as the future's exception: one set there is thrown
    # into the attempt's task, and a thrown GeneratorExit closes every coroutine of the attempt
    # instead of reaching the code that reports it (KeyboardInterrupt and SystemExit, re-raised
    # by the task, would end the worker's loop).
    future: asyncio.Future[tuple[Any, BaseException | None]] = loop.create_future()
    context = contextvars.copy_context()  # as to_thread does: the handler sees the caller's context

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled: the worker stopped without waiting for this handler
            return
        future.set_result((value, error))

    def call() -> None:
        value: Any = None
        error: BaseException | None = None
        try:
            value = context.run(handler, execution)
        except StopIteration as exc:  # a Future refuses StopIteration: reported as a coroutine's would be
            error = RuntimeError(f"handler raised StopIteration: {exc}")
            error.__cause__ = exc
        except BaseException as exc:  # every outcome goes back to the loop, which classifies it
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: a stopped worker wants nothing
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=call, name=f"orbit-handler-{execution.attempt_id}", daemon=True).start()
    value, error = await future
    if error is not None:
        raise error  # here, in this frame: it propagates to the caller as any exception does
    return value


class Attempts:
    """Every attempt the worker holds or still has to hand back, and what is done with each.

    All of it runs on the worker's event loop.
    """

    def __init__(
        self,
        worker: WorkerSettings,
        link: Link,
        *,
        handler_for: Callable[[TaskInfo], Handler | None],
        spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]],
        check_finished: Callable[[], None],
    ) -> None:
        self._worker = worker
        self._link = link
        self._handler_for = handler_for
        self._spawn = spawn
        self._check_finished = check_finished
        self.held: dict[str, Attempt] = {}
        self.rejected: dict[str, tuple[int, str]] = {}  # releases not yet acknowledged
        self._unserved: set[tuple[str, str]] = set()  # (handler, version) pairs warned about once
        self.draining = False
        self.stopping = False
        self.renew_kick = asyncio.Event()

    @property
    def _worker_id(self) -> str:
        return self._worker.worker_id

    def drain(self) -> None:
        """No attempt starts from now on: those waiting to start wake and are handed back."""
        self.draining = True
        for attempt in self.held.values():
            if attempt.phase == "leased":
                attempt.wake.set()

    # ------------------------------------------------------------------ assignments

    def on_assign(self, conn: Connection, frame: dict[str, Any]) -> None:
        ids = ids_of(frame)
        if ids is None:
            logger.error("orbit worker %s: protocol error: task.assign without attempt_id/epoch", self._worker_id)
            return
        attempt_id, epoch = ids
        # No task.assign.ack for an unstarted one: the task.start (or
        # task.release) it gets at once acknowledges it (docs/protocol.md).
        known = self.held.get(attempt_id)
        started = frame.get("state") == "RUNNING"
        try:
            assignment = parse_assignment(frame, concurrency_keys=self._worker.concurrency_keys)
        except ProtocolError as exc:
            if known is not None:
                self._conflict(known, f"protocol error: {exc}")
            else:
                self._reject(attempt_id, epoch, f"protocol error: {exc}")
            return
        if known is not None:
            problem = changes(known.assignment, assignment)
            if problem is not None:
                self._conflict(known, f"protocol error: {problem}")
            else:
                known.generation = conn.generation  # a repeated delivery: same attempt, same token
                # Its start already went out: acknowledge this delivery on its own.
                self._link.send_nowait(conn, {"type": "task.assign.ack", "attempt_id": attempt_id})
            return
        if started:
            self._run_started(conn, assignment)
            return
        if attempt_id in self.rejected:
            self._reject(attempt_id, epoch, self.rejected[attempt_id][1])
            return
        if self.draining or self.stopping:
            self._reject(attempt_id, epoch, "draining" if self.draining else "stopping")
            return
        handler = self._handler_for(assignment.task)
        if handler is None:
            self._reject(attempt_id, epoch, "no handler", hold=NO_HANDLER_HOLD_SECONDS)
            pair = (assignment.task.handler, assignment.task.handler_version)
            if pair not in self._unserved:
                self._unserved.add(pair)
                logger.warning(
                    "orbit worker %s: assigned %s %s, which it has no handler for (a bare handler name "
                    "advertises every handler); each such task is handed back after %.1f s",
                    self._worker_id,
                    *pair,
                    NO_HANDLER_HOLD_SECONDS,
                )
            return
        attempt = Attempt(assignment, handler, conn.generation, self._link.renew_seconds)
        self.held[attempt_id] = attempt
        self._spawn(self._drive(attempt))

    def _run_started(self, conn: Connection, assignment: Assignment) -> None:
        """An assignment started ahead, at a result's ``start_next``: it runs now, even while
        draining (a drain lets running work finish). Acknowledged before its handler runs:
        until then the server takes its Start back, should this process die or hand it back."""
        if self.stopping:
            return  # left unacknowledged: the connection's close takes its Start back
        handler = self._handler_for(assignment.task)
        if handler is None or assignment.attempt_number is None:
            why = "no handler" if handler is None else "protocol error: started assignment without attempt_number"
            self._reject(assignment.attempt_id, assignment.epoch, why)
            return
        if _lease_over(assignment.lease_expires_at):
            # Left unacknowledged and handed back: nothing ran. The server has ended it already
            # (the release is refused) or takes its Start back, no attempt consumed.
            self._reject(assignment.attempt_id, assignment.epoch, "lease over before the assignment was read")
            return
        attempt = Attempt(assignment, handler, conn.generation, self._link.renew_seconds)
        attempt.phase = "running"
        self.held[attempt.id] = attempt

        async def acknowledged_then_run() -> None:
            # Written before the handler starts: once the server has read it, a crash here
            # leaves the attempt to its lease (effect unknown), never back in the queue.
            if await self._link.send(conn, {"type": "task.assign.ack", "attempt_id": attempt.id}):
                await self._drive(attempt)
                return
            # Gone before the server read it: it takes the Start back; nothing ran.
            if self.held.get(attempt.id) is attempt:
                del self.held[attempt.id]
            self._check_finished()

        self._spawn(acknowledged_then_run())

    def _reject(self, attempt_id: str, epoch: int, reason: str, hold: float = 0.0) -> None:
        """Hand an attempt back without running anything (after `hold` seconds)."""
        if reason.startswith("protocol error"):
            logger.error("orbit worker %s: %s; releasing attempt %s", self._worker_id, reason, attempt_id)
        else:
            logger.info("orbit worker %s: releasing attempt %s (%s)", self._worker_id, attempt_id, reason)
        self.rejected[attempt_id] = (epoch, reason)
        self._spawn(self._release(attempt_id, epoch, reason, hold))

    def _conflict(self, attempt: Attempt, reason: str) -> None:
        """The server contradicts what it told us about an attempt we hold."""
        if attempt.phase == "leased":
            logger.error("orbit worker %s: %s; the handler will not run", self._worker_id, reason)
            if attempt.release_reason is None:
                attempt.release_reason = reason
            attempt.wake.set()
        else:
            # The handler already runs under the original assignment; keep it and say so.
            logger.error("orbit worker %s: %s; keeping the original assignment", self._worker_id, reason)

    def _lose(self, attempt: Attempt, why: str) -> None:
        if attempt.lost:
            return
        logger.info("orbit worker %s: attempt %s lost (%s)", self._worker_id, attempt.id, why)
        attempt.lost = True
        attempt.wake.set()
        if attempt.execution is not None:
            attempt.execution._mark_lease_lost()

    async def _release(self, attempt_id: str, epoch: int, reason: str, hold: float = 0.0) -> None:
        if hold:
            await asyncio.sleep(hold)
        frame = attempt_frame("task.release", attempt_id, epoch, reason=reason)
        try:
            reply = await self._link.call(frame)
        except NoAnswer:
            return  # still in rejected: released again if the next hello lists it as held
        if reply.get("type") != "task.release.ok":
            logger.warning("orbit worker %s: release of %s answered %s", self._worker_id, attempt_id, error_code(reply))
        if self.rejected.get(attempt_id, (None,))[0] == epoch:
            del self.rejected[attempt_id]
        self._check_finished()

    # ------------------------------------------------------------------ after a hello

    def on_hello(self) -> None:
        """hello.ok gave the lease figures: attempts assigned before it renew by them."""
        for known in self.held.values():
            known.schedule_renewal(self._link.renew_seconds)
        self.renew_kick.set()

    async def reconcile(self, conn: Connection, held_entries: list[Any]) -> None:
        """After hello.ok: match the server's ``held`` list with what this process holds."""
        held: dict[str, Any] = {}
        for entry in held_entries:
            ids = ids_of(entry)
            if ids is None:
                logger.error("orbit worker %s: protocol error: unreadable held entry %r", self._worker_id, entry)
                continue
            held[ids[0]] = entry
        for attempt_id in list(self.rejected):
            if attempt_id not in held:
                del self.rejected[attempt_id]  # the server no longer holds it: nothing to hand back
        for attempt in list(self.held.values()):
            if attempt.generation < conn.generation and attempt.id not in held:
                self._lose(attempt, "not held by the server after reconnect")

        to_resume: list[tuple[Attempt | None, Assignment]] = []
        for attempt_id, entry in held.items():
            epoch = entry["epoch"]
            if attempt_id in self.rejected:
                self._spawn(self._release(attempt_id, epoch, self.rejected[attempt_id][1]))
                continue
            known = self.held.get(attempt_id)
            if known is not None and known.generation >= conn.generation:
                continue
            expected = None if known is None else known.assignment
            assignment = self._checked(entry, expected, known, attempt_id, epoch, "held entry")
            if assignment is not None:
                to_resume.append((known, assignment))

        replies = await asyncio.gather(
            *(self._link.raw_call(conn, attempt_frame("task.resume", a.attempt_id, a.epoch)) for _, a in to_resume)
        )
        for (known, expected), reply in zip(to_resume, replies, strict=True):
            if reply.get("type") != "task.resume.ok":
                if known is not None:
                    self._lose(known, f"resume answered {error_code(reply)}")
                continue
            body = reply.get("assignment") if isinstance(reply.get("assignment"), dict) else reply
            confirmed = self._checked(body, expected, known, expected.attempt_id, expected.epoch, "task.resume.ok")
            if confirmed is None:
                continue
            if known is not None:
                known.generation = conn.generation
            elif (confirmed.state or expected.state) == "RUNNING":
                self._adopt_orphan(confirmed, conn.generation)
            else:
                self._reject(expected.attempt_id, expected.epoch, "not held by this worker process")

    def _checked(
        self,
        body: Any,
        expected: Assignment | None,
        known: Attempt | None,
        attempt_id: str,
        epoch: int,
        where: str,
    ) -> Assignment | None:
        """`body` read as an assignment that must not change `expected` (None:
        nothing to compare with); on a protocol error, the attempt is given up
        (`known`) or handed back, and None returned."""
        try:
            assignment = parse_assignment(body, concurrency_keys=self._worker.concurrency_keys)
            problem = None if expected is None else changes(expected, assignment)
        except ProtocolError as exc:
            problem = str(exc)
        if problem is None:
            return assignment
        if known is not None:
            self._conflict(known, f"protocol error: {where}: {problem}")
        else:
            self._reject(attempt_id, epoch, f"protocol error: {where}: {problem}")
        return None

    def _adopt_orphan(self, assignment: Assignment, generation: int) -> None:
        """A RUNNING attempt of an earlier process with this worker_id: its effect is unknown."""
        logger.warning(
            "orbit worker %s: attempt %s was running in an earlier process; reporting UNKNOWN",
            self._worker_id,
            assignment.attempt_id,
        )
        attempt = Attempt(assignment, None, generation, self._link.renew_seconds)
        attempt.phase = "reporting"
        self.held[attempt.id] = attempt
        result = {
            "outcome": "UNKNOWN",
            "retryable": False,
            "error": {
                "type": "WorkerRestarted",
                "message": "attempt was running in an earlier process with this worker_id; effect unknown",
            },
        }
        self._spawn(self._finish(attempt, self._report(attempt, result)))

    # ------------------------------------------------------------------ one attempt

    async def _finish(self, attempt: Attempt, work: Awaitable[None]) -> None:
        try:
            await work
        finally:
            if self.held.get(attempt.id) is attempt:
                del self.held[attempt.id]
            self._check_finished()

    async def _drive(self, attempt: Attempt) -> None:
        async def work() -> None:
            if attempt.phase == "leased" and not await self._start(attempt):
                return
            attempt.phase = "reporting" if attempt.release_reason or attempt.lost else "running"
            if attempt.phase == "reporting":
                # Start was approved but the attempt must not run here (a protocol error, or the
                # lease went meanwhile): the handler never ran, so a retry is safe.
                result = _not_run(attempt.release_reason or "lease lost before the handler started")
            else:
                result = await self._execute(attempt)
                attempt.phase = "reporting"
            await self._report(attempt, result)

        await self._finish(attempt, work())

    async def _start(self, attempt: Attempt) -> bool:
        """Ask for Start until approved (True) or until the attempt is no longer ours (False)."""
        paused_since: float | None = None
        paused_delay = QUEUE_PAUSED_BACKOFF
        transient_delay = TRANSIENT_BACKOFF
        frame = attempt_frame("task.start", attempt.id, attempt.epoch)
        while True:
            if attempt.release_reason is not None:
                await self._hand_back(attempt, attempt.release_reason)
                return False
            if attempt.lost:
                return False
            if self.draining:
                await self._hand_back(attempt, "draining")
                return False
            try:
                reply = await self._link.call(
                    frame, unless=lambda: attempt.lost or attempt.release_reason is not None or self.draining
                )
            except (NoAnswer, Abandoned):
                continue
            if reply.get("type") == "task.start.ok":
                number = reply.get("attempt_number")
                attempt.attempt_number = number if isinstance(number, int) and not isinstance(number, bool) else 0
                attempt.lease_expires_at = lease_end(reply, "task.start.ok")
                attempt.schedule_renewal(self._link.renew_seconds)
                if _lease_over(attempt.lease_expires_at):
                    self._lose(attempt, "lease over before its task.start.ok was read")
                return True
            code = error_code(reply)
            if code != "QUEUE_PAUSED":
                paused_since, paused_delay = None, QUEUE_PAUSED_BACKOFF
            if code == "RATE_LIMITED":
                # Not approved, nothing recorded: ask again with the same attempt and epoch. The
                # renewer keeps the lease; the server answers LEASE_LOST once it cannot.
                await attempt.sleep(min(retry_after(reply), self._link.lease_seconds))
            elif code == "QUEUE_PAUSED":
                # Short pauses (a configure flicker) should not churn attempts; a long pause should
                # not pin our capacity and the queue's permits: ask again with backoff for up to one
                # lease, renewing meanwhile, then hand the attempt back (no attempt is consumed).
                now = time.monotonic()
                paused_since = now if paused_since is None else paused_since
                if now - paused_since >= self._link.lease_seconds:
                    await self._hand_back(attempt, "queue paused")
                    return False
                await attempt.sleep(paused_delay)
                paused_delay = min(paused_delay * 2, self._link.renew_seconds)
            elif code in ("LEASE_LOST", "TASK_CANCELLED"):
                logger.info("orbit worker %s: start of %s refused: %s", self._worker_id, attempt.id, code)
                return False
            elif code in TRANSIENT_CODES:
                await attempt.sleep(transient_delay)
                transient_delay = min(transient_delay * 2, self._link.renew_seconds)
            else:
                logger.error("orbit worker %s: start of %s refused: %s %s", self._worker_id, attempt.id, code, reply)
                await self._hand_back(attempt, f"start refused: {code}")
                return False

    async def _hand_back(self, attempt: Attempt, reason: str) -> None:
        if self.held.get(attempt.id) is attempt:
            del self.held[attempt.id]
        attempt.phase = "released"
        self.rejected[attempt.id] = (attempt.epoch, reason)
        await self._release(attempt.id, attempt.epoch, reason)

    async def _execute(self, attempt: Attempt) -> dict[str, Any]:
        handler = attempt.handler
        assert handler is not None
        execution = Execution(self._worker, attempt.assignment, attempt.attempt_number, attempt.lease_expires_at)
        attempt.execution = execution
        if attempt.cancel_requested:
            execution._mark_cancel_requested()
        begin = _begun_within_lease(handler)
        try:
            if _is_async(handler):
                value = await begin(execution)
            else:
                value = await _in_daemon_thread(begin, execution)
                if inspect.isawaitable(value):
                    value = await value
        except _LeaseOverBeforeBegin as exc:
            logger.info("orbit worker %s: %s", self._worker_id, exc)
            return _not_run(str(exc))
        except RetryableError as exc:
            return failure("FAILED", True, exc)
        except UnknownOutcome as exc:
            return failure("UNKNOWN", False, exc)
        except CancelRequested as exc:  # the handler stopped as asked: expected, no traceback
            logger.info("orbit worker %s: handler for %s stopped: %s", self._worker_id, attempt.id, exc)
            return failure("FAILED", False, exc)
        except Exception as exc:
            logger.warning("orbit worker %s: handler for %s raised", self._worker_id, attempt.id, exc_info=True)
            return failure("FAILED", False, exc)
        except BaseException as exc:
            # The worker's own cancellation (a hard stop) abandons the attempt: no result.
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise asyncio.CancelledError from exc
            # Anything else the handler raised (SystemExit, KeyboardInterrupt, GeneratorExit, its
            # own CancelledError) is its outcome, as the README's table says: FAILED, reported
            # now, and the worker goes on serving (it must not end every other attempt it holds).
            logger.warning("orbit worker %s: handler for %s raised", self._worker_id, attempt.id, exc_info=True)
            return failure("FAILED", False, exc)
        return success(value)

    async def _report(self, attempt: Attempt, result: dict[str, Any]) -> None:
        """Send the result until acknowledged; the same content every time. Its slot is free
        from then on: unless the worker drains or stops, it asks for the assignment the answer
        may hand on to arrive started (``start_next``), which it then runs at once."""
        if not (self.draining or self.stopping):
            result = {**result, "start_next": True}
        await self._send_result(attempt.id, attempt.epoch, result)

    async def _send_result(self, attempt_id: str, epoch: int, result: dict[str, Any]) -> None:
        frame = attempt_frame("task.result", attempt_id, epoch, **result)
        delay = TRANSIENT_BACKOFF
        while True:
            try:
                reply = await self._link.call(frame)
            except NoAnswer:
                continue
            if reply.get("type") == "task.result.ok":
                logger.info(
                    "orbit worker %s: result for %s acknowledged (task_state=%s duplicate=%s late=%s)",
                    self._worker_id,
                    attempt_id,
                    reply.get("task_state"),
                    reply.get("duplicate"),
                    reply.get("late"),
                )
                return
            code = error_code(reply)
            if code in TRANSIENT_CODES:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._link.renew_seconds)
                continue
            logger.error("orbit worker %s: result for %s refused: %s %s", self._worker_id, attempt_id, code, reply)
            return

    # ------------------------------------------------------------------ renewals

    async def renew_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(
                    self.renew_kick.wait(), timeout=min(RENEW_TICK_SECONDS, self._link.renew_seconds)
                )
                self.renew_kick.clear()
            except TimeoutError:
                pass
            conn = self._link.conn
            if conn is None or not conn.ready:
                continue
            now = time.monotonic()
            for attempt in list(self.held.values()):
                if attempt.lost or attempt.renewing or attempt.generation != conn.generation:
                    continue
                if now < attempt.renew_due:
                    continue
                attempt.renewing = True
                self._spawn(self._renew(conn, attempt))

    async def _renew(self, conn: Connection, attempt: Attempt) -> None:
        try:
            reply = await self._link.raw_call(conn, attempt_frame("task.renew", attempt.id, attempt.epoch))
        except NoAnswer:
            return
        finally:
            attempt.renewing = False
        if reply.get("type") == "task.renew.ok":
            attempt.renew_backoff = TRANSIENT_BACKOFF
            expires = lease_end(reply, "task.renew.ok")
            if expires is not None:
                attempt.lease_expires_at = expires
                if attempt.execution is not None:
                    attempt.execution.lease_expires_at = expires
            attempt.schedule_renewal(self._link.renew_seconds)
            if reply.get("cancel_requested") is True and not attempt.cancel_requested:
                attempt.cancel_requested = True
                if attempt.execution is not None:
                    attempt.execution._mark_cancel_requested()
            return
        code = error_code(reply)
        if code == "LEASE_LOST":
            self._lose(attempt, "renew answered LEASE_LOST")
        elif code in TRANSIENT_CODES:
            # "Not now" (the server is overloaded, a cell moving): asked again after a doubling
            # delay, as a Start refused so is, and never later than a third of what is left of
            # the lease (schedule_renewal), so a renewal still goes out before the lease ends.
            delay = min(attempt.renew_backoff, self._link.renew_seconds)
            attempt.renew_backoff = min(delay * 2, self._link.renew_seconds)
            attempt.schedule_renewal(delay)
            logger.warning(
                "orbit worker %s: renew of %s answered %s; asking again within %.1f s",
                self._worker_id,
                attempt.id,
                code,
                attempt.renew_due - time.monotonic(),
            )
        else:
            # Unexpected: logged, and the renewal waits for its next turn (sending it again on
            # every tick would only repeat the same question several times a second).
            logger.warning("orbit worker %s: renew of %s answered %s", self._worker_id, attempt.id, reply)
            attempt.schedule_renewal(self._link.renew_seconds)
