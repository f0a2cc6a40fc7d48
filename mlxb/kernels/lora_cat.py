"""The concat LoRA path's expand in one CUDA launch (``--lora-path concat`` on MLX's CUDA backend).

The concat path (``mlxb.adapters.concat``) computes a group's base outputs and every adapter's shrinks ``z``
in one product ``P = [y | z]``. What is left per adapted group is each row's expand: ``y + z[row's block] @ B``.
MLX takes four ops for it (slice ``z``, multiply by the row mask, ``addmm`` onto ``P``, slice ``y`` back out),
and on a GPU whose decode step is bound by the host's launches each op costs the host its dispatch. This kernel
does the same in one launch reading ``P`` in place: one thread per (row, output), summing only its row's own
adapter's ``R`` shrink columns for the part the output belongs to (so ``R`` products an output, not all
adapters' blocks with zeros in the others), in float32, added to the base output and rounded once (as
``addmm`` does; the sums run in another order than cuBLAS's). A row without an adapter (slot -1) copies its
base outputs.

Expand factors, ``bp [N, R, O]``: output ``c`` of a touched part ``j`` holds adapter ``s``'s
``scale_s * B_j[s][:, c - start_j]`` (zeros elsewhere); ``zoff [O]`` int32: where that part's rank block
starts inside an adapter's block of ``z`` (``W`` columns per adapter), -1 for an output no adapter touches.

``self_check`` compares the kernel with the ``addmm`` formula on the device before the path uses it; the CPU
runs the same source through the C++ emulation in the tests (``tests/unit/test_lora_cat_emulated.py``).
"""

from __future__ import annotations

import os

import mlx.core as mx

from mlxb.kernels import cuda_gpu, kernel_name

NT = 256  # threads per block, each one output of one row
MAX_ROWS = int(os.environ.get("MLXB_LORA_CAT_MAX_ROWS", "64"))  # prefill chunks above this keep the addmm

SOURCE = r"""
  const int c = blockIdx.x * NT + threadIdx.x, row = blockIdx.y;
  const int O = zoff_shape[0];  // the product's rows are P wide (a constant: no reshapes around the launch)
  if (c >= O) return;
  const size_t pr = (size_t)row * P;
  const int s = slot[row], zo = zoff[c];
  float acc = static_cast<float>(p[pr + c]);
  if (s >= 0 && zo >= 0) {
    const T* z = p + pr + O + (size_t)s * W + zo;
    const auto* bs = bp + (size_t)s * R * O + c;  // the factors keep their own dtype
    float d = 0.f;
#pragma unroll
    for (int k = 0; k < R; ++k) d += static_cast<float>(z[k]) * static_cast<float>(bs[(size_t)k * O]);
    acc += d;
  }
  out[(size_t)row * O + c] = static_cast<T>(acc);
"""

_KERNEL: list = []
_PLANS: dict = {}


def available() -> bool:
    return cuda_gpu() and os.environ.get("MLXB_LORA_CAT_KERNEL", "auto") != "0"


def launch_plan(lead: tuple, outputs: int, rank: int, width: int, product: int, dtype) -> dict:
    """Template constants, grid (in threads, as ``cuda_kernel`` takes it) and output shape (``lead`` + outputs)
    for a product of shape ``lead + (product,)``; shared with the CPU emulation test."""
    rows = 1
    for d in lead:
        rows *= d
    return dict(template=[("T", dtype), ("R", rank), ("W", width), ("P", product), ("NT", NT)],
                grid=(-(-outputs // NT) * NT, rows, 1), threadgroup=(NT, 1, 1), output_shapes=[(*lead, outputs)])


def _kernel():
    if not _KERNEL:
        _KERNEL.append(mx.fast.cuda_kernel(name=kernel_name("mlxb_lora_cat_expand", SOURCE), input_names=["p", "bp", "zoff", "slot"],
                                           output_names=["out"], source=SOURCE))
    return _KERNEL[0]


def expand(p: mx.array, bp: mx.array, zoff: mx.array, slots: mx.array, width: int) -> mx.array:
    """``p [..., O + N * width]`` (the group's product), ``bp [N, R, O]``, ``zoff`` int32 [O], ``slots`` int32
    [rows] (-1: none). Returns ``[..., O]``: each row's base outputs plus its adapter's delta."""
    key = (p.shape, zoff.shape[0], bp.shape[1], width, p.dtype)
    plan = _PLANS.get(key)
    if plan is None:  # once per shape: this runs for every adapted group of every step
        plan = _PLANS[key] = dict(launch_plan(p.shape[:-1], zoff.shape[0], bp.shape[1], width, p.shape[-1], p.dtype),
                                  output_dtypes=[p.dtype])
    (out,) = _kernel()(inputs=[p, bp, zoff, slots], **plan)
    return out


def factors(b_parts: list, bounds: list, scales: list, outputs: int, dtype) -> tuple:
    """``bp`` and ``zoff`` from each part's expand factors: ``b_parts[j]`` None for a part no adapter touches,
    else ``[N, R, out_j]``; ``bounds[j]`` the part's output columns."""
    import numpy as np

    n = len(scales)
    r = next(b.shape[1] for b in b_parts if b is not None)
    bp = mx.zeros((n, r, outputs), dtype=mx.float32)
    zoff = np.full((outputs,), -1, dtype=np.int32)
    k = 0
    for b, (s, e) in zip(b_parts, bounds):
        if b is None:
            continue
        sc = mx.array(scales, dtype=mx.float32).reshape(n, 1, 1)
        bp[:, :, s:e] = sc * b.astype(mx.float32)
        zoff[s:e] = k * r
        k += 1
    return bp.astype(dtype), mx.array(zoff)


def reference(p: mx.array, bp: mx.array, zoff: mx.array, slots: mx.array, width: int) -> mx.array:
    """What the kernel computes, op by op in float32 (for the device check)."""
    O = zoff.shape[0]
    rows = p.size // p.shape[-1]
    p2 = p.reshape(rows, -1).astype(mx.float32)
    out = []
    for i, s in enumerate(slots.tolist()):
        y = p2[i, :O]
        if s >= 0:
            z = p2[i, O + s * width : O + (s + 1) * width]
            idx = mx.maximum(zoff, 0)[None, :] + mx.arange(bp.shape[1])[:, None]  # [R, O] columns of z
            d = (mx.take(z, idx) * bp[s].astype(mx.float32)).sum(axis=0)
            y = y + mx.where(zoff >= 0, d, 0.0)
        out.append(y)
    return mx.stack(out).astype(p.dtype).reshape(*p.shape[:-1], O)


def self_check(dtype=mx.bfloat16) -> float:
    """The kernel against ``reference`` on a small case (three adapters, a row without one, an untouched part,
    a ragged last block); raises ValueError where it does not build or disagrees. Returns the largest
    difference."""
    k = mx.random.split(mx.random.key(7), 3)
    n, r, parts = 3, 8, [(0, 300), (300, 420), (420, 700)]
    touched = [0, 2]
    width = len(touched) * r
    O = parts[-1][1]
    b_parts = [(0.1 * mx.random.normal((n, r, e - s), key=k[0])) if j in touched else None
               for j, (s, e) in enumerate(parts)]
    bp, zoff = factors(b_parts, parts, [2.0, 0.5, 8.0], O, dtype)
    p = mx.random.normal((5, 1, O + n * width), key=k[1]).astype(dtype)
    slots = mx.array([0, -1, 2, 1, 0], dtype=mx.int32)
    try:
        got = expand(p, bp, zoff, slots, width)
        want = reference(p, bp, zoff, slots, width)
        err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    except Exception as e:  # a compile or launch failure on this device
        raise ValueError(f"the concat LoRA kernel failed on this device ({e})") from e
    tol = 1e-4 if dtype == mx.float32 else 0.07
    if not err <= tol:
        raise ValueError(f"the concat LoRA kernel disagrees with its reference on this device (max |diff| {err:.3g})")
    return err
