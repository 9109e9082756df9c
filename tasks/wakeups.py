"""In-process wake-ups: a submit or release signals this process's dispatchers
of that queue after commit. Dispatchers also poll, for work made elsewhere."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable


class _Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[asyncio.Event, tuple[asyncio.AbstractEventLoop, frozenset[str]]] = {}

    def register(self, event: asyncio.Event, loop: asyncio.AbstractEventLoop, queue_ids: Iterable[str]) -> None:
        with self._lock:
            self._waiters[event] = (loop, frozenset(queue_ids))

    def unregister(self, event: asyncio.Event) -> None:
        with self._lock:
            self._waiters.pop(event, None)

    def wake(self, queue_ids: Iterable[str]) -> None:
        wanted = set(queue_ids)
        with self._lock:
            targets = [(event, loop) for event, (loop, queues) in self._waiters.items() if queues & wanted]
        for event, loop in targets:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # loop already closed
                self.unregister(event)


registry = _Registry()


def notify_work_available(queue_ids: Iterable[str]) -> None:
    """Wakes this process's dispatchers of these queues (call after commit)."""
    registry.wake(queue_ids)
