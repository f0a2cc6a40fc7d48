"""Where a decode step's attention time goes with quantized KV: one layer's attention at B rows of
``context`` keys, full width (``mx.fast.scaled_dot_product_attention``) against mlx-lm's quantized
path (``quantized_scaled_dot_product_attention``: two ``quantized_matmul``s and a softmax), timed
piece by piece with a synchronization after each, plus the bytes each reads.

    python scripts/kv_attention_cost.py MODEL_DIR --context 8192 --batches 8,32 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from mlxb.models import load_model


def timed(fn, reps: int) -> float:
    mx.eval(fn())  # warm (kernels, graphs)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args()
    model, _, spec, _ = load_model(a.model)
    args = model.args
    hq, hkv = args.num_attention_heads, getattr(args, "num_key_value_heads", args.num_attention_heads)
    d = getattr(args, "head_dim", None) or args.hidden_size // hq
    dt = model.layers[0].self_attn.q_proj.weight.dtype
    layers = len(model.layers)
    del model
    scale = d ** -0.5
    rows = []
    for B in (int(b) for b in a.batches.split(",")):
        k = mx.random.normal((B, hkv, a.context, d)).astype(dt)
        v = mx.random.normal((B, hkv, a.context, d)).astype(dt)
        q = mx.random.normal((B, hq, 1, d)).astype(dt)
        mx.eval(k, v, q)
        full = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None), a.reps)
        rows.append({"B": B, "scheme": "full", "attention_ms": full, "kv_bytes": k.nbytes + v.nbytes})
        for bits in (int(b) for b in a.bits.split(",")):
            qk = mx.quantize(k, group_size=a.group_size, bits=bits)
            qv = mx.quantize(v, group_size=a.group_size, bits=bits)
            mx.eval(qk, qv)
            att = timed(lambda: quantized_scaled_dot_product_attention(q, qk, qv, scale, None, a.group_size, bits), a.reps)
            # the pieces, each synchronized: scores, softmax, weighted sum
            rep = hq // hkv
            qq = (q * scale).reshape(B, hkv, rep, 1, d)
            ek = tuple(mx.expand_dims(x, -3) for x in qk)
            ev = tuple(mx.expand_dims(x, -3) for x in qv)
            scores = mx.quantized_matmul(qq, *ek, transpose=True, group_size=a.group_size, bits=bits)
            mx.eval(scores)
            probs = mx.softmax(scores, axis=-1, precise=True)
            mx.eval(probs)
            t_scores = timed(lambda: mx.quantized_matmul(qq, *ek, transpose=True, group_size=a.group_size, bits=bits), a.reps)
            t_soft = timed(lambda: mx.softmax(scores, axis=-1, precise=True), a.reps)
            t_out = timed(lambda: mx.quantized_matmul(probs, *ev, transpose=False, group_size=a.group_size, bits=bits), a.reps)
            nbytes = sum(x.nbytes for x in qk + qv)
            rows.append({"B": B, "scheme": f"kv{bits}", "attention_ms": att, "scores_ms": t_scores, "softmax_ms": t_soft,
                         "weighted_sum_ms": t_out, "kv_bytes": nbytes, "ratio_vs_full": full / att})
        for r in rows[-3:]:
            print(json.dumps(r))
    res = {"model": spec.name, "dtype": str(dt), "layers": layers, "heads": [hq, hkv, d], "context": a.context,
           "group_size": a.group_size, "device": str(mx.default_device()), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
