"""What do grammar masks cost a decode step? A diagnostic, not a benchmark.

Usage: python scripts/grammar_cost.py MODEL [--batches 1,8,32] [--steps 48] [--arms base,one,t2] [--out FILE]

For each B it runs B rows of the same prompts twice on an engine driven directly (no server): all rows
unconstrained, then all rows under one regex each (llguidance; ``(ab |cd ){400,}`` never lets a row end
early), and reports the steady decode step (median and p95 ms) of both, plus the host time spent
computing and applying the masks per step (``apply_row_masks``: llguidance's parallel fill of every row's
bitmask, then one device op), and the engine thread's CPU time per step (``time.thread_time``).

``--arms`` runs the constrained batch under several settings, interleaved over ``--rounds``: ``base`` (as
shipped), ``one`` (MLXB_GRAMMAR_ONE_LAUNCH: last step's tokens read first, forward and masked sampling launched
together), ``tN`` (llguidance's pool with N threads, MLXB_GRAMMAR_THREADS).
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


def set_arm(arm: str) -> None:
    """Put the decode step and llguidance's pool in ``arm``'s setting (see the module notes)."""
    import llguidance

    import mlxb.constrain.grammar as G
    import mlxb.engine.decode as R

    R.GRAMMAR_ONE_LAUNCH = arm == "one"
    threads = int(arm[1:]) if arm.startswith("t") else G.grammar_threads()
    G._EXECUTOR[:] = [llguidance.LLExecutor(threads)]


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
        times, masks, cpu = [], [], []
        for _ in range(steps):
            spent[0] = 0.0
            t, c = time.perf_counter(), time.thread_time()
            eng.iterate()
            times.append(1000 * (time.perf_counter() - t))
            cpu.append(1000 * (time.thread_time() - c))
            masks.append(1000 * spent[0])
        for lv in eng._live.values():
            lv.cancelled = True
        while eng._live:
            eng.iterate()
        eng.runner.drop_all()
        return times, masks, cpu
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
    ap.add_argument("--arms", default="base", help="comma list of base, one, tN (see the module notes)")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the arms, interleaved")
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
    arms = a.arms.split(",")
    for arm in arms:  # first-use compiles of every path
        set_arm(arm)
        run(model, tok, grammars, 2, 8, True)
    run(model, tok, grammars, 2, 8, False)
    rows = []
    for B in (int(x) for x in a.batches.split(",")):
        for rnd in range(a.rounds):
            set_arm("base")
            free, _, free_cpu = run(model, tok, grammars, B, a.steps, False)
            for arm in arms:
                set_arm(arm)
                cons, masks, cpu = run(model, tok, grammars, B, a.steps, True, a.every)
                row = {"B": B, "arm": arm, "round": rnd, "constrained_rows": len(range(0, B, a.every)),
                       "plain_step_ms": {"median": statistics.median(free), "p95": q(free, 95)},
                       "plain_cpu_ms": statistics.median(free_cpu),
                       "constrained_step_ms": {"median": statistics.median(cons), "p95": q(cons, 95)},
                       "constrained_cpu_ms": statistics.median(cpu),
                       "mask_ms_per_step": {"median": statistics.median(masks), "p95": q(masks, 95)}}
                row["mask_share_of_step"] = row["mask_ms_per_step"]["median"] / row["constrained_step_ms"]["median"]
                row["constrained_vs_plain"] = row["plain_step_ms"]["median"] / row["constrained_step_ms"]["median"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "grammar": a.grammar, "every": a.every, "arms": arms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
