"""When speculation runs: each row's draft length and pauses, and whether a verify step pays for the
batch, from acceptance and the measured cost of a verify step (``mlxb.spec.verify`` runs the steps).

Acceptance is learnt from verify steps and, for prompt lookup, from *shadow* drafts: while the bar
keeps a batch plain, one row per step (more while rows have no evidence yet, ``shadow``) looks its
drafts up anyway and later compares them with the tokens it actually emitted, at no device cost. A
batch whose rows are aligned (no left padding: its steps skip the attention mask) loses that on its
first verify step for good, so there rows count only with evidence and the bar includes what masked
steps cost over aligned ones."""

from __future__ import annotations

import os
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

MISS_LIMIT, COOLDOWN, MAX_COOLDOWN = 4, 16, 128  # lookups that find nothing; steps without proposals
ALPHA0, MIN_GAIN = 0.7, 2.0  # starting acceptance estimate; tokens a verify step must be expected to give
PRIOR, DECAY = 2.0, 0.75  # the starting estimate weighs as 2 draft positions; each check keeps 0.75 of the weight before
POOL_W = 4.0  # draft positions that the batch's pooled acceptance weighs in each row's estimate (``gain``)
SHADOW_SPREAD = 8  # rows without evidence get shadow drafts up to one in this many rows a step (``shadow``)
PROBE_GAIN = 1.5  # a stale cost is probed only for rows expected to gain this much (it may have been a compile)
# MLXB_SPEC_CHEAP_VERIFY=C: where a verify step costs at most C plain steps, a row keeps drafting the longest instead
# of shrinking after a partly kept block (``RowSpec.adapt``); 0 turns it off. 1.5 by default: on the H200 (8B, B=8,
# repetitive output) it raised the median spec/plain ratio in both passes, neutral on random prompts and at B=1 (README)
CHEAP_VERIFY = float(os.environ.get("MLXB_SPEC_CHEAP_VERIFY", "1.5") or 0)
MASK_PENALTY = 1.25  # a masked step over an aligned one until both were measured (H200, 8B, B=8: 10.4 / 8.2 ms)
# MLXB_SPEC_BATCH=every (default): a verify step runs only where every row of the batch is expected to gain at least
# its cost, so no request pays for another's drafts; =mean: where the rows' expected tokens average the cost (the most
# tokens per second for the batch as a whole). H100 (8B, 8 clients, every 2nd request a forced tool call, whose
# JSON lookup drafts well): under mean, 659 of 981 steps with grammar rows were verify steps at 23 ms against 10 ms
# plain, and the free rows' TPOT was 2.5x that of a batch without forced rows (reports/h100/session65)
BATCH_RULE = os.environ.get("MLXB_SPEC_BATCH", "every")


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
    alpha: float = ALPHA0  # running per-draft acceptance (``learn``)
    weight: float = PRIOR  # the draft positions, decayed, behind ``alpha``
    backoff: int = COOLDOWN
    adaptive: bool = True
    evidence: int = 0  # verify steps and shadow drafts that measured ``alpha``
    full: float = 0.5  # running rate of verify steps whose drafts all held (``mlxb.spec.ahead``)
    shadow: list = field(default_factory=list)  # lookup drafts made while plain, checked against what follows
    shadow_at: int = 0  # the row's token count when they were made
    shadowed: int = -1  # the runner's step count when it last looked drafts up while plain (-1: never)
    _buf: np.ndarray = field(default=None, repr=False)  # prompt + emitted tokens, grown in place (``history``)
    _seen: int = 0

    def history(self, tokens: list) -> np.ndarray:
        """The prompt and ``tokens`` (the row's emitted tokens, which only grow) as one array, appended to
        in place rather than rebuilt from the list on every step."""
        n0, n = self.prompt.shape[0], self.prompt.shape[0] + len(tokens)
        if len(tokens) < self._seen:  # not the same row's tokens: rebuild
            self._buf, self._seen = None, 0
        if self._buf is None or self._buf.shape[0] < n:
            buf = np.empty(max(2 * n, 256), dtype=np.int64)
            buf[:n0] = self.prompt
            if self._seen:
                buf[n0 : n0 + self._seen] = self._buf[n0 : n0 + self._seen]
            self._buf = buf
        if len(tokens) > self._seen:
            self._buf[n0 + self._seen : n] = tokens[self._seen :]
            self._seen = len(tokens)
        return self._buf[:n]

    def adapt(self, n: int, a: int, cost: float = MIN_GAIN, pooled: Optional[float] = None,
              shadows: bool = False) -> None:
        """After a verify step in which this row drafted ``n`` and kept ``a`` of them: the next draft
        length, and a pause (doubling while it keeps failing) when the tokens a verify step is expected
        to give, 1 + alpha + ... + alpha^k, fall below ``cost``: what a verify step costs in plain steps
        on this machine (``StepCost``; a wider forward, and the host waits for it). Where the proposer makes
        shadow drafts (``shadows``: prompt lookup) there is no pause: the row keeps its estimate, the bar holds
        its batch plain, and shadow drafts on plain steps (free) keep checking it, so it drafts again as soon as
        they hold. A pause reset the row to the starting guess, and each ended in a verify step: a lone row whose
        drafts were all wrong ran 7 in 64 tokens (4-5 on an H100: 0.91x plain there), and a well-drafting row
        after two unlucky checks sat out 16 steps or more. A draft model's rows (no shadow check) still pause
        and then probe at the guess."""
        self.drafted += n
        self.accepted += a
        if n == 0 or not self.adaptive:
            return
        # a shorter draft only pays where a wider verify forward costs more (a compute-bound CPU: [1, 5] is five
        # [1, 1]); where a verify step costs about a plain one (H200, B=8: 13.6 against 14.4 ms) every draft
        # position may be free: fixed K=4 gained 1.7x there against 1.04-1.12x with the shrink (README)
        cheap = cost <= CHEAP_VERIFY
        self.k = self.kmax if cheap else min(self.kmax, self.k + 1) if a == n else max(1, a + 1)
        self.full = 0.7 * self.full + 0.3 * (a == n)
        self.learn(n, a)
        if gain(self, pooled) < cost:
            self.k = self.kmax  # the next check drafts at full length
            if shadows:  # no pause: the bar holds it plain while shadow drafts, free on plain steps, say so
                return
            self.cooldown, self.backoff = self.backoff, min(2 * self.backoff, MAX_COOLDOWN)
            self.alpha, self.weight = ALPHA0, PRIOR  # a verify step at the guess is its only check
        else:
            self.backoff = COOLDOWN

    def learn(self, n: int, a: int) -> None:
        """``a`` of ``n`` drafts held (a verify step, or shadow drafts against the emitted tokens). Drafts are
        checked in order and the first miss ends the check, so such a check tried ``a + 1`` positions (``a``
        when all held) and ``a`` of them held: alpha is held positions over tried ones (the maximum-likelihood
        estimate of a per-position acceptance), older checks decayed. The kept fraction ``a / n`` it replaced
        reads far low for long drafts: at a true 0.9 and n = 8 a check keeps 5.1 on average, 0.64 of n, which
        held rows under bars they clear."""
        tried = a + (a < n)
        held = DECAY * self.alpha * self.weight + a
        self.weight = DECAY * self.weight + tried
        self.alpha = held / self.weight if self.weight > 0 else ALPHA0
        self.evidence += 1


class StepCost:
    """What a verify step costs on this machine, in plain steps, per batch size (rows rounded up to a power
    of two: a wider batch changes both steps): the median wall time of the last ``n`` verify steps over
    that of the last ``n`` steady plain ones (``MIN_GAIN`` until both were seen at that size). Measured,
    because it differs by an order of magnitude between machines: on a compute-bound CPU a [1, 5] forward
    costs about five [1, 1] ones, on an H200 (synth-llama-8b, B=1 and B=8) a verify step about two plain
    ones, host wait included. Steady plain steps only: a step that read the pipeline early to look for
    drafts and found none, and the two steps that refill the pipeline after a verify step, wait for a
    whole forward and would make a verify step look cheap (measured on the H200: 22 ms such steps against
    7.5 ms steady ones at B=8 put the ratio at 1.0 where it is 2). What those steps take beyond a steady
    one is charged to the verify step before them: a verify step between plain ones breaks the pipeline,
    and that is part of its price (a verify step right after another pays no refill)."""

    PROBE = 128  # plain steps after which one verify step runs anyway: a stale high cost is measured again
    SPAN = 8.0  # ... times the last measured cost (up to this): probes then cost at most ~1/PROBE of decoding
    REFILL = 2  # plain steps after a verify step (or an early read) that are not steady
    CAP = 33.0  # the largest verify cost kept, in plain steps; a verify step slower than that is not sampled
    SETTLE = 3  # verify samples before a batch size's cost is settled; until then it is measured again ...
    EARLY = 16  # ... after this many plain steps (one sample may be half a compile: H100, stop 69)

    def __init__(self, n: int = 16):
        self.n = n
        self.sizes: dict[int, tuple[deque, deque, deque]] = {}  # bucket -> (plain, verify, aligned plain) seconds
        self.since: dict[int, int] = {}  # bucket -> plain steps since its last verify step
        self.settled: set[int] = set()  # buckets whose cost has rested on SETTLE samples (kept after a probe)
        self.refill = 0
        self.orphan = False  # the last verify step was dropped: its refill steps are charged to no one
        self.dropped = 0  # verify steps not sampled (slower than CAP plain steps)
        self.rows = 1  # the batch size last observed (``ratio``)
        # the last steps: (what decided it, rows, drafts, drafts kept, seconds, cost ratio then)
        self.trace: deque = deque(maxlen=4096)

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def _at(self, rows: int) -> tuple[deque, deque, deque]:
        b = self.bucket(rows)
        if b not in self.sizes:
            self.sizes[b] = (deque(maxlen=self.n), deque(maxlen=self.n), deque(maxlen=self.n))
        return self.sizes[b]

    def observe(self, verify: bool, seconds: float, rows: int = 1, steady: bool = True, aligned: bool = False) -> None:
        """One decode step of ``rows`` rows; ``steady``: False for a plain step that read the pipeline early;
        ``aligned``: a batch step without the attention mask (kept apart: it is the cheaper one)."""
        plain, ver, flat = self._at(rows)
        ref = plain or flat
        plain = flat if aligned else plain
        b, self.rows = self.bucket(rows), rows
        if verify:
            if ref and seconds > self.CAP * statistics.median(ref):
                # beyond any ratio the cost keeps: a first-shape compile (1-3 s on a GPU against 10 ms steps),
                # not what a verify step costs; kept as the only sample, it shut the bar for ~1,000 steps
                self.dropped += 1
                self.since[b], self.refill, self.orphan = 0, self.REFILL, True
                return
            if b in self.settled and self.stale_at(rows):  # a probe: the old verify costs are what it re-measures
                ver.clear()
            ver.append([seconds, 0.0, 0])  # its own time, then the unsteady plain steps after it: sum, count
            if len(ver) >= self.SETTLE:
                self.settled.add(b)
            self.since[b], self.refill, self.orphan = 0, self.REFILL, False
            return
        self.since[b] = self.since.get(b, 0) + 1
        if steady and self.refill == 0:
            plain.append(seconds)
        elif ver and not self.orphan:  # a refill step, or one that read the pipeline early: charged to the last verify step
            ver[-1][1] += seconds
            ver[-1][2] += 1
        self.refill = self.REFILL if not steady else max(0, self.refill - 1)

    def clear(self) -> None:
        self.sizes.clear()
        self.since.clear()
        self.settled.clear()
        self.refill, self.orphan = 0, False

    def verify_samples(self, rows: int) -> int:
        """How many verify steps the cost at this batch size rests on."""
        got = self.sizes.get(self.bucket(rows))
        return len(got[1]) if got else 0

    def stale_at(self, rows: int) -> bool:
        """The last verify step at this size is ``PROBE`` plain steps old times its measured cost (at most
        ``SPAN``; its cost may have been a first-shape compile): without a probe a high cost would keep the bar
        shut for good, and with a fixed period a machine where a verify step costs 5 plain steps (a 2-core CPU)
        paid 4% of its decode time for probes (served tiny-llama, 8 clients). Until a size's cost has rested on
        ``SETTLE`` samples it is stale after ``EARLY`` plain steps: on an H100 (synth-llama-8b, B=8, stop 69) the
        first timed verify step read 6.9 plain steps, the bar stayed shut for the whole sweep (~880 steps to the
        next probe) while a fixed K=8 ran 1.73x plain at 10% wrong drafts (a cost of 6.9 allows at most 0.9x)."""
        if not self._at(rows)[1]:
            return False
        b = self.bucket(rows)
        since = self.since.get(b, 0)
        if b not in self.settled:
            return since >= self.EARLY
        return since >= self.PROBE and since >= self.PROBE * min(self.ratio_at(rows), self.SPAN)

    def ratio_at(self, rows: int, aligned: bool = False) -> float:
        """Verify over plain step time; ``aligned``: over an aligned batch's plain step."""
        plain, ver, flat = self._at(rows)
        plain = (flat or plain) if aligned else (plain or flat)
        if not plain or not ver:
            return MIN_GAIN
        p = statistics.median(plain)
        cost = statistics.median(v + max(0.0, extra - n * p) for v, extra, n in ver)
        return min(max(cost / p, 1.0), self.CAP)

    def penalty_at(self, rows: int) -> float:
        """What a masked plain step costs over an aligned one (``MASK_PENALTY`` until both were seen)."""
        plain, _, flat = self._at(rows)
        if not plain or not flat:
            return MASK_PENALTY
        return min(max(statistics.median(plain) / statistics.median(flat), 1.0), 2.0)

    @property
    def ratio(self) -> float:
        return self.ratio_at(self.rows)

    @property
    def stale(self) -> bool:
        return self.stale_at(self.rows)


def gain(st: RowSpec, pooled: Optional[float] = None) -> float:
    """Tokens a verify step is expected to give a speculating row: 1 + alpha + ... + alpha^kmax. At the
    longest draft, not the current one: a row whose draft length fell after a rejection would otherwise
    be held under a bar it can only clear by speculating (measured on the H200: one rejection put k at 1,
    1 + alpha stayed under a cost of 2.1, and the row never drafted again). With ``pooled`` (the batch's
    acceptance, ``pooled_alpha``) the row's estimate is drawn toward it by ``POOL_W`` draft positions: one early
    miss (a check of one position) put a row that shared the batch's 0.9 at 0.42 on its own, and under the
    every-row rule a batch of 32 such rows (the sweep's replay proposer, 10% of drafts wrong, verify at two plain
    steps) never verified. A row whose drafts keep failing at once weighs about as much as the pool (one position
    a check, decayed: ~4), so it reads at most half the pool's acceptance: at 8 drafts it still keeps its batch
    plain where a verify step costs about 1.8 plain steps or more (2 at a pool of 1.0), not below."""
    a = st.alpha if pooled is None else (st.alpha * st.weight + POOL_W * pooled) / (st.weight + POOL_W)
    return float(st.kmax + 1) if a >= 1.0 else (1.0 - a ** (st.kmax + 1)) / (1.0 - a)  # the geometric sum


def pooled_alpha(rows) -> Optional[float]:
    """The acceptance of the batch's speculating rows with evidence, weighted by their evidence (None: none has)."""
    num = den = 0.0
    for row in rows:
        st = row.spec
        if st is not None and st.evidence and st.cooldown == 0:
            num, den = num + st.alpha * st.weight, den + st.weight
    return num / den if den > 0 else None


def aligned(r) -> bool:
    """A batch whose steps skip the attention mask (no row left-padded, no holes)."""
    if not getattr(r, "merged", False) or getattr(r, "_geo_layer", None) is None:
        return False
    c = r.caches[r._geo_layer]
    return bool(getattr(c, "aligned", False)) and getattr(c, "holes", None) is None


def pays(r) -> bool:
    """A verify step is taken by the whole batch: every row pays its cost (``StepCost``), while only the
    speculating rows gain more than one token. Worth it when every row's expected tokens per step (a
    speculating row's 1 + alpha + ... + alpha^k, any other row's 1) reach the measured cost in plain steps
    (``BATCH_RULE`` "mean": their average does), or the measured cost is stale and the same measure (every
    row's, or the average) reaches ``PROBE_GAIN`` (with --spec-fixed: always): rows whose shadow drafts show no
    acceptance do not pay for a probe, nor does a row without drafts beside rows with them.

    Prompt lookup's rows count only with evidence of their acceptance (verify steps or shadow drafts, not
    the starting guess), at any batch size: probes at the guess with random prompts cost B=8 a fifth of
    its speed on a 2-core CPU (0.79x) and a lone 8B row on the H200 a third (0.68x, 10% of 52 drafts
    kept), since each one, and each lookup that finds nothing, stops the pipeline. A proposer without
    shadow drafts (a draft model) has no check but a verify step, so its rows count at the guess until
    their first one: they probe once, at any batch size, and the evidence decides from then on (before,
    a batch of such rows never drafted unless its rows had drafted alone). An aligned batch would pay the
    mask on every later step: there the cost is over the aligned step and
    includes the mask's; a stale cost is not a probe there but counts as ``MIN_GAIN`` (measured on the
    H200, synth-llama-8b, B=8: probes at the starting guess turned an aligned batch masked and held it
    at 0.65x plain; with no probe at all, a first verify step's compile time kept the bar shut)."""
    if not r.spec.adaptive:
        return True
    n, cost, flat = len(r.rows), r.step_cost, aligned(r)
    guess = not getattr(getattr(r, "proposer", None), "shadows", False)  # a verify step is its only check
    r.spec_pooled = pooled = pooled_alpha(r.rows)  # (``tally`` reads it for the rows' pauses after this step)
    gains = [gain(row.spec, pooled) if row.spec is not None and row.spec.cooldown == 0
             and (row.spec.evidence or guess) else 1.0 for row in r.rows]
    need = min(gains) if BATCH_RULE == "every" else sum(gains) / n  # what the batch's rows must clear (module notes)
    if flat:  # a stale cost (a first-shape compile, say) counts as the default, with the mask's penalty
        bar = (MIN_GAIN if cost.stale_at(n) else cost.ratio_at(n, True)) * cost.penalty_at(n)
        return need >= bar
    # a probe, too, is paid by every row: under the every-row rule one row without drafts keeps it off (its result
    # could not open the bar for that batch, whose need is 1 token)
    return need >= cost.ratio_at(n) or (cost.stale_at(n) and need >= PROBE_GAIN)


def shadow(r, proposer) -> None:
    """On a plain step of adaptive lookup speculation: settle each row's shadow drafts against the
    tokens it emitted since (prefix held, as a verify step would keep), and make new ones (a lookup costs
    host time, about 35-70 us here): for one row a step, the one that waited longest, and while rows have
    no evidence yet for up to one in ``SHADOW_SPREAD`` of the batch, those first. Under the every-row rule a
    row without evidence keeps its batch plain, and one row a step chosen by ``step % free rows`` left some
    rows of 32 without any for 98 steps (the sweep's replay proposer, every draft right: no verify step).
    Rows paused after ``MISS_LIMIT`` empty lookups are looked up too (free here: a plain step's tokens, the
    pipeline kept), and shadow drafts that hold (two, or all of a shorter one) end the pause: a lone 8B row on
    an H100 whose lookups came back empty for a few steps sat out 15 steps of a continuation it could have
    drafted, 1.79x plain against fixed K=8's 2.68x (reports/h100/session70)."""
    free = []
    for row in r.rows:
        st = row.spec
        if st is None:
            continue
        if st.shadow:
            new = row.tokens[st.shadow_at :]
            m = 0
            while m < len(new) and m < len(st.shadow) and new[m] == st.shadow[m]:
                m += 1
            if m == len(st.shadow) or m < len(new):  # all held, or one failed
                st.learn(len(st.shadow), m)
                if st.cooldown > 0 and m >= min(2, len(st.shadow)):  # paused after lookups found nothing, and
                    st.cooldown = st.misses = 0  # now one found drafts that held: it may draft again at once
                st.shadow = []
        if not st.shadow:
            free.append(row)
    if not free:
        return
    fresh = [row for row in free if row.spec.evidence == 0]
    if fresh:  # (sorted only while some rows have no evidence; then one pick a step, the longest waiting)
        picks = sorted(fresh, key=lambda w: w.spec.shadowed)[: -(-len(r.rows) // SHADOW_SPREAD)]
    else:
        picks = [min(free, key=lambda w: w.spec.shadowed)]
    for row in picks:
        st = row.spec
        st.shadow = proposer.propose(st.history(row.tokens), st.kmax)
        st.shadow_at, st.shadowed = len(row.tokens), r.num_steps


def wants_verify(rows) -> bool:
    """Some row may propose this step (a speculating row not in cooldown)."""
    return any(r.spec is not None and r.spec.cooldown == 0 for r in rows)
