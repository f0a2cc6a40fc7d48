"""Tensor-parallel benchmark: our engine sharded over N ranks against our engine on rank 0's device
alone, on the same model, prompts and process group, in one run.

Started on every rank by ``mlx.launch`` (``mlxb bench tp --tp N``). Rank 0 holds two engines: one
over the whole model (``tp1``: the other ranks sit idle) and one over its shard (``tpN``: every rank
decodes). Arms alternate within each repeat (tpN, tp1, tp1, tpN for B=1; tpN, tp1 for the
aggregates) so drift hits both; every number is a ratio measured in the same repeat.

Before the engines start, every rank times ``all_sum`` on the activation shapes a decode step
reduces ([B, 1, hidden] in the model's dtype; two per layer for llama-style sharding), which gives
the all-reduce share of a step and the bandwidth a wider ``--tp`` or several hosts would need.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Callable, Optional

import mlx.core as mx

from mlxb.bench.engine import _prompts, ours
from mlxb.engine.engine import Engine
from mlxb.distributed.leader import Link, TPRunner
from mlxb.engine.warmup import freeze_heap, warm_up


def allreduce_cost(link: Link, hidden: int, layers: int, dtype, batches, iters: int = 50) -> list[dict]:
    """Every rank: the time of one ``all_sum`` of [B, 1, hidden] and of a decode step's worth of them."""
    out = []
    for B in batches:
        x = mx.ones((B, 1, hidden), dtype=dtype)
        for _ in range(5):
            mx.eval(mx.distributed.all_sum(x, group=link.group))
        t0 = time.perf_counter()
        for _ in range(iters):
            mx.eval(mx.distributed.all_sum(x, group=link.group))
        one = (time.perf_counter() - t0) / iters
        out.append({"B": B, "bytes": B * hidden * x.dtype.size, "one_ms": 1000 * one, "per_step_ms": 1000 * one * 2 * layers,
                    "reduces_per_step": 2 * layers})
    return out


def model_shape(model) -> tuple[int, int, object]:
    args = model.args
    hidden = int(getattr(args, "hidden_size", 0) or getattr(args, "dim", 0))
    from mlx.utils import tree_flatten

    floats = [v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    return hidden, len(model.layers), max(set(floats), key=floats.count)  # activations take the weights' dtype


def run(full, sharded, tokenizer, link: Link, *, batches=(1, 32, 64), prompt_len=64, gen=128, repeats=3,
        prefill_len=512, progress: Optional[Callable[[str], None]] = None) -> dict:
    say = progress or (lambda s: None)
    vocab = int(getattr(full.args, "vocab_size", 8192))
    big = max(batches)
    one = Engine(full, tokenizer, max_batch=big)
    warm_up(one)
    one.start()
    tp = Engine(sharded, tokenizer, max_batch=big, runner_cls=partial(TPRunner, link=link))
    warm_up(tp)
    tp.start()
    freeze_heap()
    n = link.size
    rows: list[dict] = []
    try:
        for B in batches:  # every shape once per arm, untimed (first-use kernel compiles)
            say(f"warm-up B={B}")
            ps = _prompts(B, prompt_len, vocab, 5000 + B)
            ours(tp, ps, gen)
            ours(one, ps, gen)
        pw = _prompts(1, prefill_len, vocab, 98)[0]
        ours(tp, [pw], 2)
        ours(one, [pw], 2)
        for rep in range(repeats):
            say(f"repeat {rep + 1}/{repeats}: B=1 decode")
            p1 = _prompts(1, prompt_len, vocab, rep)[0]
            a1, b1, b2, a2 = ours(tp, [p1], gen), ours(one, [p1], gen), ours(one, [p1], gen), ours(tp, [p1], gen)
            rows.append({"metric": "b1_decode_tps", "B": 1, "repeat": rep, "tp": (a1["decode"] + a2["decode"]) / 2,
                         "one": (b1["decode"] + b2["decode"]) / 2, "tp_step_timing": a2["timing"]})
            pp = _prompts(1, prefill_len, vocab, 100 + rep)[0]
            a, b = ours(tp, [pp], 2), ours(one, [pp], 2)
            rows.append({"metric": "prefill_tps", "B": 1, "repeat": rep, "tp": prefill_len / a["ttft"],
                         "one": prefill_len / b["ttft"]})
            for B in batches:
                if B == 1:
                    continue
                say(f"repeat {rep + 1}/{repeats}: aggregate B={B}")
                ps = _prompts(B, prompt_len, vocab, 1000 * rep + B)
                a, b = ours(tp, ps, gen), ours(one, ps, gen)
                assert a["tokens"] == b["tokens"] == B * gen, (a["tokens"], b["tokens"])
                rows.append({"metric": "aggregate_tps", "B": B, "repeat": rep, "tp": a["tokens"] / a["wall"],
                             "one": b["tokens"] / b["wall"], "tp_step_timing": a["timing"], "one_step_timing": b["timing"]})
        tp_stats = tp.stats()["tensor_parallel"]
    finally:
        tp.shutdown()  # the other ranks leave their loops
        one.shutdown()
    for r in rows:
        r["ratio"] = r["tp"] / r["one"]
    summary = []
    for key in sorted({(r["metric"], r["B"]) for r in rows}):
        sel = [r for r in rows if (r["metric"], r["B"]) == key]
        rs = [r["ratio"] for r in sel]
        summary.append({"metric": key[0], "B": key[1], "tp_median": statistics.median(r["tp"] for r in sel),
                        "one_median": statistics.median(r["one"] for r in sel), "ratio_min": min(rs),
                        "ratio_median": statistics.median(rs), "ratio_max": max(rs)})
    return {"rows": rows, "summary": summary, "ranks": n, "tensor_parallel": tp_stats,
            "config": {"batches": list(batches), "prompt_len": prompt_len, "gen": gen, "repeats": repeats,
                       "prefill_len": prefill_len}}
