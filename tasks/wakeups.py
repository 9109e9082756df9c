"""Wake-ups: a commit that makes work available (a submit, a release) signals
the dispatchers of that queue, in this process and in the other processes of
its `orbit serve --processes N`. Dispatchers also poll, for work made
elsewhere (other nodes, time passing).

The processes of one supervisor find each other through a directory it
creates (`SIBLINGS_DIR_ENV`): each binds a datagram socket there, named by
its pid, when it starts serving (`listen_to_siblings`, server/asgi.py), and a
wake-up goes to every other socket in it as one datagram of queue ids. It wakes the dispatchers there whose
connection holds nothing (a busy one comes back by itself). A wake-up is a
hint: one that cannot be sent at once (a full socket buffer, a sibling
gone) is dropped, and the sibling's poll finds the work.

A round collects its wake-ups (`collected`) and sends, after it commits,
only those its own leases did not make pointless (tasks.actions.rounds)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from django.db import transaction

SIBLINGS_DIR_ENV = "ORBIT_WAKEUP_DIR"
# How long a listing of the siblings' sockets is used before it is read again
# (a restarted sibling binds a new one).
SIBLINGS_REFRESH_SECONDS = 1.0
DATAGRAM_MAX = 60_000
# A process sends its siblings what its commits made available at most this often.
SEND_INTERVAL_SECONDS = 0.005


@dataclass(frozen=True)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    queue_ids: frozenset[str]
    idle: Callable[[], bool]  # whether its connection holds nothing


class _Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[asyncio.Event, _Waiter] = {}

    def register(
        self,
        event: asyncio.Event,
        loop: asyncio.AbstractEventLoop,
        queue_ids: Iterable[str],
        idle: Callable[[], bool] = lambda: True,
    ) -> None:
        with self._lock:
            self._waiters[event] = _Waiter(loop, frozenset(queue_ids), idle)

    def unregister(self, event: asyncio.Event) -> None:
        with self._lock:
            self._waiters.pop(event, None)

    def wake_idle(self, queue_ids: Iterable[str]) -> None:
        """A sibling's wake-up: for the dispatchers whose connection holds
        nothing. A busy one comes back by itself within its own results or its
        poll, and leasing at every sibling commit (a few tasks a time, in
        transactions queued behind the sibling's rounds on the application's
        counter rows) cost W1 a tenth of its rate at two processes."""
        self.wake(queue_ids, idle_only=True)

    def wake(self, queue_ids: Iterable[str], *, idle_only: bool = False) -> None:
        wanted = set(queue_ids)
        with self._lock:
            targets = [
                (event, waiter.loop)
                for event, waiter in self._waiters.items()
                if waiter.queue_ids & wanted and (not idle_only or waiter.idle())
            ]
        for event, loop in targets:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # loop already closed
                self.unregister(event)


class _Siblings:
    """The other server processes of this supervisor (none without one)."""

    def __init__(self, directory: str | None, name: str | None = None) -> None:
        self.directory = directory
        self.name = name or f"{os.getpid()}.sock"
        self._lock = threading.Lock()
        self._sender: socket.socket | None = None
        self._peers: list[str] = []
        self._peers_read_at = -SIBLINGS_REFRESH_SECONDS
        self._listening = False
        self._pending: set[str] = set()
        self._queued = threading.Event()
        self._flusher: threading.Thread | None = None

    def listen(self, deliver: Callable[[list[str]], None]) -> None:
        """Binds this process's socket (once) and hands every wake-up that
        arrives to `deliver`, from a thread of its own."""
        if self.directory is None or self._listening:
            return
        with self._lock:
            if self._listening:
                return
            self._listening = True
            path = os.path.join(self.directory, self.name)
            receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a socket left by a process that had this pid
            try:
                receiver.bind(path)
            except OSError:  # the directory is gone (the supervisor stopped): polling only
                receiver.close()
                return
        thread = threading.Thread(target=self._receive, args=(receiver, deliver), name="orbit-wakeups", daemon=True)
        thread.start()

    @staticmethod
    def _receive(receiver: socket.socket, deliver: Callable[[list[str]], None]) -> None:
        while True:
            try:
                data = receiver.recv(DATAGRAM_MAX)
            except OSError:
                return
            queue_ids = [queue_id for queue_id in data.decode("ascii", "replace").split("\n") if queue_id]
            if queue_ids:
                deliver(queue_ids)

    def send(self, queue_ids: list[str]) -> None:
        """Queues the wake-up for the sender thread: it sends what gathered at
        most every SEND_INTERVAL_SECONDS, so a sibling's listener (which takes
        the GIL from that process's event loop and rounds each time) wakes a
        few hundred times a second at most, not once per commit."""
        if self.directory is None or not queue_ids:
            return
        with self._lock:
            self._pending.update(queue_ids)
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush, name="orbit-wakeups-send", daemon=True)
                self._flusher.start()
        self._queued.set()

    def _flush(self) -> None:
        while True:
            self._queued.wait()
            self._queued.clear()
            with self._lock:
                pending, self._pending = self._pending, set()
            if pending:
                self._send_now(sorted(pending))
            time.sleep(SEND_INTERVAL_SECONDS)

    def _send_now(self, queue_ids: list[str]) -> None:
        payload = "\n".join(queue_ids).encode("ascii", "replace")[:DATAGRAM_MAX]
        sender, peers = self._sender_and_peers()
        for peer in peers:
            try:
                sender.sendto(payload, peer)
            except ConnectionRefusedError:  # its process is gone: nobody will bind that name again
                with contextlib.suppress(OSError):
                    os.unlink(peer)
            except OSError:
                continue  # full, or gone: its poll finds the work

    def _sender_and_peers(self) -> tuple[socket.socket, list[str]]:
        with self._lock:
            if self._sender is None:
                self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sender.setblocking(False)
            now = time.monotonic()
            if now - self._peers_read_at >= SIBLINGS_REFRESH_SECONDS:
                self._peers_read_at = now
                try:
                    names = os.listdir(self.directory or "")
                except OSError:
                    names = []
                self._peers = [
                    os.path.join(self.directory or "", name)
                    for name in names
                    if name.endswith(".sock") and name != self.name
                ]
            return self._sender, self._peers


registry = _Registry()
siblings = _Siblings(os.environ.get(SIBLINGS_DIR_ENV) or None)


def listen_to_siblings() -> None:
    """Wake-ups from the sibling processes reach this process's dispatchers
    (nothing without a supervisor)."""
    siblings.listen(registry.wake_idle)


def notify_work_available(queue_ids: Iterable[str]) -> None:
    """Wakes the dispatchers of these queues, here and in sibling processes
    (call after commit)."""
    woken = list(dict.fromkeys(queue_ids))
    if not woken:
        return
    registry.wake(woken)
    siblings.send(woken)


_collecting = threading.local()


def wake_after_commit(queue_ids: Iterable[str]) -> None:
    """Inside a transaction: these queues' dispatchers are woken once it
    commits; inside `collected`, the collecting round decides."""
    woken: set[str] | None = getattr(_collecting, "queues", None)
    if woken is not None:
        woken.update(queue_ids)
        return
    ids = list(queue_ids)
    transaction.on_commit(lambda: notify_work_available(ids))


@contextlib.contextmanager
def collected() -> Iterator[set[str]]:
    """The queues `wake_after_commit` names inside the block, for the caller
    to wake after its transaction commits (an outer block collects them)."""
    outer: set[str] | None = getattr(_collecting, "queues", None)
    if outer is not None:
        yield outer
        return
    woken: set[str] = set()
    _collecting.queues = woken
    try:
        yield woken
    finally:
        _collecting.queues = None
