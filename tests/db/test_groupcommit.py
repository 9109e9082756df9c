"""The group commit engine (orbit.db.groupcommit) on its own: every caller gets
exactly its own outcome, whatever happens to the rest of its group."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

from orbit.db import groupcommit, pool
from orbit.db.groupcommit import GroupCommit
from orbit.errors import Unavailable


def gated(seen: list[list[str]], gate: threading.Event, fail_on: str | None = None):
    def run_group(items: list[str]) -> list[object]:
        if items == ["first"]:
            gate.wait(5)
        seen.append(list(items))
        if fail_on in items and len(items) > 1:
            raise RuntimeError("the whole group fails")
        return [ValueError(item) if item == "refused" else f"done {item}" for item in items]

    return run_group


def held_lane(settings, run_group) -> GroupCommit:
    settings.ORBIT_INLINE_DB = False  # a real lane thread
    return GroupCommit("test", run_group)


def test_a_cancelled_request_is_skipped_and_its_neighbours_are_answered(settings):
    seen: list[list[str]] = []
    gate = threading.Event()
    commit = held_lane(settings, gated(seen, gate))
    first = commit.enqueue("lane", "first")
    time.sleep(0.1)  # the lane is inside the first group now
    gone, kept = commit.enqueue("lane", "gone"), commit.enqueue("lane", "kept")
    assert gone.cancel()
    gate.set()
    assert first.result(5) == "done first"
    assert kept.result(5) == "done kept"
    assert seen == [["first"], ["kept"]]


def test_an_item_past_its_callers_deadline_is_not_run(settings, monkeypatch):
    # A process stopped while items waited (SIGSTOP, a frozen VM) wakes with the lane and the
    # callers' timers due at once: what a caller was told failed must not run (and commit) then.
    seen: list[list[str]] = []
    gate = threading.Event()
    commit = held_lane(settings, gated(seen, gate))
    first = commit.enqueue("lane", "first")
    time.sleep(0.1)  # the lane is inside the first group now
    monkeypatch.setattr(groupcommit, "REQUEST_DEADLINE_SECONDS", 0.2)
    late = commit.enqueue("lane", "late")
    monkeypatch.undo()
    time.sleep(0.3)  # its caller's deadline passes while the lane is held
    kept = commit.enqueue("lane", "kept")
    gate.set()
    assert first.result(5) == "done first" and kept.result(5) == "done kept"
    assert seen == [["first"], ["kept"]]
    assert not late.done()  # never run: its caller's own timeout answers it UNAVAILABLE


def test_one_refused_item_does_not_refuse_its_group(settings):
    seen: list[list[str]] = []
    gate = threading.Event()
    commit = held_lane(settings, gated(seen, gate))
    first = commit.enqueue("lane", "first")
    time.sleep(0.1)
    refused, kept = commit.enqueue("lane", "refused"), commit.enqueue("lane", "kept")
    gate.set()
    assert first.result(5) == "done first"
    assert isinstance(refused.exception(5), ValueError)
    assert kept.result(5) == "done kept"
    assert seen == [["first"], ["refused", "kept"]]


def test_a_failing_group_is_retried_item_by_item(settings):
    seen: list[list[str]] = []
    gate = threading.Event()
    commit = held_lane(settings, gated(seen, gate, fail_on="poison"))
    first = commit.enqueue("lane", "first")
    time.sleep(0.1)
    poison, kept = commit.enqueue("lane", "poison"), commit.enqueue("lane", "kept")
    gate.set()
    assert first.result(5) == "done first"
    assert poison.result(5) == "done poison"  # alone, it goes through
    assert kept.result(5) == "done kept"
    assert seen == [["first"], ["poison", "kept"], ["poison"], ["kept"]]


def test_an_idle_lane_ends_and_the_next_item_starts_it_again(settings):
    settings.ORBIT_INLINE_DB = False
    threads: list[str] = []

    def run_group(items: list[str]) -> list[object]:
        threads.append(threading.current_thread().name)
        return [f"done {item}" for item in items]

    commit = GroupCommit("idle", run_group, idle_seconds=0.2)
    assert commit.enqueue("lane", "a").result(5) == "done a"
    deadline = time.monotonic() + 5
    while "lane" in commit._lanes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "lane" not in commit._lanes
    assert not [t for t in threading.enumerate() if t.name == threads[0]]
    assert commit.enqueue("lane", "b").result(5) == "done b"
    assert len(threads) == 2


def test_callers_on_an_event_loop_get_a_group_s_answers_in_one_wake_up(settings):
    seen: list[list[str]] = []
    gate = threading.Event()
    commit = held_lane(settings, gated(seen, gate))

    async def scenario() -> list[object]:
        loop = asyncio.get_running_loop()
        wake_ups: list[object] = []
        wake = loop.call_soon_threadsafe

        def counted(callback, *args):
            wake_ups.append(callback)
            return wake(callback, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        first = commit.enqueue("lane", "first")  # holds the lane while the others gather
        await asyncio.sleep(0.1)
        waiters = [commit.enqueue_for(loop, "lane", item) for item in ("a", "refused", "b")]
        gone = commit.enqueue_for(loop, "lane", "gone")
        gone.cancel()  # its caller went away before the group ran
        gate.set()
        assert await asyncio.wrap_future(first) == "done first"
        outcomes = await asyncio.gather(*waiters, return_exceptions=True)
        assert len([callback for callback in wake_ups if callback.__name__ == "_deliver"]) == 1
        return outcomes

    done_a, refused, done_b = asyncio.run(scenario())
    assert (done_a, done_b) == ("done a", "done b")
    assert isinstance(refused, ValueError)
    assert seen == [["first"], ["a", "refused", "b"]]


def test_items_put_together_get_their_outcomes_in_order_and_one_group(settings):
    seen: list[list[str]] = []
    gate = threading.Event()
    commit = held_lane(settings, gated(seen, gate))

    async def scenario() -> list[object]:
        first = commit.enqueue("lane", "first")  # holds the lane while the items gather
        await asyncio.sleep(0.1)
        together = asyncio.ensure_future(commit.call_together_async("lane", ["a", "refused", "b"]))
        await asyncio.sleep(0.05)
        gate.set()
        assert await asyncio.wrap_future(first) == "done first"
        return await together

    done_a, refused, done_b = asyncio.run(scenario())
    assert (done_a, done_b) == ("done a", "done b")
    assert isinstance(refused, ValueError)
    assert seen == [["first"], ["a", "refused", "b"]]


def test_items_put_together_past_the_deadline_end_unavailable_and_are_not_run(settings, monkeypatch):
    seen: list[list[str]] = []
    gate = threading.Event()
    commit = held_lane(settings, gated(seen, gate))
    monkeypatch.setattr(pool, "REQUEST_DEADLINE_SECONDS", 0.2)

    async def scenario() -> list[object]:
        first = commit.enqueue("lane", "first")
        await asyncio.sleep(0.1)
        outcomes = await commit.call_together_async("lane", ["late", "later"])  # the lane stays held
        gate.set()
        assert await asyncio.wrap_future(first) == "done first"
        assert await commit.call_together_async("lane", ["kept"]) == ["done kept"]
        return outcomes

    outcomes = asyncio.run(scenario())
    assert [type(outcome) for outcome in outcomes] == [Unavailable, Unavailable]
    assert all(outcome.message == pool.DATABASE_TOO_SLOW for outcome in outcomes)
    assert seen == [["first"], ["kept"]]


def test_a_cancelled_caller_of_items_put_together_leaves_none_of_them_to_run(settings):
    seen: list[list[str]] = []
    gate = threading.Event()
    commit = held_lane(settings, gated(seen, gate))

    async def scenario() -> None:
        first = commit.enqueue("lane", "first")
        await asyncio.sleep(0.1)
        together = asyncio.ensure_future(commit.call_together_async("lane", ["gone", "also gone"]))
        await asyncio.sleep(0.05)
        together.cancel()
        try:
            await together
        except asyncio.CancelledError:
            pass
        gate.set()
        assert await asyncio.wrap_future(first) == "done first"
        assert await commit.call_together_async("lane", ["kept"]) == ["done kept"]

    asyncio.run(scenario())
    assert seen == [["first"], ["kept"]]


def test_a_waiter_cancelled_while_its_group_runs_leaves_the_others_answered(settings):
    first_gate, running, gate = threading.Event(), threading.Event(), threading.Event()
    seen: list[list[str]] = []

    def run_group(items: list[str]) -> list[object]:
        seen.append(list(items))
        if items == ["first"]:
            first_gate.wait(5)
        else:
            running.set()
            gate.wait(5)
        return [f"done {item}" for item in items]

    commit = held_lane(settings, run_group)

    async def scenario() -> object:
        loop = asyncio.get_running_loop()
        first = commit.enqueue("lane", "first")
        await asyncio.sleep(0.1)
        gone, kept = commit.enqueue_for(loop, "lane", "gone"), commit.enqueue_for(loop, "lane", "kept")
        first_gate.set()
        while not running.is_set():
            await asyncio.sleep(0.01)
        gone.cancel()  # too late to skip its item: its answer is dropped, not delivered
        gate.set()
        assert await asyncio.wrap_future(first) == "done first"
        return await asyncio.wait_for(kept, 5)

    assert asyncio.run(scenario()) == "done kept"
    assert seen == [["first"], ["gone", "kept"]]


def test_the_items_picked_to_go_first_are_answered_ahead_of_their_group(settings):
    settings.ORBIT_INLINE_DB = False
    gate = threading.Event()
    seen: list[list[str]] = []
    commit = GroupCommit("first", gated(seen, gate), answer_first=lambda item: item.startswith("submit"))

    async def scenario() -> list[str]:
        loop = asyncio.get_running_loop()
        first = commit.enqueue("lane", "first")
        await asyncio.sleep(0.1)
        answered: list[str] = []
        waiters = [commit.enqueue_for(loop, "lane", item) for item in ("start-1", "submit-1", "result-1", "submit-2")]
        for waiter in waiters:
            waiter.add_done_callback(lambda done: answered.append(done.result()))
        gate.set()
        await asyncio.wrap_future(first)
        await asyncio.gather(*waiters)
        return answered

    answered = asyncio.run(scenario())
    assert answered == ["done submit-1", "done submit-2", "done start-1", "done result-1"]
    assert seen == [["first"], ["start-1", "submit-1", "result-1", "submit-2"]]  # decided in arrival order


def crowd_then(settings, monkeypatch, seen: list[list[str]]) -> GroupCommit:
    """A lane whose last group was a crowd of three callers; a wait for the
    rest of a crowd lasts at most 5 s here, so whether one happened is plain."""
    monkeypatch.setattr(groupcommit, "GATHER_SECONDS", 5.0)
    gate = threading.Event()
    commit = held_lane(settings, gated(seen, gate))
    first = commit.enqueue("lane", "first")
    time.sleep(0.1)  # the lane is inside the first group now
    crowd = [commit.enqueue("lane", name) for name in ("a", "b", "c")]
    gate.set()
    assert first.result(5) == "done first" and [f.result(5) for f in crowd] == ["done a", "done b", "done c"]
    return commit


def test_the_first_of_a_crowd_waits_a_moment_for_the_rest_of_it(settings, monkeypatch):
    seen: list[list[str]] = []
    commit = crowd_then(settings, monkeypatch, seen)
    ahead = commit.enqueue("lane", "d")
    time.sleep(0.2)  # the rest of the crowd, a moment behind
    rest = [commit.enqueue("lane", name) for name in ("e", "f")]
    began = time.monotonic()
    assert [f.result(5) for f in (ahead, *rest)] == ["done d", "done e", "done f"]
    assert seen[2:] == [["d", "e", "f"]]
    assert time.monotonic() - began < 4  # decided once the crowd was whole, not at the end of the wait


def test_a_lone_caller_after_lone_callers_does_not_wait(settings, monkeypatch):
    monkeypatch.setattr(groupcommit, "GATHER_SECONDS", 5.0)
    seen: list[list[str]] = []
    commit = held_lane(settings, gated(seen, threading.Event()))
    assert commit.enqueue("lane", "x").result(5) == "done x"
    began = time.monotonic()
    assert commit.enqueue("lane", "y").result(5) == "done y"
    assert time.monotonic() - began < 4
    assert seen == [["x"], ["y"]]


def test_a_caller_long_after_the_crowd_does_not_wait(settings, monkeypatch):
    monkeypatch.setattr(groupcommit, "FOLLOW_SECONDS", 0.1)
    seen: list[list[str]] = []
    commit = crowd_then(settings, monkeypatch, seen)
    time.sleep(0.3)
    began = time.monotonic()
    assert commit.enqueue("lane", "late").result(5) == "done late"
    assert time.monotonic() - began < 4
    assert seen[2:] == [["late"]]


def stepped_lane(settings, monkeypatch, seen: list[list[str]], gate: threading.Event) -> GroupCommit:
    """A lane whose entries named h-… are hand-ons and n-… next requests; a
    wait for a hand-on's next request lasts up to 5 s here, so whether one
    happened is plain (and a slow machine's scheduling cannot end it)."""
    monkeypatch.setattr(groupcommit, "FOLLOW_HOP_SECONDS", 5.0)
    monkeypatch.setattr(groupcommit, "FOLLOW_SECONDS", 5.0)
    settings.ORBIT_INLINE_DB = False

    def phase(items: list[str]) -> groupcommit.Phase:
        return {"h": groupcommit.HAND_ON, "n": groupcommit.NEXT}.get(items[0][0])

    return GroupCommit("stepped", gated(seen, gate), phase=phase)


def queued_behind_a_group(commit: GroupCommit, gate: threading.Event, names: list[str]) -> list[Future]:
    """Futures of `names`, put into the lane while it decides a first group
    (held there by `gate`, then let go)."""
    first = commit.enqueue("lane", "first")
    time.sleep(0.1)  # the lane is inside the first group now
    queued = [commit.enqueue("lane", name) for name in names]
    gate.set()
    assert first.result(5) == "done first"
    return queued


def after_callers_answered_first(settings, monkeypatch, seen: list[list[str]], count: int) -> GroupCommit:
    """A lane whose last group held `count` callers answered first (s…) among
    six; a crowd's gather lasts 2 s here, so whether one happened is plain."""
    monkeypatch.setattr(groupcommit, "CROWD_GATHER_SECONDS", 2.0)
    monkeypatch.setattr(groupcommit, "FOLLOW_SECONDS", 5.0)
    settings.ORBIT_INLINE_DB = False
    gate = threading.Event()
    commit = GroupCommit("crowd", gated(seen, gate), answer_first=lambda item: item.startswith("s"))
    names = [f"s{n}" for n in range(count)] + [f"w{n}" for n in range(6 - count)]
    assert [f.result(5) for f in queued_behind_a_group(commit, gate, names)] == [f"done {n}" for n in names]
    return commit


def test_after_a_crowd_of_callers_answered_first_a_group_gathers_for_a_moment(settings, monkeypatch):
    seen: list[list[str]] = []
    commit = after_callers_answered_first(settings, monkeypatch, seen, groupcommit.CROWD_CALLERS)
    ahead = commit.enqueue("lane", "s-back")
    time.sleep(0.3)  # the crowd's next requests, a hop behind its first
    behind = commit.enqueue("lane", "s-later")
    assert ahead.result(5) == "done s-back" and behind.result(5) == "done s-later"
    assert seen[2:] == [["s-back", "s-later"]]


def test_the_gather_ends_once_as_many_callers_answered_first_are_back(settings, monkeypatch):
    seen: list[list[str]] = []
    commit = after_callers_answered_first(settings, monkeypatch, seen, groupcommit.CROWD_CALLERS)
    names = [f"s-back-{n}" for n in range(groupcommit.CROWD_CALLERS)]
    began = time.monotonic()
    back = [commit.enqueue("lane", name) for name in names]
    assert [f.result(5) for f in back] == [f"done {name}" for name in names]
    assert time.monotonic() - began < 1.5  # not kept for the rest of the 2 s gather
    assert seen[2:] == [names]


def test_after_fewer_callers_answered_first_a_group_starts_at_once(settings, monkeypatch):
    seen: list[list[str]] = []
    commit = after_callers_answered_first(settings, monkeypatch, seen, groupcommit.CROWD_CALLERS - 1)
    ahead = commit.enqueue("lane", "s-back")
    time.sleep(0.3)
    behind = commit.enqueue("lane", "s-later")
    assert ahead.result(5) == "done s-back" and behind.result(5) == "done s-later"
    assert seen[2:] == [["s-back"], ["s-later"]]


def test_next_requests_beside_a_hand_on_wait_one_group_for_its_own(settings, monkeypatch):
    """Two parts of a crowd a phase apart (a result with its hand-off, the Start
    of another key) are decided in step again: the Start is held back one
    group, and the hand-on's own Start joins it there, before the wait's end."""
    seen: list[list[str]] = []
    gate = threading.Event()
    commit = stepped_lane(settings, monkeypatch, seen, gate)
    hand_on, other_start = queued_behind_a_group(commit, gate, ["h-a", "n-b"])
    assert hand_on.result(5) == "done h-a"
    began = time.monotonic()
    own_start = commit.enqueue("lane", "n-a")  # the hand-on's caller answers its assignment
    assert other_start.result(5) == "done n-b" and own_start.result(5) == "done n-a"
    assert seen == [["first"], ["h-a"], ["n-b", "n-a"]]
    assert time.monotonic() - began < 4  # decided once the hand-on's Start came, not at the end of the wait


def test_a_next_request_is_held_back_once_only(settings, monkeypatch):
    seen: list[list[str]] = []
    gate = threading.Event()
    commit = stepped_lane(settings, monkeypatch, seen, gate)
    hand_on, held = queued_behind_a_group(commit, gate, ["h-a", "n-b"])
    assert hand_on.result(5) == "done h-a"
    later_hand_on = commit.enqueue("lane", "h-c")  # another hand-on, before h-a's Start
    assert held.result(5) == "done n-b" and later_hand_on.result(5) == "done h-c"
    assert seen == [["first"], ["h-a"], ["n-b", "h-c"]]


def test_a_lane_without_phases_decides_what_gathered_together(settings):
    seen: list[list[str]] = []
    gate = threading.Event()
    commit = held_lane(settings, gated(seen, gate))
    queued = queued_behind_a_group(commit, gate, ["h-a", "n-b"])
    assert [f.result(5) for f in queued] == ["done h-a", "done n-b"]
    assert seen == [["first"], ["h-a", "n-b"]]
