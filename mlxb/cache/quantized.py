"""Quantized KV for full-attention layers under batching (mlx-lm quantizes KV on its single-stream path only).

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

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from mlxb.cache.protocol import AlignedBatchKVCache, roll_rows
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
            return self.keys, self.values
        return self.keys_and_values()

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        if not whole_buffer_reads():
            return super().make_mask(N, return_array=return_array, **kwargs)
        width = width_after(None if self.keys is None else self.keys[0].shape[2], self._idx, N, self.step)
        return hide_tail(BatchKVCache.make_mask(self, N, return_array=True, **kwargs), width)

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
    out = []
    for c, k, s in zip(caches, kinds, plan.layers):
        if s is not None and k == "full" and isinstance(c, BatchKVCache) and not hasattr(c, "bits"):
            c = quantize_batch(c, s.group_size, s.bits)
        elif s is not None and k == "full" and type(c) is KVCache:
            c = as_row(c.to_quantized(group_size=s.group_size, bits=s.bits))
        out.append(c)
    return out


def maybe_quantize(caches: list, kinds: list, plan, offset: int) -> list:
    """mlx-lm's ``maybe_quantize_kv_cache`` for one row's single-row caches: full-attention layers
    that the plan quantizes convert once ``offset`` (the row's tokens so far) reaches its start."""
    if plan is None:
        return caches
    plan = as_plan(plan, len(caches))
    if offset < plan.start:
        return caches
    return [as_row(c.to_quantized(group_size=s.group_size, bits=s.bits))
            if s is not None and k == "full" and type(c) is KVCache else c
            for c, k, s in zip(caches, kinds, plan.layers)]


class KVScheme:
    """``--kv-bits`` / ``--kv-group-size`` / ``--quantized-kv-start`` (mlx-lm's names and meaning)."""

    def __init__(self, bits: int, group_size: int = 64, start: int = 0):
        if bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"--kv-bits {bits}: choose 4 or 8 (MLX quantizes with 2-6 or 8 bits)")
        if group_size not in (32, 64, 128):
            raise ValueError(f"--kv-group-size {group_size}: choose 32, 64 or 128")
        if start < 0:
            raise ValueError("--quantized-kv-start must be >= 0")
        self.bits, self.group_size, self.start = bits, group_size, start

    @property
    def name(self) -> str:
        return f"kv{self.bits}g{self.group_size}s{self.start}"

    def bytes_per_token(self, heads: int, dk: int, dv: int, dtype_bytes: int) -> int:
        """Packed values + scales + biases of K and V for one token of one layer."""
        def one(d):
            return heads * (d * self.bits // 8 + 2 * (d // self.group_size) * dtype_bytes)
        return one(dk) + one(dv)


class KVPlan:
    """Per-layer schemes: ``layers[i]`` is layer i's ``KVScheme`` or None (full width). ``--kv-bits``
    is the uniform plan; ``--kv-config FILE`` gives a per-layer map (JSON):

        {"bits": 4, "group_size": 64, "start": 0, "layers": {"0": "none", "-1": "none", "5": 8}}

    ``layers`` overrides the default per layer index (negative counts from the end): "none" keeps the
    layer at full width, an integer sets its bits. Every row uses the server's plan (fixed at start-up),
    so rows of different schemes never share a layer buffer."""

    def __init__(self, layers: list, start: int = 0):
        self.layers, self.start = list(layers), start

    @property
    def uniform(self) -> Optional[KVScheme]:
        """The one scheme when every layer has the same one, else None."""
        first = self.layers[0] if self.layers else None
        same = all((s is None) == (first is None) and (s is None or (s.bits, s.group_size) == (first.bits, first.group_size))
                   for s in self.layers)
        return first if same else None

    @property
    def name(self) -> str:
        u = self.uniform
        if u is not None:
            return u.name
        parts = ["full" if s is None else f"kv{s.bits}g{s.group_size}" for s in self.layers]
        return f"per-layer[{','.join(parts)}]s{self.start}"

    @classmethod
    def from_file(cls, path: str, num_layers: int) -> "KVPlan":
        import json

        try:
            with open(path) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--kv-config {path}: cannot read it as JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"--kv-config {path}: the file must hold a JSON object")
        unknown = set(cfg) - {"bits", "group_size", "start", "layers"}
        if unknown:
            raise ValueError(f"--kv-config {path}: unknown key(s) {', '.join(sorted(unknown))}; "
                             "keys: bits, group_size, start, layers")
        group, start = int(cfg.get("group_size", 64)), int(cfg.get("start", 0))
        default = KVScheme(int(cfg["bits"]), group, start) if cfg.get("bits") is not None else None
        layers = [default] * num_layers
        for key, v in (cfg.get("layers") or {}).items():
            try:
                i = int(key)
            except ValueError:
                raise ValueError(f"--kv-config {path}: layer key {key!r} is not an integer index") from None
            if not -num_layers <= i < num_layers:
                raise ValueError(f"--kv-config {path}: layer {i} is outside this model's {num_layers} layers")
            if v == "none" or v is None:
                layers[i] = None
            elif isinstance(v, int) and not isinstance(v, bool):
                layers[i] = KVScheme(v, group, start)
            else:
                raise ValueError(f"--kv-config {path}: layer {key} must be \"none\" or a bit width, got {v!r}")
        return cls(layers, start)


def check_plan(plan: Optional[KVPlan], kinds: list) -> Optional[KVPlan]:
    """Refuse a plan this backend cannot run: with whole-buffer reads, one attention mask serves every
    full-attention layer, so they must all be quantized or all be full width."""
    if plan is not None and whole_buffer_reads():
        full = [s is None for s, k in zip(plan.layers, kinds) if k == "full"]
        if any(full) and not all(full):
            raise ValueError("this backend's quantized attention reads whole KV buffers, so a --kv-config that keeps "
                             "some full-attention layers at full width cannot run here; quantize them all (--kv-bits)")
    return plan


def as_plan(scheme, num_layers: int) -> Optional[KVPlan]:
    """A ``KVScheme`` (--kv-bits) as the uniform plan; a ``KVPlan`` as is."""
    if scheme is None or isinstance(scheme, KVPlan):
        return scheme
    return KVPlan([scheme] * num_layers, scheme.start)
