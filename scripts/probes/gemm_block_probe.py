"""Does ``mx.async_eval`` return before the device finishes, per op kind and row count? A chain of ``--n``
dependent ops (bf16 [M, 4096] @ [4096, 4096]^T matmuls; the same through ``mx.fast.scaled_dot_product_attention``
with M queries over 512 keys, causal and not) is launched with ``async_eval`` and then read: a launch that
takes the whole chain's time means the host waited for the device inside it. Prints and writes JSON.

    python3 scripts/probes/gemm_block_probe.py --out gemm-block.json [--n 96] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    w = (mx.random.normal((4096, 4096)) * 0.01).astype(mx.bfloat16)
    k = mx.random.normal((1, 8, 512, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 8, 512, 128)).astype(mx.bfloat16)
    mx.eval(w, k, v)

    def matmul_chain(x):
        for _ in range(a.n):
            x = x @ w.T
        return x

    def sdpa_chain(x, mask):
        q = x.reshape(1, 32, -1, 128)  # [1, 32 heads, M, 128] from [M, 4096]
        for _ in range(a.n):
            q = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask=mask)
        return q

    rows = []
    for kind in ("matmul", "sdpa", "sdpa_causal"):
        for m in (1, 2, 3, 4, 5, 8):
            x = mx.random.normal((m, 4096)).astype(mx.bfloat16)
            mx.eval(x)
            launch, read = [], []
            for i in range(a.repeats + 2):
                mx.synchronize()
                if kind == "matmul":
                    y = matmul_chain(x)
                else:
                    y = sdpa_chain(x.reshape(1, m, 32, 128).transpose(0, 2, 1, 3).reshape(m, 4096),
                                   "causal" if kind == "sdpa_causal" else None)
                t0 = time.perf_counter()
                mx.async_eval(y)
                t1 = time.perf_counter()
                mx.eval(y)
                t2 = time.perf_counter()
                if i >= 2:
                    launch.append(t1 - t0), read.append(t2 - t1)
            r = {"kind": kind, "rows": m, "n": a.n, "async_eval_ms": round(1000 * statistics.median(launch), 3),
                 "read_ms": round(1000 * statistics.median(read), 3)}
            rows.append(r)
            print(r, flush=True)
    json.dump({"device": str(mx.default_device()), "mlx": mx.__version__, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
