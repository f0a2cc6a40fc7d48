"""Quantized KV against full width, on our own engine in one process (mlx-lm has no batched quantized KV).

Two numbers per scheme, both ratios against full width measured in the same run:

* **admission**: rows the scheduler admits under one ``--kv-budget`` at a given context (from the
  engine's own byte projection, which admission uses);
* **decode**: aggregate tok/s at B rows of ``context`` tokens, arms interleaved per repeat
  (full, quantized, quantized, full) so machine drift hits both.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import numpy as np

from mlxb.cache.quantized import KVScheme
from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.request import Request


def _decode_tps(engine: Engine, prompts: list[list[int]], gen: int) -> float:
    streams = []
    for i, p in enumerate(prompts):
        r = Request(f"kv{time.perf_counter_ns()}-{i}", p, gen, ignore_eos=True)
        streams.append(OutputStream(r.request_id))
        engine.submit(r, streams[-1])
    t0, n = None, 0
    for st in streams:
        for out in st:
            if out.token is not None:
                n += 1
                t0 = t0 or time.perf_counter()
    # from the first token on: decode throughput, not the prefill
    return (n - len(prompts)) / (time.perf_counter() - t0)


def run(model, tokenizer, *, bits=(8, 4), group_size: int = 64, batches=(8, 32), context: int = 1024, gen: int = 64,
        repeats: int = 2, admit_context: int = 4096, progress: Optional[Callable[[str], None]] = None) -> dict:
    say = progress or (lambda s: None)
    vocab = int(getattr(model.args, "vocab_size", 8192))
    rng = np.random.default_rng(0)
    full = Engine(model, tokenizer, max_batch=max(batches), prefill_chunk=2048)
    engines = {"full": full}
    for b in bits:
        engines[f"kv{b}"] = Engine(model, tokenizer, max_batch=max(batches), prefill_chunk=2048,
                                   kv_scheme=KVScheme(b, group_size, 0))
    admission = []
    per_row = {k: e.projection.row_bytes(admit_context + gen) for k, e in engines.items()}
    budget = 64 * per_row["full"]  # room for 64 full-width rows
    for k, nbytes in per_row.items():
        admission.append({"scheme": k, "row_bytes": nbytes, "rows_admitted": budget // nbytes,
                          "ratio_vs_full": (budget // nbytes) / (budget // per_row["full"])})
    for e in engines.values():
        e.start()
    rows = []
    try:
        for B in batches:
            ps = [rng.integers(3, vocab - 1, size=context).tolist() for _ in range(B)]
            for k, e in engines.items():  # warm every arm at this shape, untimed
                say(f"warm-up {k} B={B}")
                _decode_tps(e, ps, 8)
            for rep in range(repeats):
                for b in bits:
                    k = f"kv{b}"
                    say(f"repeat {rep + 1}/{repeats}: B={B} full vs {k}")
                    f1, q1, q2, f2 = (_decode_tps(full, ps, gen), _decode_tps(engines[k], ps, gen),
                                      _decode_tps(engines[k], ps, gen), _decode_tps(full, ps, gen))
                    rows.append({"B": B, "scheme": k, "repeat": rep, "full_tps": (f1 + f2) / 2, "quant_tps": (q1 + q2) / 2,
                                 "ratio": (q1 + q2) / (f1 + f2)})
    finally:
        for e in engines.values():
            e.shutdown()
    summary = []
    for key in sorted({(r["B"], r["scheme"]) for r in rows}):
        rs = [r for r in rows if (r["B"], r["scheme"]) == key]
        summary.append({"B": key[0], "scheme": key[1], "full_tps": statistics.median(r["full_tps"] for r in rs),
                        "quant_tps": statistics.median(r["quant_tps"] for r in rs),
                        "ratio_min": min(r["ratio"] for r in rs), "ratio_median": statistics.median(r["ratio"] for r in rs),
                        "ratio_max": max(r["ratio"] for r in rs)})
    return {"admission": admission, "rows": rows, "summary": summary,
            "config": {"bits": list(bits), "group_size": group_size, "batches": list(batches), "context": context,
                       "gen": gen, "repeats": repeats, "admit_context": admit_context}}
