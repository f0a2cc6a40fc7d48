"""Work handed to the engine thread from other threads (prompt scoring): each job runs between
scheduler iterations, under the device lock, and its result or error goes to the caller's Future.
The serial lane drains the inbox in the middle of a request, so jobs are only queued there."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Callable


class EngineCalls:
    def __init__(self, lock):
        self._lock = lock
        self._queue: deque = deque()

    def add(self, fn: Callable, fut: Future) -> None:
        self._queue.append((fn, fut))

    def run(self) -> None:
        """On the engine thread, between iterations: every queued job, one at a time."""
        while self._queue:
            fn, fut = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                with self._lock:
                    fut.set_result(fn())
            except Exception as e:  # the caller gets the error; the engine goes on
                fut.set_exception(e)

    def fail(self, error: Exception) -> None:
        """The engine is stopping or dying: every queued job's caller gets ``error``."""
        while self._queue:
            _, fut = self._queue.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)
