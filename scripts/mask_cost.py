"""What does the padding mask cost a decode step? A diagnostic, not a benchmark.

Usage: python scripts/mask_cost.py MODEL [--batches 8,64] [--steps 64]

On one batch cache (B equal-length rows, so no row is padded) it times steady-state decode steps
of the model three ways, interleaved: no mask (what an aligned batch runs), mlx-lm's boolean
padding mask, and the same mask turned into an additive one once per step. Prints the median
step in ms and the host time of the graph build and of ``mx.async_eval`` for each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from mlxb.cache.protocol import AlignedBatchKVCache
from mlxb.models import load_model


def prefill(model, B, L, vocab):
    rng = np.random.default_rng(0)
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    caches = [AlignedBatchKVCache([0] * B) for _ in caches]
    model(mx.array(rng.integers(3, vocab - 1, size=(B, L))), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def run(model, caches, mode, steps, B):
    from mlx_lm.models.cache import BatchKVCache

    orig = AlignedBatchKVCache.make_mask

    def make_mask(self, N, return_array=False, **kw):
        if mode == "none":
            return None
        m = BatchKVCache.make_mask(self, N, **kw)  # mlx-lm's boolean mask
        if mode == "additive":
            m = mx.where(m, mx.array(0, self.keys.dtype), mx.array(-mx.inf, self.keys.dtype))
        return m

    AlignedBatchKVCache.make_mask = make_mask
    try:
        tok = mx.zeros((B,), dtype=mx.uint32)
        stamps, build, launch = [], [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = model(tok[:, None], cache=caches)[:, -1, :]
            nxt = mx.argmax(logits, axis=-1).astype(mx.uint32)
            t1 = time.perf_counter()
            mx.async_eval(nxt)
            t2 = time.perf_counter()
            tok.tolist()
            tok = nxt
            stamps.append(time.perf_counter())
            build.append(t1 - t0)
            launch.append(t2 - t1)
        mx.eval(tok)
        for c in caches:
            c.trim(steps)
    finally:
        AlignedBatchKVCache.make_mask = orig
    gaps = np.diff(stamps)[steps // 4:]
    return 1e3 * float(np.median(gaps)), 1e3 * statistics.median(build), 1e3 * statistics.median(launch)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    model, _, _, _ = load_model(a.model)
    vocab = int(model.args.vocab_size)
    for B in [int(b) for b in a.batches.split(",")]:
        caches = prefill(model, B, a.prompt_len, vocab)
        res = {m: [] for m in ("none", "bool", "additive")}
        for r in range(a.rounds + 1):  # round 0 warms every shape
            for m in res:
                out = run(model, caches, m, a.steps, B)
                if r:
                    res[m].append(out)
        for m, rs in res.items():
            step, build, launch = (statistics.median(x[i] for x in rs) for i in range(3))
            print(f"B={B:3d} mask={m:8s} step {step:6.2f} ms  build {build:5.2f} ms  async_eval {launch:5.2f} ms")


if __name__ == "__main__":
    main()
