"""Fused decode attention over quantized KV for MLX's CUDA backend (``--kv-attention fused``, which also turns on
``dense_attention``, its counterpart for full-precision layers).

mlx-lm reads a quantized layer with two ``quantized_matmul``s and a softmax (scores, then the weighted
sum), three kernels and two round trips of the scores through memory. This is one split-key pass in the
manner of flash decoding (on the H200, 0.61 ms for an 8B-shaped layer at B=32 over 8k KV8 keys, where
bf16 attention with a mask takes 2.55 ms):

* ``mlxb_qattn_part``: one thread block per (row, KV head, chunk of ``C`` keys). It scores the chunk for
  every query head of that KV head straight from the packed keys (``s * (q . w) + b * sum(q)`` per
  group, so nothing is dequantized into memory), keeps the chunk's max and exp-sum, and sums the packed
  values weighted by the chunk's probabilities. Masked keys (padding, the unwritten tail of the
  buffer) are skipped without reading them.
* ``mlxb_qattn_join``: one block per (row, query head) rescales the chunks' partial sums by their
  maxima and divides by the total, in float32.

It applies only where the cache hands attention its whole contiguous buffers with a boolean mask as
wide as them (``whole_buffer_reads``, which is the CUDA case), to one query token per row (decode),
and to grouped-query ratios up to 8; anything else goes to mlx-lm's path (or the folded read of
``quantized_paths`` where mlx-lm's grouped-query read is wrong). It sums in a different order from
mlx-lm's kernels (and in float32 throughout), so it is not bit-equal to them: the library's default is
mlx-lm's read; the CLI's default ``auto`` takes this kernel on CUDA only (``set_kv_attention``), and
``scripts/kv_fused_check.py`` measures it against float32 attention on the device. It is
selected per call by the cache's return type (``Packed``), so mlx-lm's own caches in the same process
(the parity oracle) always keep mlx-lm's path.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Optional

import mlx.core as mx

from mlxb.kernels import kernel_name, quantized_paths, split_read
from mlxb.kernels.split_key import CHUNK_STATS, HEADER as _HEADER, JOIN as _JOIN, WRITE_PARTS, chunk_for
from mlxb.kernels.quantized_paths import fold_reads, folded_attention, reference_attention
from mlxb.kernels.split_read import split_attention, split_parts

MODES = ("mlx-lm", "fused", "auto")
_MODE: Optional[str] = None
AUTO_NOTE: Optional[str] = None  # why 'auto' chose what it chose (the serve start-up line shows it)
_ROUTE: Optional[bool] = None  # whether batch layers mark their reads for the dispatcher
_KERNELS: dict = {}
_NO_MASK = None


class Packed(tuple):
    """(packed values, scales, biases) of a batch layer whose attention may take the fused kernel."""


def fused_available() -> bool:
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available() and mx.default_device() == mx.gpu)


def set_kv_attention(mode: str) -> str:
    """Choose how batch layers' decode attention is read; 'fused' needs the CUDA backend and refuses otherwise.
    'auto' takes 'fused' where the CUDA backend is the default device and the kernels pass their start-up
    self-checks, else 'mlx-lm' (Metal and CPU always: the kernels are CUDA source). Returns the mode chosen."""
    global _MODE, _ROUTE, AUTO_NOTE
    if mode not in MODES:
        raise ValueError(f"--kv-attention {mode}: choose one of {', '.join(MODES)}")
    if mode == "auto":
        if not fused_available():
            set_kv_attention("mlx-lm")
            AUTO_NOTE = "auto: not a CUDA device"
            return _MODE
        try:
            set_kv_attention("fused")
            AUTO_NOTE = "auto: CUDA, self-checks passed"
        except ValueError as e:  # a kernel that does not build or disagrees here: MLX's read, and say why
            set_kv_attention("mlx-lm")
            AUTO_NOTE = f"auto: the fused kernels were refused on this device ({e})"
        return _MODE
    AUTO_NOTE = None
    if mode == "fused":
        if not fused_available():
            raise ValueError("--kv-attention fused needs MLX's CUDA backend (a CUDA GPU as the default "
                             "device); on this backend use --kv-attention mlx-lm")
        self_check()
        _install()
    from mlxb.kernels import dense_attention  # (it imports this module's kernel pieces)

    dense_attention.set_enabled(mode == "fused")  # full-precision batch layers' decode reads too
    _MODE, _ROUTE = mode, None
    quantized_paths.reset()
    split_read.reset()
    return mode


def self_check(tol: float = 1e-4) -> float:
    """Run the kernel on two small float32 cases (8 and 4 bits, several groups per row, padding, a buffer
    tail, several chunks, GQA 4) against float32 attention over the dequantized cache before any request
    can reach it: a kernel that does not compile or disagrees on this device refuses the flag instead of
    failing requests. Returns the max difference."""
    err = 0.0
    for bits, group, seed in ((8, 32, 7), (4, 64, 8)):  # several groups per row, both packings
        k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
        B, hq, hkv, D, width = 2, 8, 2, 128, 320
        q = mx.random.normal((B, hq, 1, D), key=k1)
        qk = mx.quantize(mx.random.normal((B, hkv, width, D), key=k2), group_size=group, bits=bits)
        qv = mx.quantize(mx.random.normal((B, hkv, width, D), key=k3), group_size=group, bits=bits)
        pos = mx.arange(width)
        mask = ((pos[None] >= mx.array([0, 70])[:, None]) & (pos[None] < 300)).reshape(B, 1, 1, width)
        try:
            got = fused_decode(q, qk, qv, D ** -0.5, mask, group, bits)
            want = reference_attention(q, qk, qv, D ** -0.5, mask, group, bits)
            err = max(err, mx.abs(got - want).max().item())
        except Exception as e:  # a compile or launch failure on this device
            raise ValueError(f"--kv-attention fused: the kernel failed on this device ({e}); "
                             "use --kv-attention mlx-lm") from e
        if not err <= tol:
            raise ValueError(f"--kv-attention fused: the kernel disagrees with float32 attention over the "
                             f"dequantized cache on this device (max |diff| {err:.3g} > {tol:g}); "
                             "use --kv-attention mlx-lm")
    return err


def kv_attention() -> str:
    global _MODE
    if _MODE is None:
        set_kv_attention(os.environ.get("MLXB_KV_ATTENTION", "mlx-lm"))
    return _MODE


def kv_attention_note() -> Optional[str]:
    """Why the CLI's default ``--kv-attention auto`` chose the mode in effect (None when a mode was named)."""
    return AUTO_NOTE


def mark(t: tuple) -> tuple:
    """The cache's (values, scales, biases), marked for the dispatcher when the fused kernel is selected,
    mlx-lm's grouped-query read is wrong on this backend (``quantized_paths``) or CPU reads are split
    across streams (``split_read``)."""
    global _ROUTE
    if _ROUTE is None:
        _ROUTE = kv_attention() == "fused" or fold_reads() or split_parts() > 1
        if _ROUTE:
            _install()
    return Packed(t) if _ROUTE else t


_PART = r"""
  constexpr int E = 32 / BITS;            // values per packed word
  constexpr int W = D / E;                // words per row
  constexpr int NG = D / G;               // groups per row
  constexpr int WG = G / E;               // words per group
  constexpr int J = NT / W;               // key slots in the value pass
  constexpr unsigned LOW = (1u << BITS) - 1u;
  constexpr int QF = R * D + R * NG;
  constexpr int RF = J * R * D;
  __shared__ float buf[QF > RF ? QF : RF];
  __shared__ float ps[R][C];
  __shared__ float mstat[R], lstat[R];
  float* qs = buf;                         // [R][D], phase 1
  float* qg = buf + R * D;                 // [R][NG], phase 1
  float* red = buf;                        // [J][R][D], phase 3
  const float scale = __int_as_float(SCALE_BITS);
  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int Hkv = kw_shape[1], N = kw_shape[2];
  const int NC = (N + C - 1) / C;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const size_t hq0 = (size_t)b * Hkv * R + (size_t)h * R;
  const size_t row0 = ((size_t)b * Hkv + h) * (size_t)N;
  const int k0 = c * C;

  for (int i = t; i < R * D; i += NT) qs[i] = static_cast<float>(q[hq0 * D + i]) * scale;
  __syncthreads();
  for (int i = t; i < R * NG; i += NT) {
    int r = i / NG, g = i % NG;
    float s = 0.f;
    for (int d = g * G; d < (g + 1) * G; ++d) s += qs[r * D + d];
    qg[i] = s;
  }
  __syncthreads();

  // phase 1: scores, one key per thread, read straight from the packed row
  for (int kk = t; kk < C; kk += NT) {
    const int k = k0 + kk;
    bool live = k < N;
    if (HAS_MASK && live) live = mask[(size_t)b * N + k];
    float sc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) sc[r] = 0.f;
    if (live) {
      const uint4* w4 = reinterpret_cast<const uint4*>(kw + (row0 + k) * W);
      for (int g = 0; g < NG; ++g) {
        float dot[R];
#pragma unroll
        for (int r = 0; r < R; ++r) dot[r] = 0.f;
        for (int v4 = 0; v4 < WG / 4; ++v4) {
          const uint4 u = w4[g * (WG / 4) + v4];
          const uint32_t ws[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int dbase = (g * WG + v4 * 4 + x) * E;
#pragma unroll
            for (int e = 0; e < E; ++e) {
              const float v = static_cast<float>((ws[x] >> (e * BITS)) & LOW);
#pragma unroll
              for (int r = 0; r < R; ++r) dot[r] += qs[r * D + dbase + e] * v;
            }
          }
        }
        const float s = static_cast<float>(ks[(row0 + k) * NG + g]);
        const float bb = static_cast<float>(kb[(row0 + k) * NG + g]);
#pragma unroll
        for (int r = 0; r < R; ++r) sc[r] += s * dot[r] + bb * qg[r * NG + g];
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) ps[r][kk] = live ? sc[r] : MLXB_NEG_INF;
  }
  __syncthreads();

""" + CHUNK_STATS + r"""
  // phase 3: probability-weighted packed values; a thread owns one word of the row for a slot of keys
  const int wv = t % W, j = t / W;
  const int g = (wv * E) / G;
  float acc[R][E];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int e = 0; e < E; ++e) acc[r][e] = 0.f;
  for (int kk = j; kk < C; kk += J) {
    const int k = k0 + kk;
    if (k >= N) break;
    float p[R];
    bool any = false;
#pragma unroll
    for (int r = 0; r < R; ++r) { p[r] = ps[r][kk]; any = any || p[r] != 0.f; }
    if (!any) continue;
    const uint32_t wd = vw[(row0 + k) * W + wv];
    const float s = static_cast<float>(vs[(row0 + k) * NG + g]);
    const float bb = static_cast<float>(vb[(row0 + k) * NG + g]);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float v = s * static_cast<float>((wd >> (e * BITS)) & LOW) + bb;
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][e] += p[r] * v;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int e = 0; e < E; ++e) red[(j * R + r) * D + wv * E + e] = acc[r][e];
  __syncthreads();
""" + WRITE_PARTS + r"""
"""

NT = 128


def _kernels():
    if not _KERNELS:
        _KERNELS["part"] = mx.fast.cuda_kernel(
            name=kernel_name("mlxb_qattn_part", _HEADER, _PART), input_names=["q", "kw", "ks", "kb", "vw", "vs", "vb", "mask"],
            output_names=["o_part", "m_part", "l_part"], source=_PART, header=_HEADER)
        _KERNELS["join"] = mx.fast.cuda_kernel(
            name=kernel_name("mlxb_qattn_join", _HEADER, _JOIN), input_names=["o_part", "m_part", "l_part"], output_names=["out"],
            source=_JOIN, header=_HEADER)
    return _KERNELS


def supports(queries, q_keys, q_values, mask, group_size: int, bits: int) -> bool:
    B, hq, L, D = queries.shape
    kw = q_keys[0]
    if L != 1 or kw.ndim != 4 or hq % kw.shape[1] or hq // kw.shape[1] > 8 or bits not in (4, 8):
        return False
    if q_values[0].shape[-1] * 32 // bits != D or kw.shape[-1] * 32 // bits != D or D % group_size:
        return False
    W = D * bits // 32
    if W > NT or NT % W or (group_size * bits // 32) % 4:
        return False
    # whole-buffer reads hand over contiguous buffers; anything else is copied by the kernel call (correct, slower)
    return mask is None or (not isinstance(mask, str) and mask.dtype == mx.bool_ and mask.shape[-1] == kw.shape[2]
                            and mask.shape[-2] == 1)


def launch_plan(B: int, hq: int, hkv: int, n: int, D: int, bits: int, group_size: int, has_mask: bool,
                scale: float, dtype) -> tuple[dict, dict]:
    """Template constants, grids (in threads, as ``cuda_kernel`` takes them) and output shapes of the two
    kernels for B rows of ``n`` keys; shared by ``fused_decode`` and the CPU emulation test."""
    C = chunk_for(B * hkv, n)
    nc = math.ceil(n / C)
    scale_bits = struct.unpack("<i", struct.pack("<f", float(scale)))[0]
    part = dict(template=[("T", dtype), ("D", D), ("R", hq // hkv), ("BITS", bits), ("G", group_size), ("C", C),
                          ("NT", NT), ("HAS_MASK", has_mask), ("SCALE_BITS", scale_bits)],
                grid=(nc * NT, hkv, B), threadgroup=(NT, 1, 1),
                output_shapes=[(B, hq, nc, D), (B, hq, nc), (B, hq, nc)])
    join = dict(template=[("T", dtype)], grid=(B * hq * D, 1, 1), threadgroup=(D, 1, 1),
                output_shapes=[(B, hq, 1, D)])
    return part, join


def fused_decode(queries, q_keys, q_values, scale: float, mask, group_size: int, bits: int):
    """Attention of one query token per row over packed K/V; queries [B, Hq, 1, D] -> [B, Hq, 1, D]."""
    global _NO_MASK
    B, hq, _, D = queries.shape
    hkv, n = q_keys[0].shape[1], q_keys[0].shape[2]
    if mask is None:
        if _NO_MASK is None:
            _NO_MASK = mx.array([True])
        m2 = _NO_MASK
    else:
        m2 = mx.broadcast_to(mask, (B, 1, 1, n)).reshape(B, n)
    part, join = launch_plan(B, hq, hkv, n, D, bits, group_size, mask is not None, scale, queries.dtype)
    k = _kernels()
    o_part, m_part, l_part = k["part"](inputs=[queries, *q_keys, *q_values, m2],
                                       output_dtypes=[mx.float32] * 3, **part)
    (out,) = k["join"](inputs=[o_part, m_part, l_part], output_dtypes=[queries.dtype], **join)
    return out


def _install() -> None:
    """Route marked (``Packed``) quantized reads through the fused kernel (decode, when selected) or the
    folded read (where mlx-lm's broadcast is wrong); everything else, including mlx-lm's own
    ``QuantizedKVCache`` (the parity oracle), keeps mlx-lm's ``quantized_scaled_dot_product_attention``."""
    import mlx_lm.models.base as base

    if getattr(base.quantized_scaled_dot_product_attention, "_mlxb_fused", False):
        return
    original = base.quantized_scaled_dot_product_attention

    def dispatch(queries, q_keys, q_values, scale, mask, group_size=64, bits=8):
        if isinstance(q_keys, Packed):
            if _MODE == "fused" and supports(queries, q_keys, q_values, mask, group_size, bits):
                return fused_decode(queries, q_keys, q_values, scale, mask, group_size, bits)
            read = folded_attention if fold_reads() else mlx_lm_read  # split over CPU streams where that pays
            return split_attention(read, queries, q_keys, q_values, scale, mask, group_size, bits)
        return original(queries, q_keys, q_values, scale=scale, mask=mask, group_size=group_size, bits=bits)

    def mlx_lm_read(queries, q_keys, q_values, scale, mask, group_size, bits):
        return original(queries, q_keys, q_values, scale=scale, mask=mask, group_size=group_size, bits=bits)

    dispatch._mlxb_fused = True
    dispatch._mlxb_original = original
    base.quantized_scaled_dot_product_attention = dispatch
