"""What does a forward at a never-seen shape cost? A diagnostic, not a benchmark.

Usage: python scripts/shape_cost.py MODEL [--out FILE]

Runs the forwards an agent burst produces (a solo 2k prefill, the leader's tail, a left-padded
cohort of followers on a cached prefix, decode steps at new batch sizes) twice in a row, each on a
fresh batch cache, and prints the first (cold) and second (warm) wall time of the timed forward.
On CUDA, MLX builds a cuDNN attention graph for every new (shape, strides, mask) key; run this
script with MLX_CUDA_USE_CUDNN_SDPA=0 and =1 to see what that costs.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import mlx.core as mx
import numpy as np

from mlxb.models import load_model

# (rows, cached context, new tokens, left-padded): the shapes of a 2k-system-prompt agent burst
SHAPES = [(1, 0, 2048, False), (1, 2048, 163, False), (7, 2211, 81, True), (8, 2292, 1, False),
          (8, 2293, 1, True), (21, 2211, 81, True), (5, 2211, 83, True), (29, 2292, 1, True),
          (32, 2300, 1, False), (9, 2211, 79, True)]


def forward(model, rows, ctx, new, padded, vocab):
    from mlx_lm.models.cache import BatchKVCache

    rng = np.random.default_rng(rows * 7 + new)
    pad = [(i % 5) if padded else 0 for i in range(rows)]
    caches = [BatchKVCache(pad) for _ in model.layers]
    if ctx:
        model(mx.array(rng.integers(3, vocab - 1, size=(rows, ctx))), cache=caches)
        mx.eval([c.state for c in caches])
    x = mx.array(rng.integers(3, vocab - 1, size=(rows, new)))
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(model(x, cache=caches))
    dt = time.perf_counter() - t0
    del caches
    mx.clear_cache()
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out")
    a = ap.parse_args()
    model, tok, _, _ = load_model(a.model)
    vocab = model.args.vocab_size
    forward(model, 1, 0, 16, False, vocab)  # first-use compiles of the ordinary kernels
    rows = []
    for shape in SHAPES:
        cold = forward(model, *shape, vocab)
        warm = forward(model, *shape, vocab)
        rows.append({"rows": shape[0], "ctx": shape[1], "new": shape[2], "padded": shape[3],
                     "cold_ms": round(1000 * cold, 2), "warm_ms": round(1000 * warm, 2)})
        print(json.dumps(rows[-1]), flush=True)
    res = {"cudnn_sdpa": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "default"), "device": str(mx.default_device()),
           "shapes": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
