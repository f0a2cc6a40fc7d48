"""A parity case as data, and the iteration plan both sides must follow.

A case fixes the inputs (model, dtype, the cap B, each row's prompt ids, max_tokens and arrival
iteration, the prefill chunk size and the join op for full-attention layers). ``plan()`` turns it
into the exact event timeline of the continuous-batching protocol, one entry per iteration:

1. rows whose ``arrive`` equals the iteration enter the FIFO queue (in row order);
2. joiner prefill spends at most ``prefill_chunk`` tokens (the held-back last prompt token's L=1
   step counts as one; an iteration that starts idle, with no batch and no prefill in flight, may spend eight chunks' worth,
   the engine's default ``prefill_burst``, but one chunk is never longer than ``prefill_chunk``): continue the prefill in flight, then admit the queue head while running +
   prefilling rows stay under B; a row whose last chunk runs samples token 0 alone and joins at
   the end of the batch (a row with ``max_tokens == 1`` ends there and never joins); when two or more
   rows prefill their whole prompt in this iteration they form a cohort: one right-padded batched
   prefill rolled to left padding (mlx-lm's ``PromptProcessingBatch``), one [n, 1] step for their
   held-back tokens, and they join together (rows that ended at token 0 are filtered out first);
3. if the batch is not empty, one forward over every batch row, in batch order;
4. decode is pipelined: the tokens a forward produces are read during the next iteration, after
   that iteration's forward is launched, so a row's last forward is a lookahead whose output is
   dropped; rows whose generated count reached ``max_tokens`` are retired after it.

The oracle executes this plan with mlx-lm; the engine under test runs its own scheduler and the
parity driver checks that the engine's actual timeline equals the plan before comparing logits.
Greedy decoding, EOS ignored: every row produces exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import numpy as np

CASES = ("static", "join", "leave", "extend", "merge", "burst", "ring", "ssm", "latent")
GENERAL = ("static", "join", "leave", "extend", "merge", "burst")
SPECIAL = {"ring": ("tiny-gemma3", "tiny-gemma4"), "ssm": ("tiny-qwen3.5",), "latent": ("tiny-glm-mla",)}
SCHEMA = 2  # 2: whole prompts admitted in one iteration are prefilled together as a cohort


@dataclass
class RowSpec:
    prompt: list[int]
    max_tokens: int
    arrive: int  # iteration at which the request is submitted


@dataclass
class Case:
    model: str
    dtype: str
    case: str
    b: int
    seed: int
    rows: list[RowSpec]
    prefill_chunk: int = 2048
    join_full: str = "extend"  # extend | merge (full and latent layers)
    schema: int = SCHEMA

    @property
    def key(self) -> str:
        return f"{self.case}-b{self.b}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        d = dict(d)
        d["rows"] = [RowSpec(**r) for r in d["rows"]]
        return cls(**d)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Chunk:
    row: int
    start: int
    end: int
    is_last: bool


@dataclass
class Iteration:
    prefills: list[Chunk] = field(default_factory=list)
    joins: list[int] = field(default_factory=list)  # rows appended to the batch this iteration
    cohort: list[int] = field(default_factory=list)  # rows prefilled together (two or more whole prompts)
    forward: list[int] = field(default_factory=list)  # batch rows of this iteration's forward, in order
    emits: dict[int, int] = field(default_factory=dict)  # row -> step whose logits this forward gives
    retire: list[int] = field(default_factory=list)  # rows removed after the forward


def applies(case: str, model: str) -> bool:
    base = model.split("@")[0]
    return case in GENERAL or base in SPECIAL.get(case, ())


def plan(case: Case) -> list[Iteration]:
    rows = case.rows
    waiting: list[int] = []
    prefilling: list[int] = []
    pos: dict[int, int] = {}
    batch: list[int] = []
    produced = {i: 0 for i in range(len(rows))}  # tokens whose logits exist (token 0 included)
    done: set[int] = set()
    its: list[Iteration] = []
    k = 0
    while len(done) < len(rows):
        it = Iteration()
        waiting += [i for i, r in enumerate(rows) if r.arrive == k]
        idle = not batch and not prefilling  # the engine's default prefill_burst: eight chunks
        budget, j = (8 * case.prefill_chunk if idle else case.prefill_chunk), 0
        while budget > 0 and j < case.b:
            if j < len(prefilling):
                r = prefilling[j]
            elif waiting and len(batch) + len(prefilling) < case.b:
                r = waiting.pop(0)
                prefilling.append(r)
                pos[r] = 0
            else:
                break
            j += 1
            body = len(rows[r].prompt) - 1
            end = min(pos[r] + min(budget, case.prefill_chunk), body)
            last = end >= body
            it.prefills.append(Chunk(r, pos[r], end, last))
            budget -= (end - pos[r]) + (1 if last else 0)
            if not last:
                break
        whole = [ch.row for ch in it.prefills if ch.start == 0 and ch.is_last]
        it.cohort = whole if len(whole) >= 2 else []
        for ch in it.prefills:
            pos[ch.row] = ch.end
            if ch.is_last:
                prefilling.remove(ch.row)
                produced[ch.row] = 1
                if rows[ch.row].max_tokens == 1:
                    done.add(ch.row)
                else:
                    batch.append(ch.row)
                    it.joins.append(ch.row)
        if batch:
            it.forward = list(batch)
            for r in batch:
                if produced[r] < rows[r].max_tokens:
                    it.emits[r] = produced[r]
                    produced[r] += 1
            # pipelined read: a row whose last token came from the previous forward leaves now
            prev = its[-1].emits if its else {}
            it.retire = [r for r in batch if r in prev and prev[r] == rows[r].max_tokens - 1]
            batch = [r for r in batch if r not in it.retire]
            done.update(it.retire)
        its.append(it)
        k += 1
        if k > 100_000:
            raise RuntimeError("plan did not terminate")
    return its


def plan_json(case: Case) -> list[dict]:
    return [asdict(i) | {"emits": {str(r): s for r, s in i.emits.items()}} for i in plan(case)]


TOPK = 5


def step_record(token: int, vec: np.ndarray, geo=None) -> dict:
    """One row-step as both sides record it: token, sha256 of the float32 logprob vector, top-5,
    and ``g``: the first full-attention layer's (key buffer width, this row's left padding) right
    after the forward that produced the step (None without such a layer). The geometry is part of
    exactness: backends whose attention reduction depends on the buffer shape (Metal) change
    logits when padding is kept that mlx-lm trims, even where this backend's numbers do not move."""
    vec = np.ascontiguousarray(vec.reshape(-1), dtype=np.float32)
    top = np.argsort(-vec, kind="stable")[:TOPK]
    return {"t": int(token), "h": hashlib.sha256(vec.tobytes()).hexdigest(),
            "top": [[int(i), float(vec[i])] for i in top], "g": list(geo) if geo is not None else None}


# ---- deterministic case generation -----------------------------------------------------------
def _prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, size=n).tolist()


def make_case(model: str, dtype: str, case: str, b: int, seed: int = 0, vocab: int = 8192,
              window: int = 64) -> Case:
    """Build one case; ``seed`` and the names fix every prompt id."""
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; cases: {', '.join(CASES)}")
    h = int(hashlib.sha256(f"{model}|{case}|{b}|{seed}".encode()).hexdigest()[:8], 16)
    rng = np.random.default_rng(h)
    rows: list[RowSpec] = []
    chunk, join_full = 2048, "extend"
    if case == "static":  # B rows admitted together, one shared prefill iteration
        rows = [RowSpec(_prompt(rng, int(rng.integers(8, 40)), vocab), 10, 0) for _ in range(b)]
    elif case == "join":  # staggered joins mid-decode
        rows = [RowSpec(_prompt(rng, int(rng.integers(6, 48)), vocab), 12, 3 * i) for i in range(b)]
    elif case == "leave":  # different retirements (row 0 first), survivors continue; one row waits for a slot
        # row 0 is the longest and retires first: the survivors share left padding that filter must trim
        n = b + 1
        # from three rows on, row 1 ends at token 0: it leaves its cohort before the cohort joins
        lens = [48] + [int(rng.integers(8, 32)) for _ in range(n - 1)]
        mts = [1 if (i == 1 and n >= 3) else 3 + 3 * i for i in range(n)]
        rows = [RowSpec(_prompt(rng, L, vocab), mts[i], 0) for i, L in enumerate(lens)]
    elif case in ("extend", "merge"):
        # joiners alternately longer and shorter than the batch (padding on either side), chunked prefill
        chunk, join_full = 16, case
        lens = [24, 60, 9, 41][:b] if b <= 4 else [int(rng.integers(6, 64)) for _ in range(b)]
        rows = [RowSpec(_prompt(rng, L, vocab), 10, 2 * i) for i, L in enumerate(lens)]
    elif case == "burst":  # B whole prompts at an idle engine: more than one chunk, within the idle burst
        chunk = 16
        rows = [RowSpec(_prompt(rng, int(rng.integers(10, 17)), vocab), 6 + 2 * i, 0) for i in range(b)]
    elif case == "ring":  # prompts past the window; the last row starts beyond it and joins late
        chunk = 32
        rows = [RowSpec(_prompt(rng, window + 6 + 11 * i, vocab), 14, 2 * i) for i in range(b - 1)]
        rows.append(RowSpec(_prompt(rng, window + 37, vocab), 8, 12 if b > 1 else 0))
    elif case == "ssm":  # recurrent state through joins and retirements
        chunk = 16
        rows = [RowSpec(_prompt(rng, int(rng.integers(5, 40)), vocab), 14 - 3 * i, 2 * i) for i in range(b)]
    elif case == "latent":  # MLA latent cache through joins and retirements
        chunk = 16
        rows = [RowSpec(_prompt(rng, int(rng.integers(5, 40)), vocab), 8 + 2 * ((i + 1) % 3), 3 * i) for i in range(b)]
    return Case(model, dtype, case, b, seed, rows, chunk, join_full)


def cases_for(model: str, dtype: str, bs, names=None, seed: int = 0, vocab: int = 8192, window: int = 64):
    names = names or CASES
    for name in names:
        if not applies(name, model):
            continue
        for b in bs:
            yield make_case(model, dtype, name, b, seed, vocab, window)
