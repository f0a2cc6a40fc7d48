"""The iteration plan of a parity case: ``plan()`` (every case but ``spec``) or ``Planner`` one forward
at a time (``spec``, whose forwards give as many tokens as the model accepts). The rules are in
``mlxb.parity.protocol``'s notes; the engine's scheduler must follow them and the oracle executes them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from mlxb.parity.protocol import MIN_SHARED, Case


@dataclass
class Chunk:
    row: int
    start: int
    end: int
    is_last: bool
    shared: bool = False  # a follower starts from the snapshot at ``end`` (prefilled alone)
    first: bool = False  # the row's first chunk (admitted in this iteration)


@dataclass
class Iteration:
    prefills: list[Chunk] = field(default_factory=list)
    joins: list[int] = field(default_factory=list)  # rows appended to the batch this iteration
    cohort: list[int] = field(default_factory=list)  # rows prefilled together (two or more whole prompts)
    forward: list[int] = field(default_factory=list)  # batch rows of this iteration's forward, in order
    emits: dict[int, int] = field(default_factory=dict)  # row -> step whose logits this forward gives
    retire: list[int] = field(default_factory=list)  # rows removed after the forward
    spill: bool = False  # prompt cache: every snapshot goes through the SSD tier before admissions
    seeds: dict[int, list] = field(default_factory=dict)  # row -> [src row, src length, tokens used]
    snaps: list = field(default_factory=list)  # [row, length]: snapshots taken, in execution order
    gains: dict[int, int] = field(default_factory=dict)  # spec: row -> tokens this forward gave, where more than one
    verify: bool = False  # spec: this forward was a verify step (its tokens read at once)


class _Store:
    """The prompt cache as the plan models it: keys are symbol tuples, values the snapshot ids."""

    def __init__(self, trimmable: bool):
        self.trimmable = trimmable
        self.keys: dict[tuple, tuple] = {}  # key -> (row, length) of the snapshot

    def insert(self, key: tuple, src: tuple) -> None:
        if key in self.keys or (self.trimmable and any(k[:len(key)] == key for k in self.keys)):
            return  # already covered
        if self.trimmable:
            for k in [k for k in self.keys if key[:len(k)] == k]:
                del self.keys[k]
        self.keys[key] = src

    def lookup(self, seq: tuple, limit: int) -> tuple[int, Optional[tuple]]:
        served = []
        for k, v in self.keys.items():
            if self.trimmable:
                n = _lcp(k, seq, limit)
            else:
                n = len(k) if len(k) <= limit and seq[:len(k)] == k else 0
            served.append((n, v))
        best = max((n for n, _ in served), default=0)
        if best == 0:
            return 0, None
        srcs = {v for n, v in served if n == best}
        if len(srcs) > 1:
            raise ValueError(f"ambiguous prefix case: two snapshots serve {best} tokens")
        return best, srcs.pop()


def _lcp(a, b, limit: int) -> int:
    n, i = min(limit, len(a), len(b)), 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _admit_cached(case: Case, store: _Store, seqs: dict, r: int, it: Iteration) -> int:
    """Mirror of the scheduler's cached start: lookup, then a leader's chunk in this iteration."""
    limit = len(seqs[r]) - 1
    cached, src = store.lookup(seqs[r], limit)
    best, at = cached, None
    for i, c in enumerate(it.prefills):
        n = _lcp(seqs[r], seqs[c.row], min(limit, c.end))
        if n > max(best, c.start) and n - cached >= MIN_SHARED:
            best, at = n, i
    if at is not None:
        c = it.prefills[at]
        parts = [Chunk(c.row, c.start, best, best == c.end and c.is_last, True, c.first)]
        if best < c.end:
            parts.append(Chunk(c.row, best, c.end, c.is_last, c.shared))
        it.prefills[at:at + 1] = parts
        it.seeds[r] = [c.row, best, best]
    elif cached > 0:
        it.seeds[r] = [src[0], src[1], cached]
    return best


def _cohort(prefills: list[Chunk]) -> list[int]:
    """Rows whose whole uncached prompt runs in their first chunk, in the last contiguous run (a row
    joining alone or a shared leader's chunk restarts it); two or more are prefilled together."""
    run: list[int] = []
    for c in prefills:
        if c.first and c.is_last and not c.shared:
            run.append(c.row)
        elif c.is_last or c.shared:
            run = []
    return run if len(run) >= 2 else []


class Planner:
    """The plan one iteration at a time. ``begin`` decides an iteration's arrivals, prefill chunks,
    joins and forward rows; ``end`` settles its forward: each row's new tokens (``gains``: one per row
    in a plain step, 1 + accepted drafts in a ``spec`` verify step, which the executor knows only after
    the forward ran) and the retirements. A verify step's tokens are all read at once, so a row whose
    last token it produced leaves right after it; a plain step is pipelined, so a row leaves after the
    forward that follows its last token (the lookahead)."""

    def __init__(self, case: Case):
        self.case, self.rows = case, case.rows
        self.L = {i: case.prompt_len(i) for i in range(len(self.rows))}
        self.store = _Store(case.prefix["trimmable"]) if case.prefix else None
        self.seqs = {i: case.symbols(i) for i in range(len(self.rows))} if case.prefix else {}
        self.waiting: list[int] = []
        self.prefilling: list[int] = []
        self.pos: dict[int, int] = {}
        self.batch: list[int] = []
        self.produced = {i: 0 for i in range(len(self.rows))}  # tokens whose logits exist (token 0 included)
        self.done: set[int] = set()
        self.k = 0

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.rows)

    def begin(self) -> Iteration:
        case, rows, store, seqs, L = self.case, self.rows, self.store, self.seqs, self.L
        waiting, prefilling, pos, batch = self.waiting, self.prefilling, self.pos, self.batch
        if self.k > 100_000:
            raise RuntimeError("plan did not terminate")
        it = Iteration()
        arriving = [i for i, r in enumerate(rows) if r.arrive == self.k]
        it.spill = any((case.link(i) or {}).get("ssd") for i in arriving)
        waiting += arriving
        idle = not batch and not prefilling  # the engine's default prefill_burst: eight chunks
        burst = 8 * case.prefill_chunk
        queued, chunk = len(waiting) + len(prefilling), case.prefill_chunk
        # a turn boundary (at least 4 waiting, more than decoding): a chunk per decoding row's share of the queue,
        # at most a burst (no case of B <= 4 queues that many behind a decoding row)
        turn = batch and queued > len(batch) and queued >= 4
        busy = min(burst, chunk * -(-queued // len(batch))) if turn else chunk
        budget = burst if idle else busy
        j = 0
        admitted: set[int] = set()
        while budget > 0 and j < case.b:
            if j < len(prefilling):
                r = prefilling[j]
            elif waiting and len(batch) + len(prefilling) < case.b:
                r = waiting.pop(0)
                pos[r] = _admit_cached(case, store, seqs, r, it) if store is not None else 0
                prefilling.append(r)
                admitted.add(r)
            else:
                break
            j += 1
            body = L[r] - 1
            end = min(pos[r] + min(budget, case.prefill_chunk), body)
            last = end >= body
            it.prefills.append(Chunk(r, pos[r], end, last, first=r in admitted))
            budget -= (end - pos[r]) + (1 if last else 0)
            if not last:
                break
        it.cohort = _cohort(it.prefills)
        for ch in it.prefills:
            pos[ch.row] = ch.end
            # solo chunk ends (all for exact-only kinds; body end and shared points otherwise); cohort rows
            # of exact-only models at the body end (extracted from the cohort batch)
            solo_snap = ch.row not in it.cohort and (not store.trimmable or ch.is_last or ch.shared) if store else False
            if solo_snap or (store is not None and ch.row in it.cohort and not store.trimmable):
                _snap(store, it, seqs[ch.row][:ch.end], (ch.row, ch.end))
            if ch.is_last:
                prefilling.remove(ch.row)
                self.produced[ch.row] = 1
                if rows[ch.row].max_tokens == 1:
                    self.done.add(ch.row)
                    if store is not None and ch.row not in it.cohort:
                        _snap(store, it, seqs[ch.row], (ch.row, L[ch.row]))
                else:
                    batch.append(ch.row)
                    it.joins.append(ch.row)
        it.forward = list(batch)
        return it

    def end(self, it: Iteration, gains: Optional[dict] = None, verify: bool = False) -> Iteration:
        """Settle ``it``'s forward; ``gains`` (row -> tokens this forward gave, default one each) and
        ``verify`` (a spec verify step) come from the executor."""
        rows, produced = self.rows, self.produced
        if self.batch:
            lookahead = [r for r in self.batch if produced[r] >= rows[r].max_tokens]
            for r in self.batch:
                if produced[r] < rows[r].max_tokens:
                    g = 1 if gains is None else gains[r]
                    if not 1 <= g <= rows[r].max_tokens - produced[r]:
                        raise ValueError(f"row {r} cannot gain {g} tokens at step {produced[r]}")
                    it.emits[r] = produced[r]
                    if g > 1:
                        it.gains[r] = g
                    produced[r] += g
            it.verify = verify
            # pipelined read: a row whose last token came from an earlier forward leaves after this one
            # (its lookahead); a verify step's rows leave as soon as they have every token
            it.retire = [r for r in self.batch if r in lookahead or (verify and produced[r] >= rows[r].max_tokens)]
            self.batch[:] = [r for r in self.batch if r not in it.retire]
            self.done.update(it.retire)
            for r in it.retire if self.store is not None else []:
                m = rows[r].max_tokens
                _snap(self.store, it, self.seqs[r] + tuple(("o", r, s) for s in range(m)), (r, self.L[r] + m))
        self.k += 1
        return it


def plan(case: Case) -> list[Iteration]:
    """Every iteration, each forward giving each row one token (every case but ``spec``, whose plan
    depends on which drafts the model accepts: ``Planner`` with the executor's gains)."""
    p, its = Planner(case), []
    while not p.finished:
        its.append(p.end(p.begin()))
    return its


def _snap(store: _Store, it: Iteration, key: tuple, src: tuple) -> None:
    if not key:
        return
    it.snaps.append(list(src))
    store.insert(key, src)


def plan_json(case: Case) -> list[dict]:
    return [asdict(i) | {"emits": {str(r): s for r, s in i.emits.items()},
                         "seeds": {str(r): s for r, s in i.seeds.items()}} for i in plan(case)]
