"""The ``quant`` case's reference batch: quantized KV in the batch's own layout, from mlx-lm parts only.

mlx-lm quantizes KV on its single-stream path only (``QuantizedKVCache`` has no ``merge``, and
``BatchKVCache`` no ``to_quantized``). The oracle therefore builds its batch layer from three of
mlx-lm's ``BatchKVCache``s, one per part of ``mx.quantize``'s output (packed values, scales, biases),
each driven by mlx-lm's own row operations (merge, extend, filter with trim, extract, the cohort's
prepare/finalize roll) with the same arguments. A token's three parts are independent of every other
token, so the lanes stay in step; attention reads them through mlx-lm's
``quantized_scaled_dot_product_attention`` (the cache has ``bits``) with lane 0's mask. Single rows are
mlx-lm's ``QuantizedKVCache`` (``to_quantized``), converted where ``generate_step`` converts them.

No mlxb engine code is imported here.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, _BaseCache


class QRow(QuantizedKVCache):
    """mlx-lm's single-row ``QuantizedKVCache``, mergeable into a ``QBatch``."""

    @classmethod
    def merge(cls, caches):
        return QBatch.merge(caches)


def to_row(c: KVCache, group_size: int, bits: int) -> QRow:
    q = c.to_quantized(group_size=group_size, bits=bits)
    q.__class__ = QRow
    return q


def _part(c, j: int) -> KVCache:
    """Part ``j`` of a single-row quantized cache as a plain ``KVCache`` (for mlx-lm's merge)."""
    out = KVCache()
    if c.keys is not None and c.offset > 0:
        out.keys, out.values = c.keys[j][..., : c.offset, :], c.values[j][..., : c.offset, :]
        out.offset = c.offset
    return out


class QBatch(_BaseCache):
    def __init__(self, lanes: list, group_size: int, bits: int):
        self.lanes, self.group_size, self.bits = lanes, group_size, bits

    # bookkeeping is lane 0's (every lane receives the same operations)
    @property
    def offset(self):
        return self.lanes[0].offset

    @property
    def left_padding(self):
        return self.lanes[0].left_padding

    @property
    def _idx(self):
        return self.lanes[0]._idx

    @property
    def state(self):
        return [lane.state for lane in self.lanes]

    @property
    def nbytes(self):
        return sum(lane.nbytes for lane in self.lanes)

    def update_and_fetch(self, keys, values):
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        out = [lane.update_and_fetch(k, v) for lane, k, v in zip(self.lanes, qk, qv)]
        return tuple(o[0] for o in out), tuple(o[1] for o in out)

    def make_mask(self, *args, **kwargs):
        return self.lanes[0].make_mask(*args, **kwargs)

    def prepare(self, **kwargs):
        for lane in self.lanes:
            lane.prepare(**kwargs)

    def finalize(self):
        for lane in self.lanes:
            lane.finalize()

    def filter(self, batch_indices):
        for lane in self.lanes:
            lane.filter(batch_indices)

    def extend(self, other: "QBatch"):
        for lane, o in zip(self.lanes, other.lanes):
            lane.extend(o)

    def extract(self, idx: int) -> QRow:
        parts = [lane.extract(idx) for lane in self.lanes]
        row = QRow(group_size=self.group_size, bits=self.bits)
        if parts[0].keys is not None and parts[0].offset > 0:
            row.keys = tuple(p.keys for p in parts)
            row.values = tuple(p.values for p in parts)
            row.offset = parts[0].offset
        return row

    @classmethod
    def merge(cls, caches):
        ref = next(c for c in caches if isinstance(c, QuantizedKVCache))
        lanes = [BatchKVCache.merge([_part(c, j) for c in caches]) for j in range(3)]
        return cls(lanes, ref.group_size, ref.bits)

    @classmethod
    def from_batch(cls, b: BatchKVCache, group_size: int, bits: int) -> "QBatch":
        """A plain batch layer converted in place of its rows (same paddings and index)."""
        lanes = []
        qk = mx.quantize(b.keys[..., : b._idx, :], group_size=group_size, bits=bits)
        qv = mx.quantize(b.values[..., : b._idx, :], group_size=group_size, bits=bits)
        for j in range(3):
            lane = BatchKVCache([0] * b.offset.shape[0])
            lane.keys, lane.values = qk[j], qv[j]
            lane.offset, lane.left_padding, lane._idx = mx.array(b.offset), mx.array(b.left_padding), b._idx
            lanes.append(lane)
        return cls(lanes, group_size, bits)


def convert(caches: list, kv: dict, offset: int) -> list:
    """mlx-lm's ``maybe_quantize_kv_cache`` rule (convert once the offset reaches the start), giving
    mergeable rows; a plain batch layer converts whole."""
    if offset < kv["start"]:
        return caches
    g, b = kv["group_size"], kv["bits"]
    out = []
    for c in caches:
        if type(c) is KVCache:
            c = to_row(c, g, b)
        elif type(c) is BatchKVCache:
            c = QBatch.from_batch(c, g, b)
        out.append(c)
    return out
