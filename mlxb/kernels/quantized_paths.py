"""Quantized decode attention without the grouped-query broadcast, and the probe that decides when to use it.

mlx-lm's ``quantized_scaled_dot_product_attention`` reads grouped-query layers by giving the packed keys
and values a broadcast axis for the query heads of each KV head (``expand_dims(..., -3)``) and calling
``quantized_matmul`` on the broadcast batch. On MLX's CUDA backend (mlx 0.32.4, H200) that broadcast
gives wrong scores: 0.5 max error against float32 attention with 4 query heads per KV head, while one
query head per KV head is exact (``scripts/kv_fused_diag.py``, ``scripts/probes/cuda_qmm_probe.py``).

``folded_attention`` is the same arithmetic with the query heads of each KV head folded into the rows of
one matmul ([B, Hkv, R*L, D] against [B, Hkv, N, D/pack]), so no batch axis is broadcast.
``broadcast_exact()`` runs mlx-lm's path once on a small grouped-query case against
``reference_attention`` (plain float32 ops over the dequantized cache, no ``quantized_matmul``) and says
whether the engine's quantized layers may keep mlx-lm's path on this backend. On the CPU backend mlx-lm's read
is right (no probe), and the engine's layers fold anyway: there it is the same result, bit for bit,
for less work (``fold_reads``). mlx-lm's own caches (the parity oracle) keep mlx-lm's path everywhere.
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx

_EXACT: Optional[bool] = None
_FOLD: Optional[bool] = None  # fold_reads(), decided once (it is asked per layer per step)
READS = ("auto", "folded", "mlx-lm")


def reference_attention(queries, q_keys, q_values, scale: float, mask, group_size: int, bits: int):
    """Float32 attention over the dequantized keys and values with plain MLX ops (no ``quantized_matmul``)."""
    k = mx.dequantize(*q_keys, group_size=group_size, bits=bits).astype(mx.float32)
    v = mx.dequantize(*q_values, group_size=group_size, bits=bits).astype(mx.float32)
    B, hq, L, D = queries.shape
    hkv = k.shape[1]
    qf = (queries.astype(mx.float32) * scale).reshape(B, hkv, hq // hkv, L, D)
    s = qf @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    if mask is not None:
        s = mx.where(mx.expand_dims(mask, -3) if mask.ndim == 4 else mask, s, -mx.inf)
    return (mx.softmax(s, axis=-1) @ mx.expand_dims(v, 2)).reshape(B, hq, L, D)


def folded_attention(queries, q_keys, q_values, scale: float, mask, group_size: int = 64, bits: int = 8):
    """mlx-lm's quantized attention (same masks, precise softmax) with no broadcast batch axis."""
    B, hq, L, D = queries.shape
    hkv = q_keys[0].shape[-3]
    R = hq // hkv
    q = (queries * scale).reshape(B, hkv, R * L, D)
    scores = mx.quantized_matmul(q, *q_keys, transpose=True, group_size=group_size, bits=bits)
    if mask is not None:
        N = scores.shape[-1]
        if isinstance(mask, str):
            mask = mx.arange(N - L, N)[:, None] >= mx.arange(N)[None]
        scores = scores.reshape(B, hkv, R, L, N)
        m = mx.expand_dims(mask, -3) if mask.ndim > 3 else mask
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + m
        scores = scores.reshape(B, hkv, R * L, N)
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *q_values, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, hq, L, D)


def probe(tol: float = 1e-3) -> bool:
    """Run mlx-lm's (unpatched) quantized read once on a small grouped-query case (4 query heads per KV
    head, padding) against ``reference_attention``; True when it agrees within ``tol``."""
    import mlx_lm.models.base as base

    mlx_lm_path = base.quantized_scaled_dot_product_attention
    mlx_lm_path = getattr(mlx_lm_path, "_mlxb_original", mlx_lm_path)
    k1, k2, k3 = mx.random.split(mx.random.key(11), 3)
    B, hq, hkv, D, n = 2, 8, 2, 128, 96
    q = mx.random.normal((B, hq, 1, D), key=k1)
    qk = mx.quantize(mx.random.normal((B, hkv, n, D), key=k2), group_size=64, bits=8)
    qv = mx.quantize(mx.random.normal((B, hkv, n, D), key=k3), group_size=64, bits=8)
    mask = (mx.arange(n)[None] >= mx.array([0, 9])[:, None]).reshape(B, 1, 1, n)
    want = reference_attention(q, qk, qv, D ** -0.5, mask, 64, 8)
    got = mlx_lm_path(mx.array(q), qk, qv, scale=D ** -0.5, mask=mask, group_size=64, bits=8)
    return bool(mx.abs(got.astype(mx.float32) - want).max().item() <= tol)


def broadcast_exact() -> bool:
    """Whether the engine's quantized layers may keep mlx-lm's grouped-query read on the default device
    (probed once; True on the CPU without probing)."""
    global _EXACT
    if _EXACT is None:
        _EXACT = True if mx.default_device() == mx.cpu else probe()
    return _EXACT


def fold_reads() -> bool:
    """Whether the engine's quantized layers read through ``folded_attention``: ``MLXB_KV_READ=folded`` or
    ``mlx-lm`` forces it (measurements), ``auto`` (default) folds on the CPU and where mlx-lm's read is
    wrong. On the CPU the folded read is mlx-lm's arithmetic bit for bit (tested) and cheaper: each packed
    key is unpacked once for all the query heads of its KV head, not once per query head (synth-llama-30m,
    B=8 over 1k keys, KV8: 219-225 ms a step against 227-235 on netlib BLAS, ``scripts/kv_step_cost.py``).
    Decided once; ``reset()`` asks again."""
    global _FOLD
    if _FOLD is None:
        how = os.environ.get("MLXB_KV_READ", "auto")
        if how not in READS:
            raise ValueError(f"MLXB_KV_READ={how}: choose one of {', '.join(READS)}")
        _FOLD = how == "folded" or (how == "auto" and (mx.default_device() == mx.cpu or not broadcast_exact()))
    return _FOLD


def reset() -> None:
    global _FOLD
    _FOLD = None
