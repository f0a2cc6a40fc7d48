"""Where the fused quantized-KV kernel and mlx-lm's quantized path part from a float32 reference on this
device: per case, the output errors of both, and the partial kernel's per-chunk max / exp-sum / weighted
sum against the same quantities computed with plain MLX ops over dequantized keys and values.

    python scripts/kv_fused_diag.py
"""
import json

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention as mlx_lm_path

from mlxb.kernels.quantized_attention import _kernels, launch_plan, fused_decode


def chunks_ref(q, k, v, scale, mask, C):
    B, hq, _, D = q.shape
    hkv, n = k.shape[1], k.shape[2]
    R = hq // hkv
    qf = (q.astype(mx.float32) * scale).reshape(B, hkv, R, 1, D)
    s = (qf @ mx.expand_dims(k, 2).swapaxes(-1, -2)).reshape(B, hq, n)
    s = mx.where(mask.reshape(B, 1, n), s, -mx.inf)
    nc = -(-n // C)
    pad = nc * C - n
    s = mx.pad(s, [(0, 0), (0, 0), (0, pad)], constant_values=-float("inf")).reshape(B, hq, nc, C)
    m = s.max(-1)
    p = mx.where(mx.isinf(m)[..., None], 0.0, mx.exp(s - m[..., None]))
    l = p.sum(-1)
    vv = mx.pad(mx.repeat(v, R, axis=1), [(0, 0), (0, 0), (0, pad), (0, 0)]).reshape(B, hq, nc, C, D)
    o = (p[..., None, :] @ vv).squeeze(-2)
    return o, m, l


def main():
    dev = str(mx.default_device())
    probe = mx.fast.cuda_kernel(name="mlxb_probe", input_names=["kw", "mask"], output_names=["o"], source="""
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 4) o[i] = kw_shape[i];
  if (i >= 4 && i < 8) o[i] = (int)mask[i - 4];
  if (i == 8) o[i] = gridDim.x; if (i == 9) o[i] = blockDim.x; if (i == 10) o[i] = sizeof(bool);
  if (i == 11) o[i] = (int)(reinterpret_cast<size_t>(kw) % 16);
""")
    kw = mx.zeros((2, 3, 5, 32), dtype=mx.uint32)
    (o,) = probe(inputs=[kw, mx.array([True, False, True, True])], output_shapes=[(12,)], output_dtypes=[mx.int32],
                 grid=(64, 1, 1), threadgroup=(32, 1, 1))
    print("probe (kw shape, mask, gridDim, blockDim, sizeof bool, kw % 16):", o.tolist(), flush=True)
    x = mx.random.normal((2, 2, 64, 128))
    for bits in (8, 4):
        g = mx.quantize(x, group_size=64, bits=bits)
        c = mx.quantize(x, group_size=64, bits=bits, stream=mx.cpu)
        print("quantize gpu vs cpu", bits, [mx.array_equal(a, b).item() for a, b in zip(g, c)], dev, flush=True)
    for (B, hq, hkv, D, width, n0, n1, bits, group, use_mask) in (
            (1, 1, 1, 128, 64, 0, 64, 8, 64, False), (1, 1, 1, 128, 64, 0, 64, 8, 64, True),
            (2, 2, 2, 128, 320, 0, 300, 8, 32, True), (2, 8, 2, 128, 320, 0, 300, 8, 32, True),
            (2, 8, 2, 128, 320, 70, 300, 4, 64, True), (1, 4, 1, 64, 256, 0, 256, 8, 64, False)):
        k1, k2, k3 = mx.random.split(mx.random.key(B * 100 + hq + bits), 3)
        q = mx.random.normal((B, hq, 1, D), key=k1)
        qk = mx.quantize(mx.random.normal((B, hkv, width, D), key=k2), group_size=group, bits=bits)
        qv = mx.quantize(mx.random.normal((B, hkv, width, D), key=k3), group_size=group, bits=bits)
        k = mx.dequantize(*qk, group_size=group, bits=bits)
        v = mx.dequantize(*qv, group_size=group, bits=bits)
        pos = mx.arange(width)
        left = mx.array([0] + [n0] * (B - 1))
        mask = ((pos[None] >= left[:, None]) & (pos[None] < n1)).reshape(B, 1, 1, width)
        m_in = mask if use_mask else None
        full = mask if use_mask else mx.ones_like(mask)
        scale = D ** -0.5
        o_ref, m_ref, l_ref = chunks_ref(q, k, v, scale, full, launch_plan(B, hq, hkv, width, D, bits, group, use_mask,
                                                                             scale, q.dtype)[0]["template"][5][1])
        ref = ((o_ref * mx.exp(m_ref - m_ref.max(-1, keepdims=True))[..., None]).sum(2)
               / (l_ref * mx.exp(m_ref - m_ref.max(-1, keepdims=True))).sum(2)[..., None]).reshape(B, hq, 1, D)
        part, _ = launch_plan(B, hq, hkv, width, D, bits, group, use_mask, scale, q.dtype)
        m2 = mask.reshape(B, width) if use_mask else mx.array([True])
        o_p, m_p, l_p = _kernels()["part"](inputs=[q, *qk, *qv, m2], output_dtypes=[mx.float32] * 3, **part)
        f = fused_decode(q, qk, qv, scale, m_in, group, bits)
        w = mlx_lm_path(mx.array(q), qk, qv, scale=scale, mask=m_in, group_size=group, bits=bits)
        fin = lambda a, b: mx.abs(mx.where(mx.isinf(b), 0, a - b)).max().item()
        print(json.dumps({"B": B, "hq": hq, "hkv": hkv, "D": D, "width": width, "bits": bits, "group": group,
                          "mask": use_mask, "C": part["template"][5][1],
                          "fused_err": mx.abs(f - ref).max().item(), "mlx_lm_err": mx.abs(w - ref).max().item(),
                          "m_part_err": fin(m_p, m_ref), "l_part_err": fin(l_p, l_ref),
                          "o_part_err": mx.abs(o_p - o_ref).max().item(),
                          "m_p": m_p.reshape(-1)[:3].tolist(), "m_ref": m_ref.reshape(-1)[:3].tolist(),
                          "l_p": l_p.reshape(-1)[:3].tolist(), "l_ref": l_ref.reshape(-1)[:3].tolist()}), flush=True)


if __name__ == "__main__":
    main()
