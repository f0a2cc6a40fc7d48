"""Whether the device is failing the engine's forwards: a thread that is alive but whose steps fail.

Per-row containment keeps the engine thread alive when a forward raises (the rows of that forward fail, the
rest go on), so ``/health`` would stay ok while every request errors. That happens when the device or MLX is
in a bad state: on CUDA, MLX's graph-cache thrashing check throws on every further cache miss once it fires
(README, "CUDA graph cache": 98 of 160 served requests failed that way, ``/health`` stayed ok). ``DeviceHealth``
keeps the outcomes of the last ``window`` forwards (decode steps and prefills that raised); once at least half
of them, and at least ``min_failures``, failed, ``/health`` answers 503 ``degraded`` with the last error, and it
recovers as forwards succeed again. Rows the engine fails for their own reasons (bad input, limits) are never
counted: only exceptions out of a forward are.
"""

from __future__ import annotations

from collections import deque
from typing import Optional


class DeviceHealth:
    def __init__(self, window: int = 32, min_failures: int = 4):
        self.window, self.min_failures = window, min_failures
        # True: a forward that completed. Only the engine thread appends (atomic on a deque); readers copy it,
        # so the decode step pays one append and no lock
        self._outcomes: deque = deque(maxlen=window)
        self.failures = 0  # over the engine's life (in /stats)
        self.last_error: Optional[str] = None

    def ok(self) -> None:
        self._outcomes.append(True)

    def failed(self, error: BaseException) -> None:
        self.last_error = f"{type(error).__name__}: {str(error)[:300]}"
        self.failures += 1
        self._outcomes.append(False)

    def degraded(self) -> Optional[str]:
        """Why the device counts as failing now, or None."""
        seen = list(self._outcomes)
        bad = seen.count(False)
        if bad >= self.min_failures and 2 * bad >= len(seen):
            return f"{bad} of the last {len(seen)} forwards failed; last: {self.last_error}"
        return None
