"""Skinny matmuls on MLX's CUDA backend (``--skinny-matmul``, asked for by name): ``x @ W.T`` for 2..MAX_ROWS rows.

MLX's CUDA matmul sends one row (``M == 1``) to its gemv kernel and every other row count to cuBLAS. Measured on
the H200 (``scripts/skinny_cost.py``, reports/h200/session37): cuBLAS reads the 8B shape's MLP weights (117 MB)
at about 3.2 TB/s for 2 to 40 rows, as fast as the gemv reads them for one, so the idea that started this
kernel (a B=8 step pays for reading its weights twice) was wrong there; but on the small attention weights
(8 and 32 MB) cuBLAS costs 23-60 us against the gemv's 12-20, and this kernel, which reads each weight row
once for all ``M`` input rows, costs 13-28 us at 2..8 rows. So it takes only those (``applies``).

Each lane of a warp sums its columns in the order MLX's gemv uses (4 consecutive columns per step, a step of
128 columns, float32 accumulation), and the warp then reduces its lanes (``REDUCE``: cooperative groups' own
``cg::reduce`` on the device, the same the gemv calls, or a shuffle-xor butterfly). So with the matching
reduction every output row equals the one-row gemv's result for that input row: a batch's rows, and a verify
step's positions, come out as if each had been a lone row (checked on the device by ``self_check`` and
``scripts/skinny_cost.py``; the CPU runs the same source through the C++ emulation in the tests).
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mlxb.kernels import cuda_gpu, kernel_name

NT = 256  # threads per block: 8 warps
MAX_ROWS = int(os.environ.get("MLXB_SKINNY_MAX_ROWS", "8"))  # above this cuBLAS pays (scripts/skinny_cost.py)
MIN_ROWS = int(os.environ.get("MLXB_SKINNY_MIN_ROWS", "2"))  # 1: lone rows too, instead of MLX's gemv
MAX_WEIGHT = int(os.environ.get("MLXB_SKINNY_MAX_WEIGHT", str(4096 * 4096)))  # elements (see ``applies``)
NPT = 4  # columns per lane per step, as MLX's gemv takes them when K % 128 == 0

HEADER_XOR = r"""
template <typename T> struct alignas(4 * sizeof(T)) mlxb_vec4 { T v[4]; };
__device__ __forceinline__ float mlxb_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
"""

HEADER_CG = r"""
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
template <typename T> struct alignas(4 * sizeof(T)) mlxb_vec4 { T v[4]; };
__device__ __forceinline__ float mlxb_warp_sum(float v) {
  namespace cg = cooperative_groups;
  auto warp = cg::tiled_partition<32>(cg::this_thread_block());
  return cg::reduce(warp, v, cg::plus<float>());
}
"""

SOURCE = r"""
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int N = w_shape[0], K = w_shape[1];
  const int n0 = (blockIdx.x * (NT / 32) + warp) * RW;
  if (n0 >= N) return;  // the whole warp leaves together
  float acc[RW][M];
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  int col = 4 * lane;
  // U steps of 128 columns per trip: every weight load of the trip is issued before the first product, so
  // each lane has U loads in flight; the products then run step by step, so the sums are the same
  for (; col + (U - 1) * 128 < K; col += U * 128) {
    mlxb_vec4<T> wv[U][RW];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < RW; ++r)
        if (n0 + r < N) wv[u][r] = *reinterpret_cast<const mlxb_vec4<T>*>(w + (size_t)(n0 + r) * K + col + u * 128);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const mlxb_vec4<T> xv = *reinterpret_cast<const mlxb_vec4<T>*>(x + (size_t)m * K + col + u * 128);
#pragma unroll
        for (int r = 0; r < RW; ++r)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[r][m] += static_cast<float>(wv[u][r].v[j]) * static_cast<float>(xv.v[j]);
      }
  }
  for (; col < K; col += 128) {  // the steps left over when K is not a whole number of trips
    mlxb_vec4<T> wv[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r)
      if (n0 + r < N) wv[r] = *reinterpret_cast<const mlxb_vec4<T>*>(w + (size_t)(n0 + r) * K + col);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const mlxb_vec4<T> xv = *reinterpret_cast<const mlxb_vec4<T>*>(x + (size_t)m * K + col);
#pragma unroll
      for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[r][m] += static_cast<float>(wv[r].v[j]) * static_cast<float>(xv.v[j]);
    }
  }
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float v = mlxb_warp_sum(acc[r][m]);
      if (lane == 0 && n0 + r < N) out[(size_t)m * N + n0 + r] = static_cast<T>(v);
    }
"""

REDUCTIONS = ("cg", "xor")
_REDUCE = os.environ.get("MLXB_SKINNY_REDUCE", "cg")
_RW = int(os.environ.get("MLXB_SKINNY_RW", "1"))  # weight rows per warp (scripts/skinny_cost.py sweeps it)
_U = int(os.environ.get("MLXB_SKINNY_UNROLL", "1"))  # steps of 128 columns whose loads are issued together
_KERNELS: dict = {}
_PLANS: dict = {}


def available() -> bool:
    return cuda_gpu()


def applies(rows: int, k: int, x_dtype, w_dtype, n: int = 0) -> bool:
    """Whether ``skinny_matmul`` takes this product (else the caller's own matmul runs): 2..MAX_ROWS rows, whole
    steps of 128 columns, one 16-bit dtype, and a weight of at most MAX_WEIGHT elements (on the H200 cuBLAS
    read the 8B shape's 117 MB MLP weights at about 3.2 TB/s for 2 to 40 rows, which this kernel did not beat,
    while the 8 and 32 MB attention weights cost it a fixed 25-40 us: scripts/skinny_cost.py)."""
    return (MIN_ROWS <= rows <= MAX_ROWS and k % (32 * NPT) == 0 and x_dtype == w_dtype
            and w_dtype in (mx.bfloat16, mx.float16) and n * k <= MAX_WEIGHT)


def launch_plan(rows: int, n: int, dtype, rw: Optional[int] = None, unroll: Optional[int] = None) -> dict:
    """Template constants, grid (in threads, as ``cuda_kernel`` takes it) and output shape; shared with the
    CPU emulation test."""
    rw = rw or _RW
    blocks = -(-n // (rw * NT // 32))
    return dict(template=[("T", dtype), ("M", rows), ("RW", rw), ("NT", NT), ("U", unroll or _U)],
                grid=(blocks * NT, 1, 1), threadgroup=(NT, 1, 1), output_shapes=[(rows, n)])


def _kernel(reduce: str):
    if reduce not in _KERNELS:
        _KERNELS[reduce] = mx.fast.cuda_kernel(name=kernel_name(f"mlxb_skinny_{reduce}", SOURCE, HEADER_CG if reduce == "cg" else HEADER_XOR), input_names=["x", "w"],
                                               output_names=["out"], source=SOURCE,
                                               header=HEADER_CG if reduce == "cg" else HEADER_XOR)
    return _KERNELS[reduce]


def skinny_matmul(x: mx.array, w: mx.array, reduce: Optional[str] = None, rw: Optional[int] = None,
                  unroll: Optional[int] = None) -> mx.array:
    """``x @ w.T`` for x [..., K] (MIN_ROWS..MAX_ROWS rows in all) and w [N, K], both bf16 or both fp16."""
    k, n = x.shape[-1], w.shape[0]
    rows = x.size // k
    key = (rows, n, x.dtype, rw, unroll)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = launch_plan(rows, n, x.dtype, rw, unroll)
    (out,) = _kernel(reduce or _REDUCE)(inputs=[x.reshape(rows, k), w], output_dtypes=[x.dtype], **plan)
    return out.reshape(*x.shape[:-1], n)


class SkinnyLinear(nn.Linear):
    """An ``nn.Linear`` whose products of 2..MAX_ROWS rows go to ``skinny_matmul``; everything else (one row,
    prefill chunks, a bias, other dtypes) runs mlx's own ``Linear``."""

    def __call__(self, x):
        w = self["weight"]
        if "bias" not in self and applies(x.size // x.shape[-1], x.shape[-1], x.dtype, w.dtype, w.shape[0]):
            return skinny_matmul(x, w)
        return super().__call__(x)


def install(model: nn.Module) -> int:
    """Give every plain ``nn.Linear`` of ``model`` (not quantized, not sharded, not an adapter wrapper) the
    skinny path. Returns how many projections took it."""
    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.Linear:
            m.__class__ = SkinnyLinear
            n += 1
    return n


def uninstall(model: nn.Module) -> None:
    for _, m in model.named_modules():
        if type(m) is SkinnyLinear:
            m.__class__ = nn.Linear


def self_check(reduce: Optional[str] = None) -> float:
    """The kernel against mlx's matmul on small bf16 cases on this device, before any request can reach it:
    a kernel that does not build or disagrees refuses the path. Returns the largest relative difference.
    Without ``reduce``: cooperative groups' reduction if it builds here (nvrtc may lack its headers), else the
    butterfly, and that one is used from then on."""
    global _REDUCE
    if reduce is None:
        first = None
        for red in dict.fromkeys((_REDUCE,) + REDUCTIONS):
            try:
                err = self_check(red)
            except ValueError as e:
                first = first or e
                continue
            _REDUCE = red
            return err
        raise first
    err = 0.0
    for rows, k, n in ((2, 256, 40), (5, 512, 1000), (16, 384, 96)):
        ks = mx.random.split(mx.random.key(rows * 7 + n), 2)
        x = mx.random.normal((rows, k), key=ks[0]).astype(mx.bfloat16)
        w = (mx.random.normal((n, k), key=ks[1]) * 0.05).astype(mx.bfloat16)
        try:
            got = skinny_matmul(x, w, reduce).astype(mx.float32)
        except Exception as e:  # a compile or launch failure on this device
            raise ValueError(f"--skinny-matmul: the kernel failed on this device ({e}); leave it off") from e
        want = (x.astype(mx.float32) @ w.astype(mx.float32).T)
        scale = mx.abs(want).max().item()
        err = max(err, mx.abs(got - want).max().item() / max(scale, 1e-6))
        if not err <= 2e-2:
            raise ValueError(f"--skinny-matmul: the kernel disagrees with mlx's matmul on this device "
                             f"(relative max |diff| {err:.3g}); leave it off")
    return err
