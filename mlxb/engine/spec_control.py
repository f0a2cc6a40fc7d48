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
        if sum(self.alpha ** j for j in range(self.kmax + 1)) < cost:
            self.cooldown, self.backoff = self.backoff, min(2 * self.backoff, MAX_COOLDOWN)
            self.alpha = ALPHA0  # probe again after the pause
        else:
            self.backoff = COOLDOWN


class StepCost:
    """What a verify step costs on this machine, in plain steps: the median wall time of the last
    ``n`` verify steps over that of the last ``n`` plain ones (``MIN_GAIN`` until both were seen).
    Measured, because it differs by an order of magnitude between machines: on a compute-bound CPU
    a [1, 5] forward costs about five [1, 1] ones, on an H200 (synth-llama-8b, B=1 and B=8) a verify
    step about two plain ones, host wait included."""

    PROBE = 128  # plain steps after which one verify step runs anyway: a stale high cost is measured again

    def __init__(self, n: int = 16):
        self.plain: deque = deque(maxlen=n)
        self.verify: deque = deque(maxlen=n)
        self.since_verify = 0

    def observe(self, verify: bool, seconds: float) -> None:
        if verify and self.stale:  # a probe: the old verify costs are what it re-measures
            self.verify.clear()
        (self.verify if verify else self.plain).append(seconds)
        self.since_verify = 0 if verify else self.since_verify + 1

    @property
    def stale(self) -> bool:
        """The last verify step is ``PROBE`` plain steps old (its cost may have been a first-shape compile
        or another batch size): without a probe a high cost would keep the bar shut for good."""
        return bool(self.verify) and self.since_verify >= self.PROBE

    @property
    def ratio(self) -> float:
        if not self.plain or not self.verify:
            return MIN_GAIN
        return min(max(statistics.median(self.verify) / statistics.median(self.plain), 1.0), 33.0)


def pays(r) -> bool:
    """A verify step is taken by the whole batch: every row pays its cost (``StepCost``), while only the
    speculating rows gain more than one token. Worth it when the rows' expected tokens per step, a
    speculating row's 1 + alpha + ... + alpha^k and every other row's 1, average at least the measured
    cost in plain steps, or the measured cost is stale (with --spec-fixed: always)."""
    if not r.spec.adaptive:
        return True
    gain = [sum(row.spec.alpha ** j for j in range(row.spec.k + 1))
            if row.spec is not None and row.spec.cooldown == 0 else 1.0 for row in r.rows]
    return sum(gain) >= r.step_cost.ratio * len(gain) or r.step_cost.stale


def wants_verify(rows) -> bool:
    """Some row may propose this step (a speculating row not in cooldown)."""
    return any(r.spec is not None and r.spec.cooldown == 0 for r in rows)
