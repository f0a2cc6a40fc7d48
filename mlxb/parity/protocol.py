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

With the prompt cache on (the ``prefix`` case), the plan also models the cache on token *symbols*
(a later row's prompt is an earlier row's prompt + output + new tokens, ``Case.prefix["links"]``):
at admission a row starts from the longest usable cached prefix (any stored key's common prefix when
every layer can be trimmed, else a stored key that is a prefix of the prompt), or from a leader's
snapshot in the same iteration when it shares at least ``MIN_SHARED`` more tokens (the leader's
chunk is split there); snapshots are taken at solo chunk ends (every end for exact-only kinds, the
prompt body and shared points otherwise), at a token-0 finish and at retirement (prompt + output);
a row marked ``ssd`` arrives after every snapshot went through the SSD tier. ``Iteration.seeds``
and ``snaps`` tell the oracle which snapshot each row starts from and when snapshots are taken.

The oracle executes this plan with mlx-lm; the engine under test runs its own scheduler and the
parity driver checks that the engine's actual timeline equals the plan before comparing logits.
Greedy decoding, EOS ignored: every row produces exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

CASES = ("static", "join", "leave", "extend", "merge", "burst", "ring", "ssm", "latent", "prefix", "grammar", "quant",
         "lora")
# grammar: the join case's rows, with rows 0 and 2 constrained by this regex (llguidance). Its mask depends on
# where the row is in the pattern (a mask one token late breaks it), and it allows no end of sequence before
# 180 characters, so every row still produces exactly max_tokens tokens and the plan is the join case's; the
# constrained rows' logprobs are those of the masked distribution.
GRAMMAR_REGEX = "(ab |cd ){60,}"
GRAMMAR_ROWS = (0, 2)
# prefix: every tiny preset; True where every layer is full attention / latent (reuse at any length)
PREFIX_TRIMMABLE = {"tiny-llama": True, "tiny-minicpm": True, "tiny-glm-mla": True,
                    "tiny-gemma3": False, "tiny-gemma4": False, "tiny-qwen3.5": False}
# lora: the join case's rows, each with adapter 0, none, 1, 0, ... (random-weight adapters built from LORA_ADAPTERS)
LORA_ADAPTERS = [{"seed": 1, "rank": 8, "num_layers": -1}, {"seed": 2, "rank": 4, "num_layers": 1}]
# ring, ssm and latent run where the model has such layers, quant where every layer is full attention
# (``skip_reason``); the rest run on every batchable model.
# quant (--kv-bits; presets whose every layer is full attention): the join case's rows with quantized KV,
# KV4 at odd B and KV8 at even B, group 32, converted from the first chunk. mlx-lm has no batched
# quantized cache, so the oracle keeps the batch's layout with three mlx-lm BatchKVCache lanes (packed
# values, scales, biases; oracle/quantized.py); the cache geometry is compared.
QUANT_GROUP = 32
MIN_SHARED = 32  # the engine's default --prompt-cache min shared tokens for a follower
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
    # prompt cache on: {"trimmable": bool, "links": {row: {"base": earlier row, "ssd": bool}}}; a linked
    # row's prompt is its base row's prompt + output + its own ``prompt`` tokens
    prefix: Optional[dict] = None
    # constrained decoding: {"regex": str, "rows": [row, ...]}; those rows sample under the regex's token mask
    grammar: Optional[dict] = None
    # quantized KV: {"bits": int, "group_size": int, "start": int} (mlx-lm's kv_bits, kv_group_size, quantized_kv_start)
    kv: Optional[dict] = None
    # LoRA adapters per row: {"adapters": [{"seed", "rank", "num_layers"}, ...], "rows": [slot per row, -1: base]}
    lora: Optional[dict] = None

    @property
    def key(self) -> str:
        return f"{self.case}-b{self.b}"

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["prefix"] is None:
            del d["prefix"]  # cases without the prompt cache keep their digests
        if d["grammar"] is None:
            del d["grammar"]
        if d["kv"] is None:
            del d["kv"]
        if d["lora"] is None:
            del d["lora"]
        return d

    def regex(self, r: int) -> Optional[str]:
        """The regex constraining row ``r``, or None."""
        g = self.grammar or {}
        return g.get("regex") if r in g.get("rows", ()) else None

    def link(self, r: int) -> Optional[dict]:
        return (self.prefix or {}).get("links", {}).get(str(r))

    def prompt_len(self, r: int) -> int:
        ln = self.link(r)
        own = len(self.rows[r].prompt)
        return own if ln is None else self.prompt_len(ln["base"]) + self.rows[ln["base"]].max_tokens + own

    def symbols(self, r: int) -> tuple:
        """Row ``r``'s prompt with each generated token as a symbol ("o", row, step)."""
        ln = self.link(r)
        if ln is None:
            return tuple(self.rows[r].prompt)
        b = ln["base"]
        return self.symbols(b) + tuple(("o", b, k) for k in range(self.rows[b].max_tokens)) + tuple(self.rows[r].prompt)

    def resolve(self, r: int, outputs: dict) -> list[int]:
        """Row ``r``'s real prompt ids, given earlier rows' generated tokens ``outputs[row]``."""
        ln = self.link(r)
        if ln is None:
            return list(self.rows[r].prompt)
        b = ln["base"]
        return self.resolve(b, outputs) + list(outputs[b]) + list(self.rows[r].prompt)

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


def skip_reason(case: str, kinds) -> Optional[str]:
    """Why ``case`` does not apply to a model with these layer kinds (``mlxb.cache.protocol.layer_kinds``),
    or None when it does. The case list adapts to the model instead of failing on it."""
    kinds = set(kinds)
    if None in kinds:
        return "the model has a layer cache the batch cannot hold (it is served on the serial lane only)"
    if case == "ring" and "rotating" not in kinds:
        return "no sliding-window layers"
    if case == "ssm" and "ssm" not in kinds:
        return "no recurrent (SSM) layers"
    if case == "latent" and "latent" not in kinds:
        return "no latent (MLA) attention layers"
    if case == "quant" and kinds != {"full"}:
        return "the quant oracle covers models whose every layer is full attention"
    return None


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


def plan(case: Case) -> list[Iteration]:
    rows = case.rows
    L = {i: case.prompt_len(i) for i in range(len(rows))}
    store = _Store(case.prefix["trimmable"]) if case.prefix else None
    seqs = {i: case.symbols(i) for i in range(len(rows))} if case.prefix else {}
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
        arriving = [i for i, r in enumerate(rows) if r.arrive == k]
        it.spill = any((case.link(i) or {}).get("ssd") for i in arriving)
        waiting += arriving
        idle = not batch and not prefilling  # the engine's default prefill_burst: eight chunks
        budget, j = (8 * case.prefill_chunk if idle else case.prefill_chunk), 0
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
                produced[ch.row] = 1
                if rows[ch.row].max_tokens == 1:
                    done.add(ch.row)
                    if store is not None and ch.row not in it.cohort:
                        _snap(store, it, seqs[ch.row], (ch.row, L[ch.row]))
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
            for r in it.retire if store is not None else []:
                m = rows[r].max_tokens
                _snap(store, it, seqs[r] + tuple(("o", r, s) for s in range(m)), (r, L[r] + m))
        its.append(it)
        k += 1
        if k > 100_000:
            raise RuntimeError("plan did not terminate")
    return its


def _snap(store: _Store, it: Iteration, key: tuple, src: tuple) -> None:
    if not key:
        return
    it.snaps.append(list(src))
    store.insert(key, src)


def plan_json(case: Case) -> list[dict]:
    return [asdict(i) | {"emits": {str(r): s for r, s in i.emits.items()},
                         "seeds": {str(r): s for r, s in i.seeds.items()}} for i in plan(case)]


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
