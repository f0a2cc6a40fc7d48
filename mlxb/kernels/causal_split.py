"""A short causal attention (a speculative verify: the pending token and its drafts) on MLX's CUDA vector kernel.

MLX's CUDA attention runs fewer than 4 queries through its fused vector kernel, causal included, and sends 4 or
more (K = 4 drafts make 5) to the unfused fallback: a product of the scores, the mask, a softmax and a second
product per layer, each its own kernel. For a lone row's verify step that fallback, with the step it cannot
pipeline, made a verify cost about three plain steps on the H200 (reports/h200/session36).

``split_causal`` cuts such a call into chunks of at most 3 queries; chunk ``[s, e)`` attends to the first
``kL - (qL - e)`` keys with MLX's own bottom-right causal mask, which is exactly the part of the causal mask
those queries see, so the result is the same attention (the chunks' sums run in the vector kernel's order).
``install`` wraps ``mx.fast.scaled_dot_product_attention`` (mlx-lm's attention calls it by attribute) on
CUDA only, after ``self_check`` compares the split with the unsplit call on this device; elsewhere (CPU, Metal,
whose vector kernel already takes these) nothing changes. The wrap is process-wide: mlx-lm code running in the
same process (an in-process parity oracle on CUDA, say) takes the split too.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlxb.kernels import cuda_gpu

CHUNK = 3  # MLX's CUDA vector kernel takes qL < 4
MAX_QUERIES = 33  # a verify of up to 32 drafts; longer causal calls are prefill chunks (MLX's own path)
HEAD_DIMS = (64, 96, 128)  # the vector kernel's head sizes (others take the fallback either way)

_ORIGINAL = None


def applies(q: mx.array, k: mx.array, mask, sinks) -> bool:
    if not isinstance(k, mx.array):  # a shared-prefix layer's keys (mlxb.cache.shared)
        return False
    qL, kL = q.shape[2], k.shape[2]
    return (isinstance(mask, str) and mask == "causal" and sinks is None and CHUNK < qL <= MAX_QUERIES
            and kL >= qL and q.shape[-1] in HEAD_DIMS and q.shape[-1] == k.shape[-1])


def split_causal(q: mx.array, k: mx.array, v: mx.array, *, scale: float, sdpa=None) -> mx.array:
    """Causal attention of ``q`` [B, H, qL, D] over ``k``/``v`` [B, Hk, kL, D] (queries aligned to the end of
    the keys) as chunks of at most CHUNK queries, each over the keys it can see."""
    sdpa = sdpa or _ORIGINAL or mx.fast.scaled_dot_product_attention
    qL, kL = q.shape[2], k.shape[2]
    outs = []
    for s in range(0, qL, CHUNK):
        e = min(s + CHUNK, qL)
        n = kL - (qL - e)
        outs.append(sdpa(q[:, :, s:e], k[:, :, :n], v[:, :, :n], scale=scale, mask="causal"))
    return mx.concatenate(outs, axis=2)


def _dispatch(q, k, v, *, scale, mask=None, sinks=None, **kw):
    if not kw and applies(q, k, mask, sinks):
        return split_causal(q, k, v, scale=scale)
    return _ORIGINAL(q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)


def self_check(dtype=mx.bfloat16) -> float:
    """Split against unsplit causal attention on this device (grouped heads, 4..9 queries, keys across the
    kernel's blocks). Raises ValueError if they disagree beyond the dtype's rounding; returns the largest
    difference."""
    sdpa = _ORIGINAL or mx.fast.scaled_dot_product_attention
    err = 0.0
    for B, H, G, qL, kL in ((1, 8, 4, 5, 300), (2, 4, 1, 9, 1100), (1, 2, 2, 4, 4)):
        ks = mx.random.split(mx.random.key(qL * 13 + kL), 3)
        q = mx.random.normal((B, H * G, qL, 128), key=ks[0]).astype(dtype)
        k = mx.random.normal((B, H, kL, 128), key=ks[1]).astype(dtype)
        v = mx.random.normal((B, H, kL, 128), key=ks[2]).astype(dtype)
        want = sdpa(q, k, v, scale=128 ** -0.5, mask="causal").astype(mx.float32)
        got = split_causal(q, k, v, scale=128 ** -0.5, sdpa=sdpa).astype(mx.float32)
        err = max(err, mx.abs(got - want).max().item())
    if not err <= (1e-5 if dtype == mx.float32 else 3e-2):
        raise ValueError(f"split causal attention disagrees with MLX's on this device (max |diff| {err:.3g})")
    return err


def available() -> bool:
    return cuda_gpu()


def install(force: bool = False) -> Optional[float]:
    """On CUDA (or ``force``), route short causal calls through ``split_causal``, once, if ``self_check``
    passes. Returns the self-check's difference, or None when nothing was installed."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return 0.0
    if not (force or available()):
        return None
    try:
        err = self_check()
    except ValueError:
        return None
    _ORIGINAL = mx.fast.scaled_dot_product_attention
    mx.fast.scaled_dot_product_attention = _dispatch
    return err


def uninstall() -> None:
    global _ORIGINAL
    if _ORIGINAL is not None:
        mx.fast.scaled_dot_product_attention = _ORIGINAL
        _ORIGINAL = None
