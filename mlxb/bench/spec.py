"""Speculative decoding against plain decoding, on our own engine in one process, same model and run.

Per prompt regime and B: aggregate decode tok/s with ``--spec`` and without (arms interleaved per
repeat: plain, spec, spec, plain), the ratio, and the acceptance the speculating arm saw (drafted and
accepted tokens, from the engine's own counters). Random-weight models do not copy their prompt the
way trained ones do, so the regimes are labelled by how the prompts are built, and the acceptance is
always printed next to the speed:

* ``repetitive``: each prompt is one random block repeated (lookup finds matches everywhere);
* ``random``: unique random tokens (lookup finds little; this arm shows what speculation costs when
  it does not pay, with the adaptive draft length).
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional

import numpy as np

from mlxb.bench.kv import _decode_tps
from mlxb.engine.engine import Engine
from mlxb.engine.spec import SpecConfig

REGIMES = ("repetitive", "random")


def prompts_for(regime: str, n: int, context: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if regime == "repetitive":
        out = []
        for _ in range(n):
            block = rng.integers(5, vocab, size=32).tolist()
            out.append((block * (context // 32 + 1))[:context])
        return out
    if regime == "random":
        return [rng.integers(5, vocab, size=context).tolist() for _ in range(n)]
    raise ValueError(f"regime {regime!r}: choose from {', '.join(REGIMES)}")


def run(model, tokenizer, *, spec: SpecConfig, batches=(1, 8), regimes=REGIMES, context: int = 512, gen: int = 64,
        repeats: int = 2, prefill_chunk: int = 2048, progress: Optional[Callable[[str], None]] = None) -> dict:
    say = progress or (lambda s: None)
    vocab = int(getattr(model.args, "vocab_size", 8192))
    B = max(batches)
    # max_batch 2 at least: a batch of one row is the batch lane (a --batch 1 server is strictly serial)
    engines = {"plain": Engine(model, tokenizer, max_batch=max(B, 2), prefill_chunk=prefill_chunk),
               "spec": Engine(model, tokenizer, max_batch=max(B, 2), prefill_chunk=prefill_chunk, spec=spec)}
    for e in engines.values():
        e.start()
    rows = []
    try:
        for regime in regimes:
            for b in batches:
                for rep in range(repeats):
                    prompts = prompts_for(regime, b, context, vocab, seed=1000 * rep + b)
                    for arm in ("plain", "spec", "spec", "plain"):
                        say(f"{regime} B={b} repeat {rep} {arm}")
                        e = engines[arm]
                        before = dict(e.runner.spec_counts)
                        tps = _decode_tps(e, prompts, gen, prefill_chunk)
                        c = e.runner.spec_counts
                        drafted = c["drafted"] - before.get("drafted", 0)
                        accepted = c["accepted"] - before.get("accepted", 0)
                        rows.append({"regime": regime, "B": b, "repeat": rep, "arm": arm, "tok_s": tps,
                                     "drafted": drafted, "accepted": accepted})
    finally:
        for e in engines.values():
            e.shutdown()
    summary = []
    for regime in regimes:
        for b in batches:
            sel = [r for r in rows if r["regime"] == regime and r["B"] == b]
            plain = [r["tok_s"] for r in sel if r["arm"] == "plain"]
            sp = [r for r in sel if r["arm"] == "spec"]
            ratios = [s / p for s, p in zip([r["tok_s"] for r in sp], plain)]
            drafted = sum(r["drafted"] for r in sp)
            summary.append({"regime": regime, "B": b, "plain_tps": statistics.median(plain),
                            "spec_tps": statistics.median(r["tok_s"] for r in sp),
                            "ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
                            "drafted": drafted, "accepted": sum(r["accepted"] for r in sp),
                            "acceptance": sum(r["accepted"] for r in sp) / drafted if drafted else None})
    return {"config": {"method": spec.method, "draft_model": spec.draft_name, "num_draft_tokens": spec.num_draft_tokens, "adaptive": spec.adaptive,
                       "lookup_ngram": spec.lookup_ngram, "context": context, "gen": gen, "repeats": repeats,
                       "batches": list(batches), "regimes": list(regimes)},
            "rows": rows, "summary": summary}
