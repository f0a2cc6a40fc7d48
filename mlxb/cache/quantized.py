"""Quantized KV for full-attention layers under batching (mlx-lm quantizes KV on its single-stream path only);
sliding-window layers: ``mlxb/cache/quantized_ring.py``.

``BatchQuantizedKVCache`` is mlx-lm's ``QuantizedKVCache`` layout (each of K and V is a tuple of packed
uint32 values, scales and biases, from ``mx.quantize`` along the head dimension) with ``BatchKVCache``'s
row bookkeeping (per-row ``offset`` and ``left_padding``, a shared buffer index). Every row operation
the engine uses (merge of single-row ``QuantizedKVCache``s, extend, filter with trim, extract, the
cohort's right-padding roll) moves the packed arrays as they are and never dequantizes, so a row that is
extracted after any sequence of joins and filters is bit-for-bit the one that went in. The attention
layers take mlx-lm's quantized path (``quantized_scaled_dot_product_attention``) because the cache has
``bits`` and ``group_size``; the mask is ``BatchKVCache``'s, and none when the batch is aligned.

Where the backend's quantized matmul refuses a strided slice (MLX's CUDA backend), layers read their
whole buffer with the tail masked: see ``mlxb/cache/quantized_read.py``.

Conversion follows mlx-lm's ``maybe_quantize_kv_cache``: a single-row ``KVCache`` becomes a
``QuantizedKVCache`` (``to_quantized``) at a prefill chunk end once its offset reaches
``--quantized-kv-start``; a batch of plain rows converts with ``quantize_batch``.
"""

from __future__ import annotations


import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxb.cache.holes import compact, unholed
from mlxb.cache.kv_plan import KVPlan, KVScheme, as_plan, check_plan, fit_plan  # noqa: F401 (re-exported)
from mlxb.cache.dense import AlignedBatchKVCache, roll_rows
from mlxb.kernels.quantized_attention import mark
from mlxb.cache.quantized_read import QuantizedRowCache, as_row, contiguous, hide_tail, whole_buffer_reads, width_after


def _tmap(fn, t):
    return None if t is None else tuple(fn(a) for a in t)


def _pad_rows(t, left: int, right: int = 0):
    if left == 0 and right == 0:
        return t
    return _tmap(lambda a: mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)]), t)


def _zeros_like_row(t, width: int):
    return tuple(mx.zeros((1, a.shape[1], width, a.shape[3]), dtype=a.dtype) for a in t)


class BatchQuantizedKVCache(AlignedBatchKVCache):
    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    # ---- forward ------------------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        B, H, L, Dk = keys.shape
        Dv = values.shape[-1]
        prev = self._idx
        if self.keys is None or prev + L > self.keys[0].shape[2]:
            el = 32 // self.bits
            n = (self.step + L - 1) // self.step * self.step

            def fresh(D):
                return (mx.zeros((B, H, n, D // el), dtype=mx.uint32),
                        mx.zeros((B, H, n, D // self.group_size), dtype=keys.dtype),
                        mx.zeros((B, H, n, D // self.group_size), dtype=keys.dtype))

            if self.keys is None:
                self.keys, self.values = fresh(Dk), fresh(Dv)
            else:
                if prev % self.step != 0:
                    self.keys = _tmap(lambda a: a[..., :prev, :], self.keys)
                    self.values = _tmap(lambda a: a[..., :prev, :], self.values)
                grow_k, grow_v = fresh(Dk), fresh(Dv)
                self.keys = tuple(mx.concatenate([a, g], axis=2) for a, g in zip(self.keys, grow_k))
                self.values = tuple(mx.concatenate([a, g], axis=2) for a, g in zip(self.values, grow_v))
        self.offset = self.offset + L
        self._idx += L
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev:self._idx, :] = qk[i]
            self.values[i][..., prev:self._idx, :] = qv[i]
        if whole_buffer_reads():
            self.keys, self.values = contiguous(self.keys), contiguous(self.values)
            return mark(self.keys), mark(self.values)
        k, v = self.keys_and_values()
        return mark(k), mark(v)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        if not whole_buffer_reads():
            return super().make_mask(N, return_array=return_array, **kwargs)
        width = width_after(None if self.keys is None else self.keys[0].shape[2], self._idx, N, self.step)
        mask = BatchKVCache.make_mask(self, N, return_array=True, **kwargs)
        return hide_tail(unholed(self, mask) if self.holes is not None else mask, width)

    def keys_and_values(self):
        return _tmap(lambda a: a[..., : self._idx, :], self.keys), _tmap(lambda a: a[..., : self._idx, :], self.values)

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in self.keys + self.values)

    # ---- row operations (packed form only) ------------------------------------------------------
    @classmethod
    def merge(cls, caches):
        """Left-padded batch of single-row ``QuantizedKVCache``s (empty rows allowed)."""
        ref = next((c for c in caches if getattr(c, "keys", None) is not None and c.offset > 0), None)
        group = next((c.group_size for c in caches if hasattr(c, "group_size")), 64)
        bits = next((c.bits for c in caches if hasattr(c, "bits")), 8)
        lengths = [c.offset if getattr(c, "keys", None) is not None else 0 for c in caches]
        width = max(lengths)
        if width == 0 or ref is None:
            return cls([0] * len(caches), group, bits)
        for c in caches:
            if c.keys is not None and (c.group_size, c.bits) != (group, bits):
                raise ValueError("rows of different KV schemes cannot share a batch layer")

        def rows(attr):
            out = []
            for n, c in zip(lengths, caches):
                t = getattr(c, attr)
                if t is None or n == 0:
                    out.append(_zeros_like_row(getattr(ref, attr), width))
                    continue
                out.append(_pad_rows(_tmap(lambda a: a[..., :n, :], t), width - n))
            return tuple(mx.concatenate([r[i] for r in out], axis=0) if len(out) > 1 else out[0][i] for i in range(3))

        cache = cls([width - n for n in lengths], group, bits)
        cache.keys, cache.values = rows("keys"), rows("values")
        cache.offset += width
        cache._idx = width
        return cache

    def extend(self, other: "BatchQuantizedKVCache"):
        compact(self)
        compact(other)
        if (self.group_size, self.bits) != (other.group_size, other.bits):
            raise ValueError("rows of different KV schemes cannot share a batch layer")
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        ref = self if self.keys is not None else other
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c):
            k, v = c.keys, c.values
            if k is None:
                n = c.offset.shape[0]
                k = tuple(mx.zeros((n,) + a.shape[1:2] + (0,) + a.shape[3:], dtype=a.dtype) for a in ref.keys)
                v = tuple(mx.zeros((n,) + a.shape[1:2] + (0,) + a.shape[3:], dtype=a.dtype) for a in ref.values)
            left = idx - c._idx
            right = size - k[0].shape[2] - left
            if right < 0:
                k, v = _tmap(lambda a: a[..., :right, :], k), _tmap(lambda a: a[..., :right, :], v)
                right = 0
            return _pad_rows(k, left, right), _pad_rows(v, left, right), c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b], axis=0) for a, b in zip(k1, k2))
        self.values = tuple(mx.concatenate([a, b], axis=0) for a, b in zip(v1, v2))
        self.offset, self.left_padding = mx.concatenate([o1, o2]), mx.concatenate([p1, p2])
        self._idx = idx

    def filter(self, batch_indices):
        compact(self)
        idx = mx.array(batch_indices) if not isinstance(batch_indices, mx.array) else batch_indices
        if self.keys is not None:
            self.keys, self.values = _tmap(lambda a: a[idx], self.keys), _tmap(lambda a: a[idx], self.values)
        self.offset = self.offset[idx]
        self.left_padding = self.left_padding[idx]
        trim = min(self.left_padding.tolist())
        if trim > 0:
            if self.keys is not None:
                self.keys = _tmap(lambda a: a[..., trim:, :], self.keys)
                self.values = _tmap(lambda a: a[..., trim:, :], self.values)
            self._idx -= trim
            self.left_padding -= trim

    def extract(self, idx: int) -> QuantizedKVCache:
        compact(self)
        c = QuantizedRowCache(group_size=self.group_size, bits=self.bits)
        pad = self.left_padding.tolist()[idx]
        c.keys = _tmap(lambda a: mx.contiguous(a[idx : idx + 1, :, pad : self._idx]), self.keys)
        c.values = _tmap(lambda a: mx.contiguous(a[idx : idx + 1, :, pad : self._idx]), self.values)
        c.offset = self._idx - pad
        return c

    def finalize(self):
        shifts = getattr(self, "_right_host", None)
        if self._right_padding is None:
            return
        assert shifts is not None, "prepare() records the host-side shifts"
        self.keys = tuple(roll_rows(a, shifts) for a in self.keys)
        self.values = tuple(roll_rows(a, shifts) for a in self.values)
        padding = self._right_padding
        self.offset = self.offset - padding
        self.left_padding += padding
        self._right_padding = self._right_host = None


def quantize_batch(b: BatchKVCache, group_size: int, bits: int) -> BatchQuantizedKVCache:
    """A plain batch layer in the quantized layout (the same rows, paddings and index)."""
    q = BatchQuantizedKVCache([0] * b.offset.shape[0], group_size, bits)
    q.offset, q.left_padding, q._idx = b.offset, b.left_padding, b._idx
    if b.keys is not None:
        q.keys = mx.quantize(b.keys[..., : b._idx, :], group_size=group_size, bits=bits)
        q.values = mx.quantize(b.values[..., : b._idx, :], group_size=group_size, bits=bits)
    return q


def quantize_now(caches: list, kinds: list, plan: "KVPlan") -> list:
    """Every full-attention layer the plan quantizes, converted now whatever its offset (a row that
    shares a batch: quantized and plain rows never share a layer buffer)."""
    from mlxb.cache.quantized_ring import BatchQuantizedRotatingKVCache

    out = []
    for c, k, s in zip(caches, kinds, plan.layers):
        if s is not None and k == "full" and isinstance(c, BatchKVCache) and not hasattr(c, "bits"):
            c = quantize_batch(c, s.group_size, s.bits)
        elif s is not None and k == "rotating" and isinstance(c, BatchRotatingKVCache):
            c = BatchQuantizedRotatingKVCache.from_plain(c, s.group_size, s.bits)
        else:
            c = _quantize_row(c, k, s)
        out.append(c)
    return out


def _quantize_row(c, kind: str, s):
    """One single-row layer converted under scheme ``s`` (None: kept), as mlx-lm's ``to_quantized``
    would; sliding-window rings become ``QuantizedRotatingKVCache`` (mlx-lm raises there)."""
    from mlxb.cache.quantized_ring import QuantizedRotatingKVCache

    if s is None:
        return c
    if kind == "full" and type(c) is KVCache:
        return as_row(c.to_quantized(group_size=s.group_size, bits=s.bits))
    if kind == "rotating" and isinstance(c, RotatingKVCache):
        return QuantizedRotatingKVCache.from_plain(c, s.group_size, s.bits)
    return c


def serial_caches(caches: list, kinds: list, plan: "KVPlan") -> list:
    """The serial lane's caches for mlx-lm's ``generate_step``: its ``maybe_quantize_kv_cache`` calls
    ``to_quantized`` on every layer once the offset reaches the start; here each full-attention or
    sliding-window layer converts under its own scheme (per-layer plans included) and the others stay."""
    from mlxb.cache.quantized_read import RowKVCache
    from mlxb.cache.quantized_ring import RowRotatingKVCache

    for c, k, s in zip(caches, kinds, plan.layers):
        if type(c) is KVCache:
            c.__class__ = RowKVCache
        elif type(c) is RotatingKVCache:
            c.__class__ = RowRotatingKVCache
        else:
            continue
        c.kv_scheme = s if k in ("full", "rotating") else None
    return caches


def maybe_quantize(caches: list, kinds: list, plan, offset: int) -> list:
    """mlx-lm's ``maybe_quantize_kv_cache`` for one row's single-row caches: full-attention and
    sliding-window layers that the plan quantizes convert once ``offset`` (the row's tokens so far)
    reaches its start."""
    if plan is None:
        return caches
    plan = as_plan(plan, len(caches))
    if offset < plan.start:
        return caches
    return [_quantize_row(c, k, s) for c, k, s in zip(caches, kinds, plan.layers)]
