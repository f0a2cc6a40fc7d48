"""The speculation controller against fixed draft lengths, at chosen acceptances (``mlxb bench spec --fixed-k``).

One process, one model, one engine per arm: ``plain`` (no speculation), ``auto`` (the adaptive controller,
``mlxb.spec.control``, drafting up to ``--num-draft-tokens``) and ``fixed<K>`` for each K asked for (every
row drafts K tokens every step, as ``serve --spec-fixed``). The proposer of every speculating arm is the
replay proposer (``mlxb.bench.spec.ReplayProposer``): each row's own greedy continuation with every draft
token wrong with probability P, so the acceptance is chosen, not whatever a random-weight model happens to
repeat. Per B and repeat: fresh random prompts and their greedy tails (one untimed plain pass), then for each
P the arms in turn, plain first and last (its figure is the mean of the two). A ratio is an arm's decode
tok/s over that plain figure of the same block; per (B, P) the best fixed K is named and the controller's
ratio is given against it.
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional

import mlx.core as mx

from mlxb.bench.kv import _decode_tps
from mlxb.bench.spec import ReplayProposer, greedy_tails, prompts_for, steps_by_decision, warm_arms
from mlxb.engine.engine import Engine
from mlxb.engine.warmup import warm_up
from mlxb.spec.verify import SpecConfig


def sweep(model, tokenizer, *, spec: SpecConfig, fixed: tuple[int, ...], misses: tuple[float, ...],
          batches=(1, 8), context: int = 512, gen: int = 64, repeats: int = 3, prefill_chunk: int = 2048,
          progress: Optional[Callable[[str], None]] = None,
          checkpoint: Optional[Callable[[dict], None]] = None) -> dict:
    """``checkpoint(result)`` receives the result so far (``complete`` False) after every repeat of every batch
    size, so a run cut short (a device's time limit) still leaves what it measured."""
    say = progress or (lambda s: None)
    vocab = int(getattr(model.args, "vocab_size", 8192))
    B = max(max(batches), 2)
    arms = {"plain": None, "auto": spec}
    for k in fixed:
        arms[f"fixed{k}"] = SpecConfig(method=spec.method, num_draft_tokens=k, lookup_ngram=spec.lookup_ngram,
                                       draft_model=spec.draft_model, draft_name=spec.draft_name,
                                       max_batch=spec.max_batch, adaptive=False, pipeline=spec.pipeline)
    engines = {name: Engine(model, tokenizer, max_batch=B, prefill_chunk=prefill_chunk, spec=cfg)
               for name, cfg in arms.items()}
    for e in engines.values():
        warm_up(e)
        e.start()
    kmax = max([spec.num_draft_tokens, *fixed])
    config = {"method": spec.method, "num_draft_tokens": spec.num_draft_tokens, "fixed": list(fixed),
              "misses": list(misses), "batches": list(batches), "context": context, "gen": gen,
              "repeats": repeats, "pipeline": spec.pipeline, "regime": "replay"}
    rows = []
    try:
        for b in batches:
            warm_arms(engines.values(), b, context, vocab, gen, prefill_chunk)
            for rep in range(repeats):
                prompts = prompts_for("random", b, context, vocab, seed=7919 * rep + b)
                tails = greedy_tails(engines["plain"], prompts, gen + kmax + 1)
                for miss in misses:
                    block = {}
                    order = ["plain", *[a for a in arms if a != "plain"], "plain"]
                    for i, arm in enumerate(order):
                        say(f"B={b} repeat {rep} miss {miss} {arm}")
                        e = engines[arm]
                        before, tm0 = dict(e.runner.spec_counts), dict(e.runner.timing)
                        e.runner.step_cost.trace.clear()
                        row_start = e.runner.step_cost.verify_samples(b)  # what the arm's controller starts from
                        real = e.runner.proposer
                        if arm != "plain":
                            e.runner.proposer = ReplayProposer([p + t for p, t in zip(prompts, tails)], miss, vocab,
                                                               seed=rep)
                        failed = None
                        pool_start = mx.get_cache_memory() / 1e9
                        mx.reset_peak_memory()
                        try:
                            tps = _decode_tps(e, prompts, gen, prefill_chunk)
                        except RuntimeError as err:  # a row failed (out of device memory at this B, say): a
                            tps, failed = None, str(err)[:300]  # recorded arm, and the sweep goes on
                            mx.clear_cache()
                        finally:
                            e.runner.proposer = real
                        c = e.runner.spec_counts
                        row = {"B": b, "repeat": rep, "miss": miss, "arm": arm, "tok_s": tps, "failed": failed,
                               "drafted": c["drafted"] - before.get("drafted", 0),
                               "accepted": c["accepted"] - before.get("accepted", 0)}
                        row.update(plain_step_ms(tm0, e.runner.timing))
                        # device memory: the arm's peak and what stays in use and in MLX's pool after it (the
                        # H100 ran out of memory in fixed-K arms at B=32, stop 67: where it went was not recorded)
                        row.update(peak_gb=mx.get_peak_memory() / 1e9, active_gb=mx.get_active_memory() / 1e9,
                                   pool_gb=mx.get_cache_memory() / 1e9, pool_start_gb=pool_start)
                        mx.clear_cache()  # untimed: the next arm starts from an empty pool (fixed-K arms left
                        # 44-63 GB of free buffers on the H100 in stop 68 and the next arm ran out of device memory)
                        if arm == "auto":
                            row.update(steps_by_decision(e.runner.step_cost.trace, b))
                            row["cost_ratio"] = e.runner.step_cost.ratio_at(b)
                            row["verify_samples_at_start"] = row_start
                        block.setdefault(arm, []).append(row)
                    ok = [r["tok_s"] for r in block["plain"] if r["tok_s"] is not None]
                    plain = statistics.mean(ok) if ok else None
                    for arm, got in block.items():
                        for r in got:
                            r["ratio"] = (r["tok_s"] / plain if arm != "plain" and plain and r["tok_s"] is not None
                                          else None)
                            rows.append(r)
                if checkpoint is not None:
                    checkpoint({"config": config, "rows": list(rows), "summary": summarize(rows), "complete": False})
    finally:
        for e in engines.values():
            e.shutdown()
    return {"config": config, "rows": rows, "summary": summarize(rows), "complete": True}


def plain_step_ms(before: dict, after: dict) -> dict:
    """Where an arm's plain (pipelined) steps went, per step: building the forward, launching it, waiting for
    the step before it, emitting (the runner's host timings; a verify step is not in them)."""
    steps = after.get("steps", 0) - before.get("steps", 0)
    if not steps:
        return {}
    return {f"plain_{k[:-2]}_ms": 1000 * (after.get(k, 0.0) - before.get(k, 0.0)) / steps
            for k in ("build_s", "launch_s", "wait_s", "emit_s")}


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for b in sorted({r["B"] for r in rows}):
        for miss in sorted({r["miss"] for r in rows}):
            sel = [r for r in rows if r["B"] == b and r["miss"] == miss and r["arm"] != "plain"]
            med = {}
            for arm in sorted({r["arm"] for r in sel}):
                ratios = [r["ratio"] for r in sel if r["arm"] == arm and r["ratio"] is not None]
                if not ratios:  # every repeat of this arm failed (its rows say why)
                    med[arm] = {"ratio_median": None, "failed": sum(1 for r in sel if r["arm"] == arm)}
                    continue
                drafted = sum(r["drafted"] for r in sel if r["arm"] == arm)
                med[arm] = {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                            "ratio_max": max(ratios),
                            "acceptance": sum(r["accepted"] for r in sel if r["arm"] == arm) / drafted if drafted else None}
            fixed = {a: v for a, v in med.items() if a.startswith("fixed") and v["ratio_median"] is not None}
            best = max(fixed, key=lambda a: fixed[a]["ratio_median"]) if fixed else None
            auto = med.get("auto")
            out.append({"B": b, "miss": miss, "arms": med, "best_fixed": best,
                        "auto_vs_best": (auto["ratio_median"] / max(fixed[best]["ratio_median"], 1.0)
                                         if auto and auto["ratio_median"] is not None and best else None)})
    return out
