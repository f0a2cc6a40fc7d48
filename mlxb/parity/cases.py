"""Deterministic parity cases: ``seed`` and the names fix every prompt id (the protocol and the
plan they follow are in ``mlxb.parity.protocol`` and ``mlxb.parity.plan``)."""

from __future__ import annotations

import hashlib

import numpy as np

from mlxb.parity.plan import plan
from mlxb.parity.protocol import (CASES, GRAMMAR_REGEX, GRAMMAR_ROWS, LORA_ADAPTERS, PARITY_TOOLS, PREFIX_TRIMMABLE,
                                  QUANT_GROUP, TOOLS_ROWS, Case, RowSpec)


class Pool:
    """Prompt ids a case may use: ``[3, vocab)`` for the presets (their goldens were made so), or the
    ordinary (non-special) ids a model's own tokenizer knows, below its embedding's width."""

    def __init__(self, vocab: int, ids=None):
        self.vocab, self.ids = vocab, None if ids is None else np.asarray(ids, dtype=np.int64)

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.ids is None:
            return rng.integers(3, self.vocab, size=n).tolist()
        return self.ids[rng.integers(0, self.ids.size, size=n)].tolist()

    def distinct(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.choice(np.arange(3, self.vocab) if self.ids is None else self.ids, size=n, replace=False).tolist()


def _prompt(rng: np.random.Generator, n: int, vocab) -> list[int]:
    return (vocab if isinstance(vocab, Pool) else Pool(vocab)).draw(rng, n)


def make_case(model: str, dtype: str, case: str, b: int, seed: int = 0, vocab: int = 8192,
              window: int = 64, ids=None, trimmable: bool | None = None) -> Case:
    """Build one case; ``seed`` and the names fix every prompt id. ``ids``: the prompt id pool (default
    ``[3, vocab)``); ``trimmable``: the prefix case's reuse rule (default: the preset's)."""
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; cases: {', '.join(CASES)}")
    if ids is not None:
        vocab = Pool(vocab, ids)
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
        rows = [RowSpec(_prompt(rng, int(rng.integers(5, 40)), vocab), max(1, 14 - 3 * i), 2 * i) for i in range(b)]
    elif case == "latent":  # MLA latent cache through joins and retirements
        chunk = 16
        rows = [RowSpec(_prompt(rng, int(rng.integers(5, 40)), vocab), 8 + 2 * ((i + 1) % 3), 3 * i) for i in range(b)]
    elif case == "prefix":
        if trimmable is None:
            trimmable = PREFIX_TRIMMABLE[model.split("@")[0]]
        return _prefix_case(model, dtype, b, seed, rng, vocab, trimmable)
    elif case == "grammar":  # the join case's rows (unconstrained rows must match its records bit for bit)
        j = make_case(model, dtype, "join", b, seed, vocab, window, ids)
        return Case(model, dtype, "grammar", b, seed, j.rows, j.prefill_chunk, j.join_full,
                    grammar={"regex": GRAMMAR_REGEX, "rows": [r for r in GRAMMAR_ROWS if r < b]})
    elif case == "tools":  # the join case's rows; rows 1 and 3 forced to call a tool (a template without tools)
        from mlxb.constrain.forced import forced_calls

        j = make_case(model, dtype, "join", b, seed, vocab, window, ids)
        lark = forced_calls(PARITY_TOOLS, None, "json_tools", "<tool_call>", "</tool_call>", parallel=False)
        return Case(model, dtype, "tools", b, seed, j.rows, j.prefill_chunk, j.join_full,
                    grammar={"lark": lark, "rows": [r for r in TOOLS_ROWS if r < b]})
    elif case == "lora":  # the join case's rows, adapters 0, none, 1, 0, ... (rows of three kinds in one batch)
        j = make_case(model, dtype, "join", b, seed, vocab, window, ids)
        return Case(model, dtype, "lora", b, seed, j.rows, j.prefill_chunk, j.join_full,
                    lora={"adapters": LORA_ADAPTERS, "rows": [(0, -1, 1)[i % 3] for i in range(len(j.rows))]})
    elif case == "quant":  # the join case's rows (staggered joins, retirements, filters) with quantized KV
        j = make_case(model, dtype, "join", b, seed, vocab, window, ids)
        return Case(model, dtype, "quant", b, seed, j.rows, 16, j.join_full,
                    kv={"bits": 4 if b % 2 else 8, "group_size": QUANT_GROUP, "start": 0})
    elif case == "shared":  # a fleet's rows opening with one prefix: pairs and single joins, retirements, one stranger
        from mlxb.parity.protocol import SHARED_PREFIX

        pre = _prompt(rng, SHARED_PREFIX, vocab)
        rows = [RowSpec(pre + _prompt(rng, int(rng.integers(2, 12)), vocab), 6 + 3 * (i % 3), 2 * ((i + 1) // 2))
                for i in range(b)]
        rows.insert(min(2, b), RowSpec(_prompt(rng, 20, vocab), 5, 3))
        return Case(model, dtype, "shared", b, seed, rows, 2048, "extend")
    elif case == "spec":  # staggered joins and retirements; prompts repeat a segment, so lookup drafts from the start
        rows = []
        for i in range(b):
            seg = _prompt(rng, int(rng.integers(3, 8)), vocab)
            rows.append(RowSpec(seg * 3 + _prompt(rng, int(rng.integers(2, 10)), vocab), 16 + 5 * ((i + 2) % 3), 3 * i))
        return Case(model, dtype, "spec", b, seed, rows, 16, "extend",
                    spec={"ngram": 3, "rows": [(4, 0, 2, 3)[i % 4] for i in range(b)]})
    return Case(model, dtype, case, b, seed, rows, chunk, join_full)


def _prefix_case(model: str, dtype: str, b: int, seed: int, rng, vocab, trimmable: bool) -> Case:
    """Prompt-cache reuse: a multi-turn chain (turn 2 extends turn 1's prompt + output, turn 3 extends
    turn 2's after every snapshot went through the SSD tier and spans two chunks), then a burst of
    B rows sharing a 40-token prefix (one leader prefills it, the others start from its snapshot and
    prefill their suffixes as one cohort), then turn 1's prompt again, a new turn 2 and the last burst
    row's prompt again together (cached prefixes of different lengths: a left-padded cohort from
    B=2 on; the repeat hits the body snapshot its cohort took)."""
    vocab = vocab if isinstance(vocab, Pool) else Pool(vocab)
    firsts = vocab.distinct(rng, 2 + b)  # distinct first tokens

    def fresh(first, n):
        return [first] + _prompt(rng, n - 1, vocab)

    p0 = fresh(firsts[0], 40)
    shared = fresh(firsts[1], 40)
    rows = [RowSpec(p0, 6, 0)]
    links: dict = {}
    c = Case(model, dtype, "prefix", b, seed, rows, 64, "extend",
             prefix={"trimmable": trimmable, "links": links})

    def after_all():  # the iteration after every row so far has finished
        return len(plan(c))

    rows.append(RowSpec(_prompt(rng, 8, vocab), 5, after_all()))
    links["1"] = {"base": 0, "ssd": False}
    rows.append(RowSpec(_prompt(rng, 30, vocab), 5, after_all()))
    links["2"] = {"base": 1, "ssd": True}
    start = after_all()
    for i in range(b):
        rows.append(RowSpec(shared + [firsts[2 + i]] + _prompt(rng, 5 + 3 * i, vocab), 6 + i, start))
    after = after_all()
    rows.append(RowSpec(list(p0), 4, after))  # turn 1 again: a trimmed (or exact body) snapshot
    rows.append(RowSpec(_prompt(rng, 5, vocab), 5, after))  # turn 2 again, another question
    links[str(len(rows) - 1)] = {"base": 0, "ssd": False}
    rows.append(RowSpec(list(rows[2 + b].prompt), 3, after))  # the last burst row again: its body snapshot
    plan(c)  # raises if any lookup were ambiguous
    return c

