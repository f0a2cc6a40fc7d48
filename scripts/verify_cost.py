"""What a lone row's speculative verify forward costs against a plain step, and whether its logits equal the
plain steps' (mlx-lm's own KVCache and model; no engine): a [1, 1+K] forward with MLX's attention as it is,
with ``mlxb.kernels.causal_split`` installed, and with the skinny matmul on top; each against K+1 sequential
one-token steps over the same tokens. Writes JSON to --out.

    python3 scripts/verify_cost.py MODEL --out verify.json [--context 512] [--k 2,4] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxb.kernels import causal_split, skinny


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--force", action="store_true", help="off CUDA: install the split anyway, no skinny (a dry run)")
    a = ap.parse_args()
    model, _ = load(a.model)
    vocab = model.args.vocab_size
    prompt = mx.random.randint(0, vocab, (1, a.context), key=mx.random.key(0))
    cache = make_prompt_cache(model)
    mx.eval(model(prompt, cache=cache))

    def forward(tokens):  # one forward of [1, n] tokens; the cache is put back after
        out = model(tokens, cache=cache)
        mx.eval(out)
        for c in cache:
            c.trim(tokens.shape[1])
        return out[0].astype(mx.float32)

    def sequential(tokens):
        outs = []
        for i in range(tokens.shape[1]):
            o = model(tokens[:, i:i + 1], cache=cache)
            mx.eval(o)
            outs.append(o[0, 0].astype(mx.float32))
        for c in cache:
            c.trim(tokens.shape[1])
        return mx.stack(outs)

    def timed(fn, tokens):
        fn(tokens)  # first shape compiles
        ts = []
        for _ in range(a.repeats):
            mx.synchronize()
            t0 = time.perf_counter()
            fn(tokens)
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts), min(ts)

    res = {"model": a.model, "context": a.context, "device": str(mx.default_device()), "mlx": mx.__version__, "rows": []}
    one = mx.array([[5]])
    res["plain_step_ms"] = timed(forward, one)
    print("plain step ms (median, min):", res["plain_step_ms"], flush=True)
    for k in [int(x) for x in a.k.split(",")]:
        toks = mx.random.randint(0, vocab, (1, k + 1), key=mx.random.key(k))
        ref = sequential(toks)
        for arm in ("mlx", "split", "split+skinny"):
            causal_split.uninstall()
            skinny.uninstall(model)
            if arm != "mlx":
                assert causal_split.install(force=a.force) is not None, "causal_split did not install"
            if arm == "split+skinny" and not a.force:
                skinny.self_check()
                skinny.install(model)
            got = forward(toks)
            med, mn = timed(forward, toks)
            row = {"k": k, "arm": arm, "verify_ms": med, "verify_min_ms": mn,
                   "positions_equal_plain": int(mx.all(got == ref, axis=-1).sum().item()),
                   "argmax_equal_plain": int((mx.argmax(got, -1) == mx.argmax(ref, -1)).sum().item()),
                   "max_abs_diff": mx.abs(got - ref).max().item()}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        causal_split.uninstall()
        skinny.uninstall(model)
        res.setdefault("sequential_ms", {})[k] = timed(sequential, toks)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
