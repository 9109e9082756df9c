"""Group commit: many requests of one lane (an application) in one transaction.

Every submit, start and result of an application locks that application's (or
its queues') counter rows first, so concurrent requests of one kind queue up on
the same lock anyway. A lane's thread instead takes whatever has gathered while
its previous transaction ran and applies it as one group: one lock hand-off and
one commit (one redo fsync) for many requests. A lone request commits at once:
nothing waits for company, with two exceptions. The first few of a crowd
that just went through in one group (fewer callers than it had, within
FOLLOW_SECONDS of its end) wait up to GATHER_SECONDS for the rest of it. And
after a group with a crowd of callers that wait for their answers before
sending more (submitters: CROWD_CALLERS or more), the next group waits up to
CROWD_GATHER_SECONDS for as many of them, so that crowd goes through in
fewer, larger groups.
Workers answer a group's replies one by one; without the wait, the first
answer goes alone, the crowd splits into two groups, and the split keeps
itself up cycle after cycle (W2 at 10 keys: four rounds per cycle of ten
keyed tasks instead of two). A lane whose owner tells the phases of its
entries apart (`phase`: results that hand their key on with the worker's next
assignment, and the Starts that answer assignments) also keeps such a crowd in
step: the Starts of a group with hand-ons wait one group for the hand-ons' own
Starts, a worker's trip later, instead of the two parts taking turns in mixed
groups. The callers waiting on one event loop get a group's outcomes in one
hand-off to that loop, not one wake-up each.

The group function returns one outcome per item (a value or the exception that
refused that item), so one item's refusal never fails its neighbours. Should a
whole group fail unexpectedly, each item is tried again on its own, so a
poisonous item cannot take others down with it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue
from typing import Any, Generic, Literal, TypeVar

from django.db import InterfaceError, OperationalError, connection

from orbit.db import inline
from orbit.db.pool import (
    DATABASE_TOO_SLOW,
    REQUEST_DEADLINE_SECONDS,
    call_guarded,
    each_within_deadline,
    run_db,
    within_deadline,
)
from orbit.errors import Unavailable
from orbit.metrics import GROUPS_DECIDED

logger = logging.getLogger("orbit.groupcommit")

# A group smaller than the lane's previous one, arriving within FOLLOW_SECONDS
# of its end, waits up to GATHER_SECONDS for the rest of that crowd; the next
# requests of a group's hand-ons, up to FOLLOW_HOP_SECONDS from its end for
# the first of them (a worker's trip).
FOLLOW_SECONDS = 0.05
GATHER_SECONDS = 0.002
FOLLOW_HOP_SECONDS = 0.005
# A group that follows (within FOLLOW_SECONDS) one with at least
# CROWD_CALLERS callers answered first (GroupCommit's `answer_first`: callers
# that send nothing more until they hear back, such as submitters) waits up to
# CROWD_GATHER_SECONDS from its first entry until as many such callers are
# back. They come back a hop after each group's answers; without the wait a
# group takes the few back already and the rest queue for the next, so groups
# stay small and each pays its fixed statements and Python. With it, the same
# callers wait about as long (behind one short wait instead of one more
# group) in fewer, larger groups, for less CPU a request. A lane without such
# a crowd (a worker's keyed hand-offs, a drain, a lone request) starts its
# groups as before.
CROWD_CALLERS = 4
CROWD_GATHER_SECONDS = 0.008

I = TypeVar("I")  # noqa: E741 - the item type of a group
R = TypeVar("R")

GroupFunction = Callable[[list[I]], list["R | BaseException"]]
# Where a caller's entry (the items it put together) stands in its cycle
# (GroupCommit's `phase`): a HAND_ON's answer makes its caller send a NEXT
# request at once (a result whose group also leased the worker's next task,
# and the Start that answers the assignment); None is neither.
Phase = Literal["hand_on", "next"] | None
HAND_ON: Phase = "hand_on"
NEXT: Phase = "next"


def unwrap(outcome: R | BaseException) -> R:
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


@dataclass
class _Request(Generic[I, R]):
    """An item and where its outcome goes: a concurrent Future (a caller on a
    thread), or an asyncio Future (a caller on that future's event loop).
    `deadline`: when its caller stops waiting (time.monotonic())."""

    item: I
    future: Future[R] | asyncio.Future[R]
    deadline: float = field(default_factory=lambda: time.monotonic() + REQUEST_DEADLINE_SECONDS)

    def claim(self) -> bool:
        """False if the caller went away (cancelled) before its item ran, or
        its deadline has passed: its caller is answered UNAVAILABLE, if not
        yet then at once (a process that was stopped wakes with both the
        lane and the caller's timer due; the item must not run then, or it
        would commit what its caller was told failed). Once claimed, a
        thread caller can no longer cancel."""
        if time.monotonic() >= self.deadline:
            return False
        if isinstance(self.future, asyncio.Future):
            return not self.future.cancelled()  # a read: the future belongs to its loop
        return self.future.set_running_or_notify_cancel()

    def abandoned(self) -> bool:
        """The caller stopped waiting (its deadline passed) after the item was
        claimed: by the clock, as its timer may not have fired yet."""
        if time.monotonic() >= self.deadline:
            return True
        if isinstance(self.future, asyncio.Future):
            return self.future.cancelled()
        return getattr(self.future, "abandoned", False)


def _settle(future: Future[Any] | asyncio.Future[Any], outcome: Any) -> None:
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _deliver(answers: list[tuple[asyncio.Future[Any], Any]]) -> None:
    """On the event loop: a group's outcomes for the futures still waiting."""
    for future, outcome in answers:
        if not future.done():  # done: cancelled after its item was claimed
            _settle(future, outcome)


class _Lane(Generic[I, R]):
    def __init__(self, owner: GroupCommit[I, R], lane_id: str) -> None:
        self.owner = owner
        self.lane_id = lane_id
        # Requests put together arrive together (GroupCommit.call_together_async).
        self.inbox: SimpleQueue[list[_Request[I, R]]] = SimpleQueue()
        # Entries held back from the previous group (_keep_in_step), decided first in the next.
        self.held: list[list[_Request[I, R]]] = []
        # When the group now deciding began (time.monotonic()), None between groups.
        self.busy_since: float | None = None
        name = f"orbit-{owner.name}-{lane_id[:8]}"
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        decided = GROUPS_DECIDED.labels(lane=self.owner.name)
        # The callers of the lane's previous group (one call_together_async
        # counts once) and how many of them it answered first, when it ended,
        # its hand-ons, and how many entries were waiting when it ended
        # (queued while it decided, or held back: not the next requests of its
        # hand-ons' callers).
        last_callers, last_crowd, last_end, hand_ons, waiting = 0, 0, 0.0, 0, 0
        try:
            while True:
                entries, self.held = self.held, []
                held = len(entries)
                if not entries:
                    try:
                        entries = [self.inbox.get(timeout=self.owner.idle_seconds)]
                    except Empty:
                        if self.owner._retire(self):
                            return
                        continue
                began = time.monotonic()
                if last_crowd >= CROWD_CALLERS and began - last_end < FOLLOW_SECONDS:
                    self._gather_crowd(entries, last_crowd, until=began + CROWD_GATHER_SECONDS)
                self._gather(entries)
                if time.monotonic() - last_end < FOLLOW_SECONDS:
                    if hand_ons:
                        # The hand-ons' callers answer their assignments a hop
                        # after the group's end; what waited already is not them.
                        self._wait_for_crowd(entries, hand_ons, already=waiting, hop_from=last_end)
                    elif len(entries) < last_callers:
                        self._wait_for_crowd(entries, last_callers)
                entries, hand_ons = self._keep_in_step(entries, held)
                # A caller that went away (its connection closed) cancelled its
                # future: its item is skipped; the others are now bound to run.
                group = [request for entry in entries for request in entry if request.claim()]
                if not group:
                    continue
                self.busy_since = time.monotonic()
                decided.inc()
                try:
                    outcomes = self._decide(group)
                except BaseException as exc:  # never leave a caller waiting
                    logger.exception("group commit failed")
                    outcomes = [exc] * len(group)
                finally:
                    self.busy_since = None
                last_callers, last_end = len(entries), time.monotonic()
                last_crowd = sum(1 for entry in entries if self.owner.answer_first(entry[0].item))
                waiting = self.inbox.qsize() + len(self.held)
                _answer(group, outcomes, self.owner.answer_first)
        finally:
            connection.close()  # an idle lane gives its database connection back

    def _wait_for_crowd(
        self, entries: list[list[_Request[I, R]]], crowd: int, *, already: int = 0, hop_from: float | None = None
    ) -> None:
        """The first of a crowd that just went through in one group: the rest
        of it is a moment behind (its workers answer the group's replies one by
        one). Deciding these alone would split the crowd into two groups for
        good, one round more per cycle; waits up to GATHER_SECONDS for the
        others instead (`crowd` entries beyond the first `already`). With
        `hop_from` and none of the crowd here yet, its first may take a hop
        from that time: the wait lasts until FOLLOW_HOP_SECONDS after it."""
        arrived = len(entries) - already
        until = time.monotonic() + GATHER_SECONDS
        awaiting_first = False
        if hop_from is not None and arrived <= 0:
            awaiting_first = True
            until = max(until, hop_from + FOLLOW_HOP_SECONDS)
        while arrived < crowd and (left := until - time.monotonic()) > 0:
            try:
                entries.append(self.inbox.get(timeout=left))
            except Empty:
                break
            arrived += 1
            if awaiting_first:  # the crowd's first is here: the rest is a moment behind it
                awaiting_first = False
                until = max(until, time.monotonic() + GATHER_SECONDS)
        self._gather(entries)

    def _keep_in_step(self, entries: list[list[_Request[I, R]]], held: int) -> tuple[list[list[_Request[I, R]]], int]:
        """The entries to decide now and how many of them are hand-ons.
        Hand-ons (results whose group also leases their caller's next task) and
        next requests (Starts) in one group are two parts of a crowd a phase apart,
        which would take turns in mixed groups for good, each group paying the
        fixed costs of both phases. The next requests are held back one group:
        the hand-ons' own next requests join them there, and from then on each
        phase of the crowd is one group. The first `held` entries were held
        back already and are decided now."""
        phases = [self.owner.phase([request.item for request in entry]) for entry in entries]
        hand_ons = phases.count(HAND_ON)
        if not hand_ons:
            return entries, 0
        hold = {index for index, phase in enumerate(phases) if phase == NEXT and index >= held}
        self.held = [entries[index] for index in sorted(hold)]
        return [entry for index, entry in enumerate(entries) if index not in hold], hand_ons

    def _gather_crowd(self, entries: list[list[_Request[I, R]]], crowd: int, until: float) -> None:
        """Adds what arrives in the inbox until `crowd` of the entries are of
        callers answered first, or until `until` (time.monotonic()), up to
        max_group items."""
        first = self.owner.answer_first
        back = sum(1 for entry in entries if first(entry[0].item))
        items = sum(len(entry) for entry in entries)
        while back < crowd and items < self.owner.max_group and (left := until - time.monotonic()) > 0:
            try:
                entry = self.inbox.get(timeout=left)
            except Empty:
                return
            entries.append(entry)
            items += len(entry)
            back += first(entry[0].item)

    def _gather(self, entries: list[list[_Request[I, R]]]) -> None:
        """Adds what waits in the inbox, up to max_group items."""
        items = sum(len(entry) for entry in entries)
        while items < self.owner.max_group:
            try:
                entry = self.inbox.get_nowait()
            except Empty:
                return
            entries.append(entry)
            items += len(entry)

    def stuck(self) -> bool:
        """Whether the group now deciding has outlived every caller's deadline
        (its connection waits on a database that does not answer)."""
        since = self.busy_since
        return since is not None and time.monotonic() - since > REQUEST_DEADLINE_SECONDS

    def _decide(self, group: list[_Request[I, R]]) -> list[R | BaseException]:
        try:
            self.owner.enter_lane(self.lane_id)
            return call_guarded(self.owner.run_group, [request.item for request in group])
        except (OperationalError, InterfaceError) as exc:
            # The database failed, not an item: each alone would wait on it again.
            return [exc] * len(group)
        except Exception as exc:
            if len(group) == 1:
                return [exc]
            logger.warning("group of %d failed; trying each item alone", len(group), exc_info=True)
            outcomes: list[R | BaseException] = []
            for request in group:
                # A caller past its deadline has its answer already: its item is not tried again.
                outcomes.extend([Unavailable(DATABASE_TOO_SLOW)] if request.abandoned() else self._decide([request]))
            return outcomes


def _answer(group: list[_Request[I, R]], outcomes: list[R | BaseException], first: Callable[[I], bool]) -> None:
    """Each caller its outcome; the callers on one event loop in one hand-off
    (one wake-up of the loop for the whole group, not one per item), those of
    the items `first` picks ahead of the rest."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
    answered = sorted(zip(group, outcomes, strict=True), key=lambda pair: not first(pair[0].item))
    for request, outcome in answered:
        if isinstance(request.future, asyncio.Future):
            by_loop.setdefault(request.future.get_loop(), []).append((request.future, outcome))
        else:
            _settle(request.future, outcome)
    for loop, answers in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, answers)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            logger.warning("%d answers for a closed event loop dropped", len(answers))


class GroupCommit(Generic[I, R]):
    """Applies items through `run_group`, gathering concurrent items of one lane.
    A lane's thread (and its database connection) ends after `idle_seconds`
    without work and is started again by the next item. The callers of the
    items `answer_first` picks get their outcomes ahead of the group's others.
    `enter_lane(lane_id)` runs on the lane's thread before each group (the
    rounds enter their application's cell there)."""

    def __init__(
        self,
        name: str,
        run_group: GroupFunction,
        *,
        max_group: int = 200,
        idle_seconds: float = 60,
        answer_first: Callable[[I], bool] = lambda item: False,
        phase: Callable[[list[I]], Phase] = lambda items: None,
        enter_lane: Callable[[str], None] = lambda lane_id: None,
    ) -> None:
        self.name = name
        self.enter_lane = enter_lane
        self.run_group = run_group
        self.answer_first = answer_first
        self.phase = phase
        self.max_group = max_group
        self.idle_seconds = idle_seconds
        self._lanes: dict[str, _Lane[I, R]] = {}
        self._lock = threading.Lock()

    def enqueue(self, lane_id: str, item: I) -> Future[R]:
        """From any thread: the item's outcome, to come (cancel it to skip the item)."""
        future: Future[R] = Future()
        self._put(lane_id, [_Request(item, future)])
        return future

    def enqueue_for(self, loop: asyncio.AbstractEventLoop, lane_id: str, item: I) -> asyncio.Future[R]:
        """From any thread: the item's outcome, to come on `loop`, the caller's
        event loop (cancel it there to skip the item)."""
        waiter: asyncio.Future[R] = loop.create_future()
        self._put(lane_id, [_Request(item, waiter)])
        return waiter

    def _put(self, lane_id: str, requests: list[_Request[I, R]]) -> None:
        with self._lock:  # a lane retires under this lock, only with an empty inbox
            lane = self._lanes.get(lane_id)
            if lane is None:
                lane = self._lanes[lane_id] = _Lane(self, lane_id)
            if lane.stuck():
                # Its connection gives up within the serving timeouts; until
                # then a request that queued behind it could only time out.
                for request in requests:
                    self._refuse(request)
                return
            lane.inbox.put(requests)

    @staticmethod
    def _refuse(request: _Request[I, R]) -> None:
        error = Unavailable(DATABASE_TOO_SLOW)
        if isinstance(request.future, asyncio.Future):
            request.future.get_loop().call_soon_threadsafe(_deliver, [(request.future, error)])
        else:
            request.future.set_exception(error)

    def _retire(self, lane: _Lane[I, R]) -> bool:
        with self._lock:
            if not lane.inbox.empty():
                return False
            del self._lanes[lane.lane_id]
            return True

    def call(self, lane_id: str, item: I) -> R:
        """From a thread: waits for the item's outcome, UNAVAILABLE past the request deadline."""
        if inline():
            return unwrap(self.run_group([item])[0])
        future = self.enqueue(lane_id, item)
        try:
            return future.result(timeout=REQUEST_DEADLINE_SECONDS)
        except TimeoutError:
            if not future.cancel():  # claimed: it runs, and its outcome goes nowhere
                future.abandoned = True  # type: ignore[attr-defined]
            raise Unavailable(DATABASE_TOO_SLOW) from None

    async def call_async(self, lane_id: str, item: I) -> R:
        """From the event loop: awaits the item's outcome without holding a pool
        thread, UNAVAILABLE past the request deadline."""
        if inline():
            return await run_db(lambda: unwrap(self.run_group([item])[0]))
        return await within_deadline(self.enqueue_for(asyncio.get_running_loop(), lane_id, item))

    async def call_together_async(self, lane_id: str, items: list[I]) -> list[R | BaseException]:
        """call_async for several items put into the lane at once, so one group
        (one transaction) decides them all, unless it is full; each outcome, or
        the exception that refused its item, in order."""
        if inline():
            return await run_db(self.run_group, items)
        loop = asyncio.get_running_loop()
        waiters: list[asyncio.Future[R]] = [loop.create_future() for _ in items]
        self._put(lane_id, [_Request(item, waiter) for item, waiter in zip(items, waiters, strict=True)])
        return await each_within_deadline(waiters)
