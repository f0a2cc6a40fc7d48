"""Quantized attention on the CPU, split across CPU streams so that it runs on more than one core.

MLX's CPU backend runs each stream's work on that stream's own thread, and its CPU ``quantized_matmul``
(two per quantized attention call, scores and weighted sum) runs on the calling thread only. Full-width
attention reaches the BLAS, which may use every core. So on a 2-core machine with OpenBLAS the quantized
read was 3x the full-width one (B=8, 1k keys: 7.3 ms against 2.3 ms).

``split_attention`` cuts one call into ``parts`` pieces along the KV heads (or, with fewer KV heads than
parts, along the batch rows), runs piece i on CPU stream i and joins the outputs. Every output element
is the same sum over the same keys in the same order as the whole call computes it, so the result is
bit-equal to the unsplit read (tested against mlx-lm's ``quantized_scaled_dot_product_attention``).
Handing a piece to another stream costs about 0.2 ms here, so calls below ``MIN_WORK`` (query heads x
query tokens x keys x rows) keep one stream.

``MLXB_KV_SPLIT``: ``auto`` (default: the usable cores, at most 8, on the CPU backend, divided among ``--tp``
ranks; 1 on GPUs, whose kernels already use the whole device) or a number of parts (1 turns splitting off).
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Optional

import mlx.core as mx

MIN_WORK = 16384
_PARTS: Optional[int] = None
_SHARERS = 1  # processes sharing this machine's cores (tensor-parallel ranks on one CPU host)
_LOCAL = threading.local()  # MLX streams belong to the thread that made them: each thread makes its own


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def split_parts() -> int:
    """How many CPU streams a quantized read is split across (decided once; ``reset()`` asks again)."""
    global _PARTS
    if _PARTS is None:
        how = os.environ.get("MLXB_KV_SPLIT", "auto")
        if how == "auto":
            _PARTS = max(1, min(_cores() // _SHARERS, 8)) if mx.default_device() == mx.cpu else 1
        else:
            try:
                _PARTS = int(how)
            except ValueError:
                _PARTS = 0
            if _PARTS < 1:
                raise ValueError(f"MLXB_KV_SPLIT={how}: use auto or a number of parts of at least 1")
    return _PARTS


def reset() -> None:
    global _PARTS
    _PARTS = None


def share_cores(processes: int) -> None:
    """``processes`` ranks share this host's cores (``--tp`` on one CPU machine): ``auto`` gives each its share,
    so two ranks on 2 cores read on one stream each instead of four threads on two cores."""
    global _SHARERS
    _SHARERS = max(1, processes)
    reset()


def _stream(i: int):
    streams = getattr(_LOCAL, "streams", None)
    if streams is None:
        streams = _LOCAL.streams = []
    while len(streams) < i:
        streams.append(mx.new_stream(mx.cpu))
    return streams[i - 1]


def _cuts(n: int, parts: int) -> list[tuple[int, int]]:
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def split_attention(read: Callable, queries, q_keys, q_values, scale, mask, group_size: int, bits: int,
                    parts: Optional[int] = None):
    """``read(queries, q_keys, q_values, scale, mask, group_size, bits)`` over ``parts`` CPU streams."""
    parts = split_parts() if parts is None else parts
    B, hq, L, _ = queries.shape
    hkv = q_keys[0].shape[-3]
    if parts < 2 or B * hq * L * q_keys[0].shape[-2] < MIN_WORK:
        return read(queries, q_keys, q_values, scale, mask, group_size, bits)
    if hkv >= 2:
        axis, n, parts = 1, hkv, min(parts, hkv)
    elif B >= 2:
        axis, n, parts = 0, B, min(parts, B)
    else:
        return read(queries, q_keys, q_values, scale, mask, group_size, bits)
    rep = hq // hkv if axis == 1 else 1
    outs = []
    for i, (lo, hi) in enumerate(_cuts(n, parts)):
        def cut(a, w=1):
            return a[:, lo * w:hi * w] if axis == 1 else a[lo:hi]
        m = mask
        if isinstance(mask, mx.array) and mask.ndim >= 3:
            if axis == 0 and mask.shape[0] == B:
                m = mask[lo:hi]
            elif axis == 1 and mask.ndim == 4 and mask.shape[1] == hq:
                m = cut(mask, rep)
        q, k, v = cut(queries, rep), tuple(cut(a) for a in q_keys), tuple(cut(a) for a in q_values)
        if i == 0:  # the caller's stream
            outs.append(read(q, k, v, scale, m, group_size, bits))
        else:
            with mx.stream(_stream(i)):
                outs.append(read(q, k, v, scale, m, group_size, bits))
    return mx.concatenate(outs, axis=axis)
