"""When speculation runs: each row's draft length and pauses, and whether a verify step pays for the
batch, from acceptance and the measured cost of a verify step (``mlxb.engine.spec`` runs the steps)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np

MISS_LIMIT, COOLDOWN, MAX_COOLDOWN = 4, 16, 128  # lookups that find nothing; steps without proposals
ALPHA0, MIN_GAIN = 0.7, 2.0  # starting acceptance estimate; tokens a verify step must be expected to give


@dataclass
class RowSpec:
    """One row's speculation state."""

    k: int  # proposal length now (adaptive, at most ``kmax``)
    kmax: int
    prompt: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    drafted: int = 0
    accepted: int = 0
    misses: int = 0
    cooldown: int = 0
    alpha: float = ALPHA0  # running per-draft acceptance
    backoff: int = COOLDOWN
    adaptive: bool = True

    def adapt(self, n: int, a: int, cost: float = MIN_GAIN) -> None:
        """After a verify step in which this row drafted ``n`` and kept ``a`` of them: the next draft
        length, and a pause (doubling while it keeps failing) when the tokens a verify step is expected
        to give, 1 + alpha + ... + alpha^k, fall below ``cost``: what a verify step costs in plain steps
        on this machine (``StepCost``; a wider forward, and the host waits for it)."""
        self.drafted += n
        self.accepted += a
        if n == 0 or not self.adaptive:
            return
        self.k = min(self.kmax, self.k + 1) if a == n else max(1, a + 1)
        self.alpha = 0.6 * self.alpha + 0.4 * (a / n)
        if gain(self) < cost:
            self.cooldown, self.backoff = self.backoff, min(2 * self.backoff, MAX_COOLDOWN)
            self.alpha, self.k = ALPHA0, self.kmax  # probe again after the pause, at full length
        else:
            self.backoff = COOLDOWN


class StepCost:
    """What a verify step costs on this machine, in plain steps, per batch size (rows rounded up to a power
    of two: a wider batch changes both steps): the median wall time of the last ``n`` verify steps over
    that of the last ``n`` steady plain ones (``MIN_GAIN`` until both were seen at that size). Measured,
    because it differs by an order of magnitude between machines: on a compute-bound CPU a [1, 5] forward
    costs about five [1, 1] ones, on an H200 (synth-llama-8b, B=1 and B=8) a verify step about two plain
    ones, host wait included. Steady plain steps only: a step that read the pipeline early to look for
    drafts and found none, and the two steps that refill the pipeline after a verify step, wait for a
    whole forward and would make a verify step look cheap (measured on the H200: 22 ms such steps against
    7.5 ms steady ones at B=8 put the ratio at 1.0 where it is 2)."""

    PROBE = 128  # plain steps after which one verify step runs anyway: a stale high cost is measured again
    REFILL = 2  # plain steps after a verify step (or an early read) that are not steady

    def __init__(self, n: int = 16):
        self.n = n
        self.sizes: dict[int, tuple[deque, deque]] = {}  # bucket -> (plain, verify) seconds
        self.since: dict[int, int] = {}  # bucket -> plain steps since its last verify step
        self.refill = 0
        self.rows = 1  # the batch size last observed (``ratio``)
        # the last steps: (what decided it, rows, drafts, drafts kept, seconds, cost ratio then)
        self.trace: deque = deque(maxlen=4096)

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def _at(self, rows: int) -> tuple[deque, deque]:
        b = self.bucket(rows)
        if b not in self.sizes:
            self.sizes[b] = (deque(maxlen=self.n), deque(maxlen=self.n))
        return self.sizes[b]

    def observe(self, verify: bool, seconds: float, rows: int = 1, steady: bool = True) -> None:
        """One decode step of ``rows`` rows; ``steady``: False for a plain step that read the pipeline early."""
        plain, ver = self._at(rows)
        b, self.rows = self.bucket(rows), rows
        if verify:
            if self.stale_at(rows):  # a probe: the old verify costs are what it re-measures
                ver.clear()
            ver.append(seconds)
            self.since[b], self.refill = 0, self.REFILL
            return
        self.since[b] = self.since.get(b, 0) + 1
        if steady and self.refill == 0:
            plain.append(seconds)
        self.refill = self.REFILL if not steady else max(0, self.refill - 1)

    def clear(self) -> None:
        self.sizes.clear()
        self.since.clear()
        self.refill = 0

    def stale_at(self, rows: int) -> bool:
        """The last verify step at this size is ``PROBE`` plain steps old (its cost may have been a
        first-shape compile): without a probe a high cost would keep the bar shut for good."""
        return bool(self._at(rows)[1]) and self.since.get(self.bucket(rows), 0) >= self.PROBE

    def ratio_at(self, rows: int) -> float:
        plain, ver = self._at(rows)
        if not plain or not ver:
            return MIN_GAIN
        return min(max(statistics.median(ver) / statistics.median(plain), 1.0), 33.0)

    @property
    def ratio(self) -> float:
        return self.ratio_at(self.rows)

    @property
    def stale(self) -> bool:
        return self.stale_at(self.rows)


def gain(st: RowSpec) -> float:
    """Tokens a verify step is expected to give a speculating row: 1 + alpha + ... + alpha^kmax. At the
    longest draft, not the current one: a row whose draft length fell after a rejection would otherwise
    be held under a bar it can only clear by speculating (measured on the H200: one rejection put k at 1,
    1 + alpha stayed under a cost of 2.1, and the row never drafted again)."""
    return sum(st.alpha ** j for j in range(st.kmax + 1))


def pays(r) -> bool:
    """A verify step is taken by the whole batch: every row pays its cost (``StepCost``), while only the
    speculating rows gain more than one token. Worth it when the rows' expected tokens per step, a
    speculating row's 1 + alpha + ... + alpha^k and every other row's 1, average at least the measured
    cost in plain steps, or the measured cost is stale (with --spec-fixed: always)."""
    if not r.spec.adaptive:
        return True
    n, cost = len(r.rows), r.step_cost
    total = sum(gain(row.spec) if row.spec is not None and row.spec.cooldown == 0 else 1.0 for row in r.rows)
    return total >= cost.ratio_at(n) * n or cost.stale_at(n)


def wants_verify(rows) -> bool:
    """Some row may propose this step (a speculating row not in cooldown)."""
    return any(r.spec is not None and r.spec.cooldown == 0 for r in rows)
