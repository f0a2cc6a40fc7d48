"""The fused decode-attention kernel's compiled variants on a CUDA device (a diagnostic for ``--kv-attention fused``).

1. After the float32 start-up self-check, bfloat16 calls of the same shapes must still agree with float32
   attention (MLX names a compiled kernel by its template; the template carries the input dtypes).
2. Calls of many batch sizes, key counts and mask kinds at one query count compile once (the chunk and the flags are
   run-time values): the first call per query count pays the compile, the rest do not.
3. ``warm_variants`` (what the engine's warm-up runs) for a Llama-3-8B-shaped layer: its time on a fresh process,
   which loads what an earlier process compiled from MLX's on-disk cache.

Usage: python scripts/fused_variants_check.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from mlxb.kernels import dense_attention as da


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    t0 = time.perf_counter()
    da.set_enabled(True)  # the float32 self-check compiles its variants first
    out = {"self_check_s": round(time.perf_counter() - t0, 2), "calls": []}
    scale = 128 ** -0.5
    for B, hq, hkv, n, L, masked in ((2, 8, 2, 300, 1, True), (2, 32, 8, 300, 1, True), (32, 32, 8, 2000, 1, True),
                                     (3, 8, 2, 150, 5, True), (1, 32, 8, 900, 5, False), (64, 32, 8, 4000, 1, True),
                                     (16, 32, 8, 2500, 3, True)):
        ks = mx.random.split(mx.random.key(B * n + L), 3)
        q = mx.random.normal((B, hq, L, 128), key=ks[0]).astype(mx.bfloat16)
        k = mx.random.normal((B, hkv, n, 128), key=ks[1]).astype(mx.bfloat16)
        v = mx.random.normal((B, hkv, n, 128), key=ks[2]).astype(mx.bfloat16)
        left = mx.array([(i * 37) % (n // 2) for i in range(B)])
        pos = mx.arange(n)
        mask = ((pos[None, None] >= left[:, None, None]) & (pos[None, None] <= (n - L + mx.arange(L))[None, :, None])
                ).reshape(B, 1, L, n) if masked else "causal"
        t = time.perf_counter()
        got = da.fused_decode(q, k, v, scale, mask)
        mx.eval(got)
        first = time.perf_counter() - t
        want = da.reference(q, k, v, scale, mask)
        mlx = da._ORIGINAL(q, k, v, scale=scale, mask=mask)
        row = {"B": B, "hq": hq, "hkv": hkv, "keys": n, "L": L, "masked": masked, "first_call_ms": round(1000 * first, 1),
               "max_diff_vs_f32": mx.abs(got.astype(mx.float32) - want).max().item(),
               "mlx_max_diff_vs_f32": mx.abs(mlx.astype(mx.float32) - want).max().item()}
        out["calls"].append(row)
        print(json.dumps(row), flush=True)
    da._SEEN.add((32, 8, 128, mx.bfloat16, mx.bfloat16, mx.bfloat16, scale))
    t = time.perf_counter()
    out["warm_variants"] = da.warm_variants(prefix=True)
    out["warm_variants_s"] = round(time.perf_counter() - t, 2)
    print(json.dumps({k: out[k] for k in ("self_check_s", "warm_variants", "warm_variants_s")}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
