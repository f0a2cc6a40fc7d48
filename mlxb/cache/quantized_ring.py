"""Quantized KV for sliding-window (rotating) layers, single-row and batched.

mlx-lm has none (``RotatingKVCache.to_quantized`` and ``BatchRotatingKVCache.to_quantized`` raise).
A quantized ring here is three *lanes*, each an mlx-lm ring of the same window: lane 0 holds the
packed uint32 values of K and V, lane 1 their scales, lane 2 their biases (``mx.quantize`` along the
head dimension, so each token's three parts are independent of every other token). Every ring
operation mlx-lm has (in-place write and wrap, concatenating prefill with its trim, temporal
reordering, merge, extend, filter, extract, the cohort's right-padding roll) only moves whole token
positions, so running it on each lane with the same arguments keeps the three parts of every token in
the same slot: a row extracted after any joins and filters is bit-for-bit the row that went in, and
nothing is ever dequantized. Attention reads the lanes' (packed, scales, biases) as mlx-lm's quantized
path expects (``quantized_scaled_dot_product_attention``, chosen because the cache has ``bits``); the
mask is the ring's own (lane 0's).

Where the backend's quantized matmul refuses strided reads (``whole_buffer_reads``), the parts are
handed over as contiguous copies: a window at most, so the copy is bounded.

Stored prompt-cache entries are mlx-lm classes only (the SSD tier loads by class name): ``stored``
gives ``CacheList(ring, ring, ring, QuantizedKVCache())``, where the empty last member carries the
group size and bits; ``from_stored`` turns it back.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, CacheList, QuantizedKVCache, RotatingKVCache, _BaseCache

from mlxb.kernels.quantized_attention import mark
from mlxb.cache.quantized_read import contiguous, whole_buffer_reads

_SHARED = ("offset", "left_padding", "_lengths")  # per-lane mx arrays (updated in place by mlx-lm)
_BOOKKEEPING = {"offset", "left_padding", "_lengths", "_idx", "_offset", "rotated", "max_size", "keep", "step"}


def _copy(a):
    return None if a is None else mx.array(a)


class _Lanes(_BaseCache):
    """What the single-row and batch rings share: three lanes driven alike."""

    lanes: list

    def __init__(self, lanes, group_size: int, bits: int):
        self.lanes, self.group_size, self.bits = list(lanes), group_size, bits

    def __getattr__(self, name):  # ring bookkeeping is lane 0's (the lanes agree)
        if name not in _BOOKKEEPING:
            raise AttributeError(name)
        return getattr(self.lanes[0], name)

    def __setattr__(self, name, value):
        if name in ("lanes", "group_size", "bits"):
            object.__setattr__(self, name, value)
        elif name in ("keys", "values"):
            for lane, part in zip(self.lanes, value if value is not None else (None,) * 3):
                setattr(lane, name, part)
        else:  # every lane keeps its own copy: mlx-lm updates these in place
            for lane in self.lanes:
                setattr(lane, name, _copy(value) if isinstance(value, mx.array) else value)

    @property
    def keys(self):
        return None if self.lanes[0].keys is None else tuple(lane.keys for lane in self.lanes)

    @property
    def values(self):
        return None if self.lanes[0].values is None else tuple(lane.values for lane in self.lanes)

    def update_and_fetch(self, keys, values):
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        out = [lane.update_and_fetch(k, v) for lane, k, v in zip(self.lanes, qk, qv)]
        k, v = tuple(o[0] for o in out), tuple(o[1] for o in out)
        if whole_buffer_reads():
            k, v = contiguous(k), contiguous(v)
        return mark(k), mark(v)  # the fused kernel (when the mask fits) or the folded read, where selected

    def make_mask(self, *args, **kwargs):
        return self.lanes[0].make_mask(*args, **kwargs)

    def size(self):
        return self.lanes[0].size()

    def empty(self):
        return self.lanes[0].keys is None

    def is_trimmable(self):
        return self.lanes[0].is_trimmable()

    def trim(self, n):
        return [lane.trim(n) for lane in self.lanes][0]

    @property
    def nbytes(self):
        return sum(lane.nbytes for lane in self.lanes)

    @property
    def state(self):
        return [lane.state for lane in self.lanes]

    @state.setter
    def state(self, v):
        for lane, s in zip(self.lanes, v):
            lane.state = s


class QuantizedRotatingKVCache(_Lanes):
    """A single-row quantized ring (see the module notes)."""

    def __init__(self, max_size: int, keep: int = 0, group_size: int = 64, bits: int = 8, lanes=None):
        super().__init__(lanes or [RotatingKVCache(max_size, keep) for _ in range(3)], group_size, bits)

    @classmethod
    def from_plain(cls, c: RotatingKVCache, group_size: int, bits: int) -> "QuantizedRotatingKVCache":
        """The same ring, every slot quantized (its offset, write index and window unchanged)."""
        out = cls(c.max_size, c.keep, group_size, bits)
        if c.keys is not None:
            out.keys = mx.quantize(c.keys, group_size=group_size, bits=bits)
            out.values = mx.quantize(c.values, group_size=group_size, bits=bits)
        for lane in out.lanes:
            lane.offset, lane._idx = c.offset, c._idx
        return out

    @classmethod
    def merge(cls, caches):
        return BatchQuantizedRotatingKVCache.merge(caches)

    def stored(self, copy_arrays: bool = True) -> CacheList:
        """mlx-lm classes only (see the module notes)."""
        rings = []
        for lane in self.lanes:
            r = RotatingKVCache(lane.max_size, lane.keep)
            take = (lambda a: None if a is None else mx.contiguous(a)) if copy_arrays else (lambda a: a)
            r.keys, r.values, r.offset, r._idx = take(lane.keys), take(lane.values), lane.offset, lane._idx
            rings.append(r)
        return CacheList(*rings, QuantizedKVCache(group_size=self.group_size, bits=self.bits))

    @classmethod
    def from_stored(cls, c: CacheList) -> "QuantizedRotatingKVCache":
        *rings, scheme = c.caches
        out = cls(rings[0].max_size, rings[0].keep, scheme.group_size, scheme.bits)
        for lane, r in zip(out.lanes, rings):
            lane.keys, lane.values = (None if r.keys is None else r.keys[...]), (None if r.values is None else r.values[...])
            lane.offset, lane._idx = r.offset, r._idx
        return out


def is_stored_ring(c) -> bool:
    """A prompt-cache entry layer written by ``QuantizedRotatingKVCache.stored``."""
    return (isinstance(c, CacheList) and len(c.caches) == 4 and isinstance(c.caches[3], QuantizedKVCache)
            and all(isinstance(r, RotatingKVCache) for r in c.caches[:3]))


class BatchQuantizedRotatingKVCache(_Lanes):
    """A batch of quantized rings: three ``BatchRotatingKVCache`` lanes (see the module notes)."""

    def __init__(self, max_size: int, left_padding: list[int], group_size: int = 64, bits: int = 8, lanes=None):
        super().__init__(lanes or [BatchRotatingKVCache(max_size, left_padding) for _ in range(3)], group_size, bits)

    @classmethod
    def from_plain(cls, b: BatchRotatingKVCache, group_size: int, bits: int) -> "BatchQuantizedRotatingKVCache":
        out = cls(b.max_size, [0] * b.offset.shape[0], group_size, bits)
        if b.keys is not None:
            out.keys = mx.quantize(b.keys, group_size=group_size, bits=bits)
            out.values = mx.quantize(b.values, group_size=group_size, bits=bits)
        for lane in out.lanes:
            for name in _SHARED:
                setattr(lane, name, _copy(getattr(b, name)))
            lane._idx, lane._offset, lane.rotated = b._idx, b._offset, b.rotated
        return out

    @classmethod
    def merge(cls, caches):
        quantized = [c for c in caches if isinstance(c, QuantizedRotatingKVCache)]
        if not quantized:
            raise ValueError("no quantized ring to merge")
        g, b = quantized[0].group_size, quantized[0].bits
        if any((c.group_size, c.bits) != (g, b) for c in quantized):
            raise ValueError("rows of different KV schemes cannot share a batch layer")
        for c in caches:
            if not isinstance(c, QuantizedRotatingKVCache) and c.keys is not None:
                raise ValueError("quantized and plain rows cannot share a batch layer")

        def lane(c, j):
            return c.lanes[j] if isinstance(c, QuantizedRotatingKVCache) else c  # an empty plain ring
        lanes = [BatchRotatingKVCache.merge([lane(c, j) for c in caches]) for j in range(3)]
        return cls(lanes[0].max_size, [], g, b, lanes=lanes)

    def prepare(self, **kwargs):
        for lane in self.lanes:
            lane.prepare(**kwargs)

    def finalize(self):
        for lane in self.lanes:
            lane.finalize()

    def filter(self, batch_indices):
        for lane in self.lanes:
            lane.filter(batch_indices)

    def extend(self, other: "BatchQuantizedRotatingKVCache"):
        if (self.group_size, self.bits) != (other.group_size, other.bits):
            raise ValueError("rows of different KV schemes cannot share a batch layer")
        for lane, o in zip(self.lanes, other.lanes):
            lane.extend(o)

    def extract(self, idx: int) -> QuantizedRotatingKVCache:
        lanes = [lane.extract(idx) for lane in self.lanes]
        return QuantizedRotatingKVCache(lanes[0].max_size, lanes[0].keep, self.group_size, self.bits, lanes=lanes)


class RowRotatingKVCache(RotatingKVCache):
    """mlx-lm's ring for the serial lane: ``to_quantized`` (called by mlx-lm's
    ``maybe_quantize_kv_cache`` once the offset reaches the start) gives a ``QuantizedRotatingKVCache``
    under the layer's own scheme (``kv_scheme``; None keeps the ring as it is)."""

    kv_scheme = None

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        s = self.kv_scheme
        return self if s is None else QuantizedRotatingKVCache.from_plain(self, s.group_size, s.bits)
