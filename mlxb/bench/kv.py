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

from mlxb.cache.kv_plan import KVScheme
from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.request import Request


class _Timed(OutputStream):
    """Records when each token is put (the engine's time, not when the bench reads it)."""

    def __init__(self, request_id: str):
        super().__init__(request_id)
        self.times: list[float] = []

    def put(self, item, outbox=None):
        if item.token is not None:
            self.times.append(time.perf_counter())
        super().put(item, outbox)


def _decode_tps(engine: Engine, prompts: list[list[int]], gen: int, chunk: int, adapters=None) -> float:
    """Aggregate tok/s while all B rows decode together: from the last row's first token to the first
    row's last token. Rows prefill one after another while earlier rows decode, so each row gets
    ``gen`` tokens plus the steps it decodes during the later rows' prefill chunks; those steps (and
    the tail where rows have finished) are outside the window."""
    chunks = sum(-(-len(p) // chunk) for p in prompts)
    streams = []
    for i, p in enumerate(prompts):
        r = Request(f"kv{time.perf_counter_ns()}-{i}", p, gen + chunks + 2, ignore_eos=True,
                    adapter=adapters[i] if adapters else -1)
        streams.append(_Timed(r.request_id))
        engine.submit(r, streams[-1])
    for st in streams:
        for out in st:
            if out.error is not None or out.finish_reason == "error":
                raise RuntimeError(f"row {st.request_id} failed: {out.error!r}")
    start = max(st.times[0] for st in streams)
    end = min(st.times[-1] for st in streams)
    n = sum(sum(1 for t in st.times if start < t <= end) for st in streams)
    if end <= start or n == 0:
        raise RuntimeError("no window where every row decodes; raise --gen")
    return n / (end - start)


def run(model, tokenizer, *, bits=(8, 4), group_size: int = 64, batches=(8, 32), context: int = 1024, gen: int = 64,
        repeats: int = 2, admit_context: int = 4096, prefill_chunk: int = 2048, kv_start: int = 0, progress: Optional[Callable[[str], None]] = None,
        on_row: Optional[Callable[[dict], None]] = None) -> dict:
    """``on_row`` gets each repeat's measurement as it is taken, so a run cut short still tells what it had."""
    say = progress or (lambda s: None)
    vocab = int(getattr(model.args, "vocab_size", 8192))
    rng = np.random.default_rng(0)
    full = Engine(model, tokenizer, max_batch=max(batches), prefill_chunk=prefill_chunk)
    engines = {"full": full}
    for b in bits:
        engines[f"kv{b}"] = Engine(model, tokenizer, max_batch=max(batches), prefill_chunk=prefill_chunk,
                                   kv_scheme=KVScheme(b, group_size, kv_start))
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
                _decode_tps(e, ps, 8, prefill_chunk)
            for rep in range(repeats):
                for b in bits:
                    k = f"kv{b}"
                    say(f"repeat {rep + 1}/{repeats}: B={B} full vs {k}")
                    f1, q1, q2, f2 = (_decode_tps(full, ps, gen, prefill_chunk), _decode_tps(engines[k], ps, gen, prefill_chunk),
                                      _decode_tps(engines[k], ps, gen, prefill_chunk), _decode_tps(full, ps, gen, prefill_chunk))
                    rows.append({"B": B, "scheme": k, "repeat": rep, "full_tps": (f1 + f2) / 2, "quant_tps": (q1 + q2) / 2,
                                 "ratio": (q1 + q2) / (f1 + f2)})
                    if on_row is not None:
                        on_row(rows[-1])
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
                       "gen": gen, "repeats": repeats, "admit_context": admit_context,
                       "prefill_chunk": prefill_chunk, "quantized_kv_start": kv_start, "window": "all rows decoding"}}
