"""mlx-lm's quantized attention, the folded read (mlxb.kernels.quantized_paths) and float32 attention over
the dequantized cache, on this device, over query-heads-per-KV-head ratios, query lengths, head dims,
dtypes and bit widths: one JSON line per case with each path's max error (or the error it raised), and
the probe's verdict. Also: ``quantized_matmul`` with a broadcast batch axis against the same product
with the axis repeated (the smallest form of the grouped-query fault).

    python scripts/probes/cuda_qmm_probe.py [--out FILE.json]
"""
import argparse
import json

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention as mlx_lm_path

from mlxb.kernels.quantized_paths import folded_attention, probe, reference_attention


def err(fn, ref):
    try:
        return round(mx.abs(fn().astype(mx.float32) - ref).max().item(), 7)
    except Exception as e:  # an unsupported shape on this backend
        return str(e).splitlines()[0][:120]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = [{"device": str(mx.default_device()), "probe_exact": probe()}]
    print(json.dumps(rows[0]), flush=True)
    # the smallest form: x [B, H, R, 1, D] against w [B, H, 1, N, D/pack] broadcast over R
    for R in (1, 2, 4):
        x = mx.random.normal((2, 2, R, 1, 128))
        w = mx.quantize(mx.random.normal((2, 2, 64, 128)), group_size=64, bits=8)
        b = mx.quantized_matmul(x, *(mx.expand_dims(t, -3) for t in w), transpose=True, group_size=64, bits=8)
        r = mx.quantized_matmul(x, *(mx.repeat(mx.expand_dims(t, -3), R, axis=-3) for t in w), transpose=True,
                                group_size=64, bits=8)
        row = {"qmm_broadcast_R": R, "vs_repeated": mx.abs(b - r).max().item()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    for dtype in (mx.bfloat16, mx.float32):
        for D in (128, 64):
            for R in (1, 2, 4, 8):
                for L in (1, 5, 64):
                    for bits in (8, 4):
                        B, hkv, n = 3, 2, 320
                        k1, k2, k3 = mx.random.split(mx.random.key(R * 1000 + L * 10 + bits), 3)
                        q = mx.random.normal((B, hkv * R, L, D), key=k1).astype(dtype)
                        qk = mx.quantize(mx.random.normal((B, hkv, n, D), key=k2).astype(dtype), group_size=64, bits=bits)
                        qv = mx.quantize(mx.random.normal((B, hkv, n, D), key=k3).astype(dtype), group_size=64, bits=bits)
                        pos = mx.arange(n)
                        mask = ((pos[None, None] >= mx.array([0, 17, 40])[:, None, None])
                                & (pos[None, None] <= mx.arange(n - L, n)[None, :, None])).reshape(B, 1, L, n)
                        ref = reference_attention(q, qk, qv, D ** -0.5, mask, 64, bits)
                        row = {"dtype": str(dtype).split(".")[-1], "D": D, "R": R, "L": L, "bits": bits,
                               "mlx_lm": err(lambda: mlx_lm_path(mx.array(q), qk, qv, scale=D ** -0.5, mask=mask,
                                                                 group_size=64, bits=bits), ref),
                               "folded": err(lambda: folded_attention(q, qk, qv, D ** -0.5, mask, 64, bits), ref)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
