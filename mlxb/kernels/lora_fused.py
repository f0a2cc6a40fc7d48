"""Per-row LoRA in custom kernels for MLX's CUDA backend (``--lora-path fused``, asked for by name).

A decode step of an adapted model is host-bound on CUDA: each dependent op costs tens of microseconds to
dispatch there, and the stacked path's three ops per projection (shrink, row mask, ``addmm``) over the 224
projections of an 8B model about doubled a B=8 step. Two variants, both computing
``y + scale[slot] * (x @ A[slot]) @ B[slot]`` per row and copying ``y`` for a row without an adapter (slot -1):

* ``split`` (the default, ``MLXB_LORA_KERNEL``): ``mlxb_lora_shrink``, one block per (chunk of ``CH`` inputs,
  row), writes float32 partial shrinks; ``mlxb_lora_expand``, one block per (row, tile of outputs), sums them
  and writes the tile. Two launches, each short.
* ``one``: a single launch, one block per (row, tile of outputs), each block re-doing its row's whole shrink
  before its tile. One launch, but the serial shrink of a 14336-wide input made it the slower one.

Rounding follows mlx-lm's ``LoRALinear``: ``h`` and ``z = h @ B`` in the promoted dtype of the input and the
factors (float32 factors, as mlx_lm.lora saves them, keep float32), ``(scale * z).astype(x.dtype)``, then the
add in the input's dtype; the sums run in float32 in another order than a matmul's. Measured on the H200
(``scripts/probes/lora_kernel_cost.py``, 8B projections, B=8 and 32, 4 adapters of rank 16), microseconds per
projection summed over the 8 shapes: one builtin ``addmm`` 280, split 326, stacked 391, one 443-521; in the
engine (``mlxb bench lora``) neither fused variant was reliably faster than stacked, so auto keeps stacked.
``self_check`` runs on the device before any request can reach it; the CPU runs the same sources through the
C++ emulation in the tests.
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx

from mlxb.kernels import cuda_gpu, kernel_name

NT = 256  # threads per block
TARGET_BLOCKS = 132  # blocks per launch the tiles aim at (scripts/probes/lora_kernel_cost.py sweeps it)
MAX_ROWS = 128  # above this (prefill chunks) every row re-reading its A costs more than the exact path
MAX_RANK = 64  # registers per thread hold one accumulator per rank

# shared fragments: a row's tile bounds (and the copy for a row without an adapter), the shrink over inputs
# [i0, i1) into R float32 accumulators summed over the block (``red``), and the expand of ``h`` over the tile
_TILE = r"""
  const int o0 = tile * TILE;
  const int o1 = (o0 + TILE < Dout) ? o0 + TILE : Dout;
  const size_t yr = (size_t)row * Dout;
  const int s = slot[row];
  if (s < 0) {  // a row without an adapter: its base output
    for (int o = o0 + t; o < o1; o += NT) out[yr + o] = y[yr + o];
    return;
  }
"""

_SHRINK_SUM = r"""
  __shared__ float red[NT / 32][R];
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  if (s >= 0) {
    const T* xr = x + (size_t)row * Din;
    const F* as = a + (size_t)s * Din * R;
#pragma unroll 4
    for (int i = i0 + t; i < i1; i += NT) {
      const float xi = static_cast<float>(xr[i]);
      const F* ai = as + (size_t)i * R;
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] += xi * static_cast<float>(ai[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float v = acc[r];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) red[warp][r] = v;
  }
  __syncthreads();
"""

_EXPAND_TILE = r"""
  __syncthreads();
  const F* bs = b + (size_t)s * R * Dout;
  const float sc = static_cast<float>(scale[s]);
  for (int o = o0 + t; o < o1; o += NT) {
    float z = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) z += h[r] * static_cast<float>(bs[(size_t)r * Dout + o]);
    const float sz = static_cast<float>(static_cast<P>(sc * static_cast<float>(static_cast<P>(z))));
    out[yr + o] = static_cast<T>(static_cast<float>(y[yr + o]) + static_cast<float>(static_cast<T>(sz)));
  }
"""

_SOURCE = r"""
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int tile = blockIdx.x, row = blockIdx.y;
  const int Din = x_shape[1], Dout = y_shape[1];
  const int i0 = 0, i1 = Din;
""" + _TILE + _SHRINK_SUM + r"""
  __shared__ float h[R];
  if (t < R) {
    float v = 0.f;
    for (int w = 0; w < NT / 32; ++w) v += red[w][t];
    h[t] = static_cast<float>(static_cast<P>(v));  // x @ A in the promoted dtype
  }
""" + _EXPAND_TILE

_SHRINK = r"""
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int c = blockIdx.x, row = blockIdx.y, nch = gridDim.x;
  const int Din = x_shape[1];
  const int s = slot[row];
  const int i0 = c * CH, i1 = (c + 1) * CH < Din ? (c + 1) * CH : Din;
""" + _SHRINK_SUM + r"""
  if (t < R) {
    float v = 0.f;
    for (int w = 0; w < NT / 32; ++w) v += red[w][t];
    part[((size_t)row * nch + c) * R + t] = v;
  }
"""

_EXPAND = r"""
  const int t = threadIdx.x;
  const int tile = blockIdx.x, row = blockIdx.y;
  const int Dout = y_shape[1], nch = part_shape[1];
""" + _TILE + r"""
  __shared__ float h[R];
  if (t < R) {
    float v = 0.f;
    for (int c = 0; c < nch; ++c) v += part[((size_t)row * nch + c) * R + t];
    h[t] = static_cast<float>(static_cast<P>(v));  // x @ A in the promoted dtype
  }
""" + _EXPAND_TILE

CH = 2 * NT  # inputs per shrink block of the split pair
MODES = ("one", "split")
_MODE = os.environ.get("MLXB_LORA_KERNEL", "split")  # which variant fused_delta launches (scripts/probes/lora_kernel_cost.py)
_KERNELS: dict = {}
_PLANS: dict = {}  # (shape, dtypes, mode, geometry) -> (launch plan, split plan)


def available() -> bool:
    return cuda_gpu()


def supports(rank: int, rows: int) -> bool:
    return rank <= MAX_RANK and rows <= MAX_ROWS


def tile_for(rows: int, out_dim: int) -> int:
    """Outputs per block: enough blocks over all rows to fill the GPU once, each tile a multiple of NT."""
    want = -(-out_dim * rows // TARGET_BLOCKS)
    tile = max(NT, -(-want // NT) * NT)
    return min(tile, -(-out_dim // NT) * NT)


def launch_plan(rows: int, out_dim: int, rank: int, dtype, factor_dtype) -> dict:
    """Template constants, grid (in threads, as ``cuda_kernel`` takes it) and output shape for ``rows`` rows;
    shared by ``fused_delta`` and the CPU emulation test."""
    tile = tile_for(rows, out_dim)
    tiles = -(-out_dim // tile)
    promoted = mx.result_type(dtype, factor_dtype) if not isinstance(dtype, str) else dtype
    return dict(template=[("T", dtype), ("F", factor_dtype), ("P", promoted), ("R", rank), ("NT", NT),
                          ("TILE", tile)],
                grid=(tiles * NT, rows, 1), threadgroup=(NT, 1, 1), output_shapes=[(rows, out_dim)])


def _kernel(which: str):
    if which not in _KERNELS:
        spec = {"one": (["x", "y", "a", "b", "slot", "scale"], ["out"], _SOURCE),
                "shrink": (["x", "a", "slot"], ["part"], _SHRINK),
                "expand": (["y", "part", "b", "slot", "scale"], ["out"], _EXPAND)}[which]
        _KERNELS[which] = mx.fast.cuda_kernel(name=kernel_name(f"mlxb_lora_{which}", spec[2]), input_names=spec[0], output_names=spec[1],
                                              source=spec[2])
    return _KERNELS[which]


def split_plan(rows: int, in_dim: int, rank: int, dtype, factor_dtype) -> dict:
    """The split pair's shrink launch: one block per (chunk of CH inputs, row), float32 partial sums out."""
    nch = -(-in_dim // CH)
    return dict(template=[("T", dtype), ("F", factor_dtype), ("R", rank), ("NT", NT), ("CH", CH)],
                grid=(nch * NT, rows, 1), threadgroup=(NT, 1, 1), output_shapes=[(rows, nch, rank)])


def fused_delta(x: mx.array, y: mx.array, a: mx.array, b: mx.array, slots: mx.array, scales: mx.array,
                mode: Optional[str] = None) -> mx.array:
    """``y + scale[slot] * (x @ a[slot]) @ b[slot]`` per row (rows with slot -1 keep ``y``).

    x [..., Din], y [..., Dout] (same leading shape), a [N, Din, R], b [N, R, Dout], slots int32 [rows],
    scales [N] in the promoted dtype of x and the factors."""
    lead = y.shape[:-1]
    rows = 1
    for d in lead:
        rows *= d
    x2, y2 = x.reshape(rows, x.shape[-1]), y.reshape(rows, y.shape[-1])
    mode = mode or _MODE
    key = (rows, x.shape[-1], y.shape[-1], a.shape[2], x.dtype, a.dtype, mode, NT, TARGET_BLOCKS)
    plans = _PLANS.get(key)
    if plans is None:  # built once per shape: this runs for every adapted projection of every step
        plans = _PLANS[key] = (launch_plan(rows, y.shape[-1], a.shape[2], x.dtype, a.dtype),
                               split_plan(rows, x.shape[-1], a.shape[2], x.dtype, a.dtype) if mode == "split" else None)
    plan = plans[0]
    if mode == "split":
        (part,) = _kernel("shrink")(inputs=[x2, a, slots], output_dtypes=[mx.float32], **plans[1])
        (out,) = _kernel("expand")(inputs=[y2, part, b, slots, scales], output_dtypes=[y.dtype], **plan)
    else:
        (out,) = _kernel("one")(inputs=[x2, y2, a, b, slots, scales], output_dtypes=[y.dtype], **plan)
    return out.reshape(*lead, y.shape[-1])


def reference_delta(x, y, a, b, slots, scales) -> mx.array:
    """mlx-lm's ``LoRALinear`` row by row (``y + (scale * ((x @ A) @ B)).astype(x.dtype)``), for the checks."""
    rows = []
    xs, ys = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            rows.append(ys[i])
            continue
        z = (xs[i : i + 1] @ a[s]) @ b[s]
        rows.append((ys[i : i + 1] + (scales[s] * z).astype(x.dtype))[0])
    return mx.stack(rows).reshape(y.shape)


def self_check(dtype=mx.float32, factor_dtype=mx.float32, tol: Optional[float] = None,
               mode: Optional[str] = None) -> float:
    """The kernel on small cases (several adapters, a row without one, ranks 8 and 16, a tile count above one)
    against ``reference_delta`` before any request can reach it: a kernel that does not build or disagrees on
    this device refuses the path instead of failing requests. Returns the largest difference."""
    err = 0.0
    tol = tol if tol is not None else (1e-4 if dtype == mx.float32 else 0.07)
    for rows, din, dout, rank, n in ((3, 512, 1280, 8, 2), (9, 384, 768, 16, 3)):
        k = mx.random.split(mx.random.key(rows * 31 + rank), 4)
        x = mx.random.normal((rows, 1, din), key=k[0]).astype(dtype)
        y = mx.random.normal((rows, 1, dout), key=k[1]).astype(dtype)
        a = (0.05 * mx.random.normal((n, din, rank), key=k[2])).astype(factor_dtype)
        b = (0.05 * mx.random.normal((n, rank, dout), key=k[3])).astype(factor_dtype)
        slots = mx.array([(i % (n + 1)) - 1 for i in range(rows)], dtype=mx.int32)
        scales = mx.array([2.0, 20.0, 0.5][:n]).astype(mx.result_type(dtype, factor_dtype))
        try:
            got = fused_delta(x, y, a, b, slots, scales, mode)
            want = reference_delta(x, y, a, b, slots, scales)
            err = max(err, mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item())
        except Exception as e:  # a compile or launch failure on this device
            raise ValueError(f"--lora-path fused: the kernel failed on this device ({e}); use --lora-path stacked") from e
        if not err <= tol:
            raise ValueError(f"--lora-path fused: the kernel disagrees with mlx-lm's LoRALinear on this device "
                             f"(max |diff| {err:.3g} > {tol:g}); use --lora-path stacked")
    return err
