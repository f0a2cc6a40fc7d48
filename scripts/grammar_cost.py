"""What do grammar masks cost a decode step? A diagnostic, not a benchmark.

Usage: python scripts/grammar_cost.py MODEL [--batches 1,8,32] [--steps 48] [--out FILE]

For each B it runs B rows of the same prompts twice on an engine driven directly (no server): all rows
unconstrained, then all rows under one regex each (llguidance; ``(ab |cd ){400,}`` never lets a row end
early), and reports the steady decode step (median and p95 ms) of both, plus the host time spent
computing and applying the masks per step (``apply_row_masks``: llguidance's parallel fill of every row's
bitmask, then one device op).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from mlxb.engine.engine import Engine
from mlxb.engine.gateway import _vocab_size
from mlxb.constrain.grammar import Constraint, Grammars
from mlxb.engine.stream import OutputStream
from mlxb.models import load_model
from mlxb.request import Request

REGEX = "(ab |cd ){400,}"


def q(xs, p):
    return float(np.percentile(xs, p)) if xs else None


GRAMMAR = {"g": None}  # the grammar text every constrained row runs (--grammar)


def run(model, tok, grammars, B, steps, constrained, every=1):
    spent = [0.0]
    orig_apply = Constraint.apply

    def timed(fn):
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        return w

    import mlxb.engine.decode as R  # the decode step's module (its masks)

    orig_rows = R.apply_row_masks
    Constraint.apply = timed(orig_apply)  # token 0 (solo rows): one row's mask
    R.apply_row_masks = timed(orig_rows)  # decode steps: every grammar row's mask in one op
    try:
        eng = Engine(model, tok, max_batch=B, prefill_chunk=2048)
        rng = np.random.default_rng(B)
        for i in range(B):
            r = Request(f"g{i}", rng.integers(5, 1000, size=64).tolist(), steps + 16, ignore_eos=True)
            if constrained and i % every == 0:
                r.constraint = grammars.constraint(GRAMMAR["g"], "regex")
            eng.accept(r, OutputStream(r.request_id))
        while len(eng.runner.rows) < B:
            eng.iterate()
        for _ in range(4):  # settle
            eng.iterate()
        times, masks = [], []
        for _ in range(steps):
            spent[0] = 0.0
            t = time.perf_counter()
            eng.iterate()
            times.append(1000 * (time.perf_counter() - t))
            masks.append(1000 * spent[0])
        for lv in eng._live.values():
            lv.cancelled = True
        while eng._live:
            eng.iterate()
        eng.runner.drop_all()
        return times, masks
    finally:
        Constraint.apply, R.apply_row_masks = orig_apply, orig_rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--every", type=int, default=1, help="Constrain every Nth row (2: a mixed batch).")
    ap.add_argument("--grammar", default="regex", help="regex (the pattern above) or tool (a forced call of the "
                    "agent tools in the model's tool format, as bench load --forced-tools sends)")
    ap.add_argument("--out")
    a = ap.parse_args()
    model, tok, _, _ = load_model(a.model)
    grammars = Grammars(tok, _vocab_size(model, tok), sorted(tok.eos_token_ids))
    if a.grammar == "tool":
        from mlxb.bench.datasets import AGENT_TOOLS
        from mlxb.constrain.tools import ToolFormat

        fmt = ToolFormat.of(tok)
        GRAMMAR["g"] = grammars.tool_calls(AGENT_TOOLS, fmt if fmt.forcible else ToolFormat.json_tools(), None, False, "t")
    else:
        GRAMMAR["g"] = grammars.from_regex(REGEX, "r")
    run(model, tok, grammars, 2, 8, True)  # first-use compiles of both paths
    run(model, tok, grammars, 2, 8, False)
    rows = []
    for B in (int(x) for x in a.batches.split(",")):
        free, _ = run(model, tok, grammars, B, a.steps, False)
        cons, masks = run(model, tok, grammars, B, a.steps, True, a.every)
        row = {"B": B, "constrained_rows": len(range(0, B, a.every)), "plain_step_ms": {"median": statistics.median(free), "p95": q(free, 95)},
               "constrained_step_ms": {"median": statistics.median(cons), "p95": q(cons, 95)},
               "mask_ms_per_step": {"median": statistics.median(masks), "p95": q(masks, 95)}}
        row["mask_share_of_step"] = row["mask_ms_per_step"]["median"] / row["constrained_step_ms"]["median"]
        row["constrained_vs_plain"] = row["plain_step_ms"]["median"] / row["constrained_step_ms"]["median"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "grammar": a.grammar, "every": a.every, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
