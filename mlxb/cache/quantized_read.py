"""How quantized KV layers hand keys and values to attention on this backend.

mlx-lm reads a quantized layer as a strided slice of its packed buffer (``keys[..., :offset, :]``).
MLX's CUDA backend has no ``quantized_matmul`` for such a slice ("No implementation for problem
shape"), so there the layers read the whole buffer and the mask hides the unwritten tail
(``whole_buffer_reads``: a one-time probe; ``MLXB_KV_WHOLE_BUFFER=1`` forces it). Masked keys add
exact zeros to the softmax and the weighted sum. ``QuantizedRowCache`` is mlx-lm's single-row
``QuantizedKVCache`` with that read; elsewhere it is exactly mlx-lm's.
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxb.kernels.quantized_attention import mark

_WHOLE: Optional[bool] = None


def whole_buffer_reads() -> bool:
    """True where ``mx.quantized_matmul`` refuses a strided slice of packed keys (probed once)."""
    global _WHOLE
    if _WHOLE is None:
        forced = os.environ.get("MLXB_KV_WHOLE_BUFFER")
        _WHOLE = forced == "1" if forced in ("0", "1") else _strided_reads_fail()
    return _WHOLE


def kv_reads() -> str:
    """How quantized layers hand keys and values to attention here (shown in /stats)."""
    return "whole-buffer" if whole_buffer_reads() else "strided"


def _strided_reads_fail() -> bool:
    if mx.default_device().type == mx.DeviceType.cpu:
        return False
    w = mx.quantize(mx.ones((1, 2, 64, 64)), group_size=64, bits=8)
    try:
        mx.eval(mx.quantized_matmul(mx.ones((1, 2, 1, 64)), *(a[..., :33, :] for a in w), transpose=True,
                                    group_size=64, bits=8))
        return False
    except (RuntimeError, ValueError):
        return True


def width_after(width: Optional[int], prev: int, n: int, step: int) -> int:
    """The buffer width once ``n`` tokens are written at ``prev`` (mlx-lm's growth rule)."""
    grow = (step + n - 1) // step * step
    if width is None:
        return grow
    if prev + n <= width:
        return width
    return (prev if prev % step else width) + grow


def hide_tail(mask: mx.array, width: int) -> mx.array:
    extra = width - mask.shape[-1]
    if extra <= 0:
        return mask
    return mx.concatenate([mask, mx.zeros(mask.shape[:-1] + (extra,), dtype=mx.bool_)], axis=-1)


def contiguous(t):
    """Row-contiguous arrays; MLX shares the buffer (no copy) when an array already is, which is every
    step but the first after a filter's trim or a lent view."""
    return tuple(mx.contiguous(a) for a in t)


class QuantizedRowCache(QuantizedKVCache):
    """A single-row quantized layer: mlx-lm's ``QuantizedKVCache``, reading whole buffers where the
    backend needs it (see the module notes); otherwise exactly mlx-lm's."""

    def update_and_fetch(self, keys, values):
        out = super().update_and_fetch(keys, values)
        if not whole_buffer_reads():
            return mark(out[0]), mark(out[1])
        self.keys, self.values = contiguous(self.keys), contiguous(self.values)
        return mark(self.keys), mark(self.values)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        if not whole_buffer_reads():
            return super().make_mask(N, return_array=return_array, window_size=window_size, **kwargs)
        width = width_after(None if self.keys is None else self.keys[0].shape[-2], self.offset, N, self.step)
        return hide_tail(create_causal_mask(N, self.offset, window_size=window_size), width)


class RowKVCache(KVCache):
    """mlx-lm's ``KVCache`` for the serial lane: ``to_quantized`` gives a ``QuantizedRowCache`` under
    the layer's own scheme (``kv_scheme``; None keeps the layer at full width)."""

    kv_scheme = None

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        s = self.kv_scheme
        return self if s is None else as_row(super().to_quantized(group_size=s.group_size, bits=s.bits))


def as_row(c: QuantizedKVCache) -> QuantizedRowCache:
    c.__class__ = QuantizedRowCache  # the same arrays and fields; only the read differs
    return c
