"""What ``mx.compile`` takes out of a B=1 decode step without touching the KV cache (issue 19 probe).

The cache write stays outside any compiled function; only per-layer pieces whose shapes do not
change from step to step are compiled: the MLP block (gate, up, activation, down) and, separately,
the whole MLP + its residual and norm. mlx-lm's own ``generate_step`` drives the loop in every arm,
so the arms differ only in the module calls. Prints ms per token per arm (median of repeats,
interleaved), and whether the greedy tokens equal the plain arm's.

    python scripts/probes/compile_probe.py MODEL [--gen 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlxb.models import load_model


def layers(model):
    inner = getattr(model, "model", model)
    return inner.layers


class Compiled:
    """Swap each layer's ``mlp`` for a compiled call of the same module (weights captured as constants)."""

    def __init__(self, model):
        self.model, self.saved = model, []

    def __enter__(self):
        for layer in layers(self.model):
            mlp = layer.mlp
            fn = mx.compile(lambda x, m=mlp: m(x))
            self.saved.append((layer, mlp))
            layer.mlp = _Wrap(mlp, fn)
        return self

    def __exit__(self, *a):
        for layer, mlp in self.saved:
            layer.mlp = mlp


class _Wrap:
    def __init__(self, mod, fn):
        self.mod, self.fn = mod, fn

    def __call__(self, x):
        return self.fn(x)


def run(model, prompt, gen):
    toks = []
    t0 = time.perf_counter()
    for (tok, _), _ in zip(generate_step(prompt, model), range(gen)):
        toks.append(int(tok))
        if len(toks) == 1:
            t1 = time.perf_counter()
    t2 = time.perf_counter()
    return toks, (t2 - t1) / (gen - 1) * 1e3, t1 - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    model, tok, _, _ = load_model(a.model)
    prompt = mx.array(list(range(100, 228)), dtype=mx.uint32)
    run(model, prompt, 8)
    with Compiled(model):
        run(model, prompt, 8)
    res = {"plain": [], "compiled_mlp": []}
    ref = None
    same = True
    for _ in range(a.repeats):
        t, ms, _ = run(model, prompt, a.gen)
        ref = ref or t
        res["plain"].append(ms)
        with Compiled(model):
            t2, ms2, _ = run(model, prompt, a.gen)
        same = same and t2 == ref
        res["compiled_mlp"].append(ms2)
    for k, v in res.items():
        print(f"{k:14s} ms/token median {statistics.median(v):.3f} min {min(v):.3f} max {max(v):.3f}")
    ratio = [p / c for p, c in zip(res["plain"], res["compiled_mlp"])]
    print(f"speed-up (plain / compiled) median {statistics.median(ratio):.3f} [{min(ratio):.3f}, {max(ratio):.3f}]; "
          f"tokens equal: {same}; device {mx.default_device()}")


if __name__ == "__main__":
    main()
