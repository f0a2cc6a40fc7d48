"""Does mixing step shapes cost more than each shape alone on MLX's CUDA backend (its graph cache)?

MLX records kernels into CUDA graphs of at most ``MLX_MAX_OPS_PER_BUFFER`` (20) kernels and keeps the executable
graphs in an LRU cache of ``MLX_CUDA_GRAPH_CACHE_SIZE`` (400) keyed by topology. An engine that alternates plain
steps, verify steps and several batch sizes has the working set of all of them; if it exceeds the cache, every
alternation re-instantiates graphs. This probe runs mlx-lm's own model and ``KVCache`` (no engine) over a
CONTEXT-token prompt and times synchronized forwards of each shape [B, L], first each shape alone (R steps in a
row), then all shapes interleaved round-robin (R rounds), trimming the caches back after every forward. Run it
in separate processes at two cache sizes to compare. Writes JSON to --out.

    MLX_CUDA_GRAPH_CACHE_SIZE=N python3 scripts/probes/graph_mix_probe.py MODEL --out F [--shapes 1x1,1x5,8x1,8x5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--shapes", default="1x1,1x5,8x1,8x5,1x3,8x3")
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    model, _ = load(a.model)
    vocab = model.args.vocab_size
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    caches = {}
    for b in sorted({b for b, _ in shapes}):
        c = make_prompt_cache(model)
        mx.eval(model(mx.random.randint(0, vocab, (b, a.context), key=mx.random.key(b)), cache=c))
        caches[b] = c

    def step(b: int, n: int) -> float:
        toks = mx.random.randint(0, vocab, (b, n), key=mx.random.key(n))
        mx.eval(toks)
        t0 = time.perf_counter()
        mx.eval(model(toks, cache=caches[b]))
        dt = time.perf_counter() - t0
        for c in caches[b]:
            c.trim(n)
        return dt * 1e3

    for s in shapes:  # first use of every shape (kernel compiles) out of the timings
        step(*s)
        step(*s)
    alone = {f"{b}x{n}": statistics.median(step(b, n) for _ in range(a.repeats)) for b, n in shapes}
    mixed_t = {f"{b}x{n}": [] for b, n in shapes}
    for _ in range(a.repeats):
        for b, n in shapes:
            mixed_t[f"{b}x{n}"].append(step(b, n))
    mixed = {k: statistics.median(v) for k, v in mixed_t.items()}
    res = {"graph_cache_size": os.environ.get("MLX_CUDA_GRAPH_CACHE_SIZE", "default"),
           "ops_per_buffer": os.environ.get("MLX_MAX_OPS_PER_BUFFER", "default"), "context": a.context,
           "alone_ms": alone, "mixed_ms": mixed, "mixed_over_alone": {k: round(mixed[k] / alone[k], 3) for k in alone}}
    print(json.dumps(res))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
