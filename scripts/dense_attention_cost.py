"""One layer's decode attention on a masked full-precision batch: MLX's read (its fallback with a boolean mask on
CUDA) against mlxb's fused kernel (``--kv-attention fused``, mlxb/kernels/dense_attention.py), and a shared prefix
read by the cascade (``mlxb.cache.shared.cascade_attention``) against the same kernel with the prefix as chunks.
Each arm's median of ``--reps`` synchronized calls, and its largest difference from float32 attention.
A diagnostic for the device (the kernel needs MLX's CUDA backend), not a benchmark.

    python scripts/dense_attention_cost.py --batches 8,32,64 --context 2048,8192 [--prefix 1536] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from mlxb.cache.shared import cascade_attention
from mlxb.kernels import dense_attention as da


def timed(fn, reps: int) -> float:
    mx.eval(fn())  # warm (kernels, graphs)
    ts = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,32,64")
    ap.add_argument("--context", default="2048,8192", help="own keys per row (the widest row; others left-padded)")
    ap.add_argument("--prefix", type=int, default=1536, help="shared-prefix keys for the cascade arms (0: none)")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim (Llama-3-8B)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args()
    hq, hkv, D = (int(x) for x in a.heads.split(","))
    da.set_enabled(True)  # the self-check first; refuses off CUDA
    dt, scale, rows = mx.bfloat16, D ** -0.5, []
    with da.ours():
        for B in (int(b) for b in a.batches.split(",")):
            for n in (int(c) for c in a.context.split(",")):
                ks = mx.random.split(mx.random.key(B * 7 + n), 5)
                width = n + 256  # the batch buffer is wider than what is written
                kb = mx.random.normal((B, hkv, width, D), key=ks[0]).astype(dt)
                vb = mx.random.normal((B, hkv, width, D), key=ks[1]).astype(dt)
                q = mx.random.normal((B, hq, 1, D), key=ks[2]).astype(dt)
                k, v = kb[:, :, :n], vb[:, :, :n]
                left = mx.array([(i * 131) % (n // 4) for i in range(B)])
                mask = (mx.arange(n)[None] >= left[:, None]).reshape(B, 1, 1, n)
                mx.eval(kb, vb, q, mask)
                want = da.reference(q, k, v, scale, mask)
                mlx = lambda: da._ORIGINAL(q, k, v, scale=scale, mask=mask)  # noqa: E731
                fused = lambda: da.fused_decode(q, k, v, scale, mask)  # noqa: E731
                row = {"B": B, "context": n, "prefix": 0, "kv_bytes": 2 * B * hkv * n * D * 2,
                       "mlx_ms": timed(mlx, a.reps), "fused_ms": timed(fused, a.reps),
                       "mlx_err": mx.abs(mlx().astype(mx.float32) - want).max().item(),
                       "fused_err": mx.abs(fused().astype(mx.float32) - want).max().item()}
                row["speedup"] = row["mlx_ms"] / row["fused_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                if a.prefix:
                    pk = mx.random.normal((1, hkv, a.prefix, D), key=ks[3]).astype(dt)
                    pv = mx.random.normal((1, hkv, a.prefix, D), key=ks[4]).astype(mx.float32)  # kept in float32
                    share = mx.array([i % 8 != 7 for i in range(B)])
                    mx.eval(pk, pv, share)
                    want = da.reference(q, k, v, scale, mask, (pk, pv, share))
                    casc = lambda: cascade_attention(q, (k, pk, share), (v, pv), scale, mask)  # noqa: E731
                    fused = lambda: da.fused_decode(q, k, v, scale, mask, (pk, pv, share))  # noqa: E731
                    row = {"B": B, "context": n, "prefix": a.prefix, "cascade_ms": timed(casc, a.reps),
                           "fused_ms": timed(fused, a.reps),
                           "cascade_err": mx.abs(casc().astype(mx.float32) - want).max().item(),
                           "fused_err": mx.abs(fused().astype(mx.float32) - want).max().item()}
                    row["speedup"] = row["cascade_ms"] / row["fused_ms"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if a.out:
        json.dump({"rows": rows, "heads": [hq, hkv, D], "mlx": mx.__version__}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
