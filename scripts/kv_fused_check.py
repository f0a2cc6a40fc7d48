"""The fused quantized-KV decode kernel (``--kv-attention fused``, CUDA only) against mlx-lm's quantized
path and a float32 reference, then one layer's attention time for full width, mlx-lm's path and fused.

* errors: max |out - ref| over rows with left padding and an unwritten buffer tail (mask), for grouped
  query ratios 1/4/8, head dims 64/128, bits 8/4, group sizes 32/64/128, bf16 and float32. ``ref`` is
  float32 attention over the dequantized keys and values. The fused kernel should be at least as close
  to it as mlx-lm's path.
* timing: one layer at B rows of ``--context`` keys (synth-llama-8b's heads), medians of synchronized
  calls.

    python scripts/kv_fused_check.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention as mlx_lm_path

from kv_attention_cost import timed  # scripts/ is on the path when this file runs

from mlxb.kernels.quantized_attention import fused_decode, supports


def reference(q, qk, qv, scale, mask, group, bits):
    k = mx.dequantize(*qk, group_size=group, bits=bits).astype(mx.float32)
    v = mx.dequantize(*qv, group_size=group, bits=bits).astype(mx.float32)
    B, hq, _, D = q.shape
    hkv = k.shape[1]
    qf = (q.astype(mx.float32) * scale).reshape(B, hkv, hq // hkv, 1, D)
    s = qf @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    s = mx.where(mx.expand_dims(mask, 2), s, -mx.inf)
    p = mx.softmax(s, axis=-1)
    return (p @ mx.expand_dims(v, 2)).reshape(B, hq, 1, D)


def case(B, hq, hkv, D, n, width, bits, group, dtype):
    q = mx.random.normal((B, hq, 1, D)).astype(dtype)
    k = mx.random.normal((B, hkv, width, D)).astype(dtype)
    v = mx.random.normal((B, hkv, width, D)).astype(dtype)
    qk, qv = mx.quantize(k, group_size=group, bits=bits), mx.quantize(v, group_size=group, bits=bits)
    left = mx.array([(i * 37) % max(1, n // 2) for i in range(B)])
    pos = mx.arange(width)
    mask = ((pos[None] >= left[:, None]) & (pos[None] < n)).reshape(B, 1, 1, width)
    scale = D ** -0.5
    assert supports(q, qk, qv, mask, group, bits), "case not supported"
    ref = reference(q, qk, qv, scale, mask, group, bits)
    f = fused_decode(q, qk, qv, scale, mask, group, bits).astype(mx.float32)
    m = mlx_lm_path(q, qk, qv, scale=scale, mask=mask, group_size=group, bits=bits).astype(mx.float32)
    return {"B": B, "hq": hq, "hkv": hkv, "D": D, "keys": n, "width": width, "bits": bits, "group": group,
            "dtype": str(dtype), "fused_err": mx.abs(f - ref).max().item(), "mlx_lm_err": mx.abs(m - ref).max().item(),
            "fused_vs_mlx_lm": mx.abs(f - m).max().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out")
    a = ap.parse_args()
    errors = []
    for (B, hq, hkv, D) in ((3, 8, 8, 64), (3, 32, 8, 128), (2, 16, 2, 128)):
        for bits, group in ((8, 64), (4, 64), (8, 32), (4, 128)):
            for dtype in (mx.bfloat16, mx.float32):
                for n, width in ((300, 512), (1000, 1024)):
                    r = case(B, hq, hkv, D, n, width, bits, group, dtype)
                    errors.append(r)
                    print(json.dumps(r), flush=True)
    worst = [r for r in errors if r["fused_err"] > max(2 * r["mlx_lm_err"], 1e-4)]
    print("cases where fused is further from the reference than 2x mlx-lm's path:", len(worst), flush=True)
    timing = []
    hq, hkv, D, dt = 32, 8, 128, mx.bfloat16
    for B in (int(b) for b in a.batches.split(",")):
        k = mx.random.normal((B, hkv, a.context, D)).astype(dt)
        v = mx.random.normal((B, hkv, a.context, D)).astype(dt)
        q = mx.random.normal((B, hq, 1, D)).astype(dt)
        mask = mx.ones((B, 1, 1, a.context), dtype=mx.bool_)
        mx.eval(k, v, q, mask)
        s = D ** -0.5
        row = {"B": B, "context": a.context, "full_ms": timed(
            lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask=mask), a.reps),
            "full_bytes": k.nbytes + v.nbytes}
        for bits in (8, 4):
            qk, qv = mx.quantize(k, group_size=64, bits=bits), mx.quantize(v, group_size=64, bits=bits)
            mx.eval(qk, qv)
            row[f"kv{bits}_mlx_lm_ms"] = timed(lambda: mlx_lm_path(q, qk, qv, scale=s, mask=mask, group_size=64, bits=bits), a.reps)
            row[f"kv{bits}_fused_ms"] = timed(lambda: fused_decode(q, qk, qv, s, mask, 64, bits), a.reps)
            row[f"kv{bits}_bytes"] = sum(x.nbytes for x in (*qk, *qv))
        timing.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"errors": errors, "worse_than_mlx_lm": len(worst), "timing": timing}, f, indent=1)


if __name__ == "__main__":
    main()
