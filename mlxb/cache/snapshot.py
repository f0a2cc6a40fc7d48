"""Per-layer snapshot, lend and measure operations for prompt-cache entries (single-row caches).

* ``snapshot(cache, kind)`` an immutable, compact copy of a single-row cache as it is now. Full and
  latent layers are copied down to their ``offset`` (``mx.contiguous``), so the entry holds exactly
  its tokens; rotating rings and recurrent states are copied whole (at most a window, or a fixed
  size), so an entry never keeps a batch buffer alive. Quantized rings (--kv-bits on sliding-window
  layers) are stored as mlx-lm classes (``QuantizedRotatingKVCache.stored``) and lent back as rings.
* ``lend(cache, kind, n)`` a new single-row cache for a row that starts from the first ``n`` tokens
  of a snapshot, without copying: full/latent layers are views trimmed to ``n`` (the row's first
  write grows into a fresh buffer), rings and states are new objects over the same arrays
  (``n`` must be the snapshot's whole length: they cannot be trimmed).
* ``layer_nbytes(cache)`` bytes an entry layer holds.

What reuses how (reported in ``/stats``): see ``REUSE``.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from mlxb.cache.quantized_read import QuantizedRowCache
from mlxb.cache.quantized_ring import QuantizedRotatingKVCache, is_stored_ring

REUSE = {
    "full": "any prefix length (trimmed)",
    "latent": "any prefix length (trimmed)",
    "rotating": "exact snapshot lengths only (chunk boundaries, len(prompt)-1, prompt+output)",
    "ssm": "exact snapshot lengths only (chunk boundaries, len(prompt)-1, prompt+output)",
}


def _fresh(a):
    return None if a is None else a[...]


def _packed(cache, n: int, copy_arrays: bool) -> QuantizedKVCache:
    """A quantized layer (--kv-bits) holding its first ``n`` tokens: packed values, scales, biases.
    Stored copies are mlx-lm's class (the SSD tier saves and loads by class name); lent ones read
    like the engine's rows (``QuantizedRowCache``)."""
    out = (QuantizedKVCache if copy_arrays else QuantizedRowCache)(group_size=cache.group_size, bits=cache.bits)
    if cache.keys is not None and n > 0:
        take = (lambda a: mx.contiguous(a[..., :n, :])) if copy_arrays else (lambda a: a[..., :n, :])
        out.keys, out.values = tuple(take(a) for a in cache.keys), tuple(take(a) for a in cache.values)
        out.offset = n
    return out


def snapshot(cache, kind: str):
    if isinstance(cache, QuantizedRotatingKVCache):
        return cache.stored()  # mlx-lm classes (the SSD tier), the ring's arrays copied
    if isinstance(cache, QuantizedKVCache):
        return _packed(cache, cache.offset, True)
    if kind in ("full", "latent"):
        out = KVCache()
        if cache.keys is not None and cache.offset > 0:
            n = cache.offset
            out.keys = mx.contiguous(cache.keys[..., :n, :])
            out.values = mx.contiguous(cache.values[..., :n, :])
            out.offset = n
        return out
    return copy.deepcopy(cache)  # a ring (at most the window) or a fixed-size state: copied whole


def lend(cache, kind: str, n):
    """A new single-row cache holding the first ``n`` tokens (None: all) of ``cache``."""
    if isinstance(cache, QuantizedKVCache):
        n = cache.offset if n is None else n
        assert 0 <= n <= cache.offset, (n, cache.offset)
        return _packed(cache, n, False)  # views: the row's first write grows into a fresh buffer
    if kind in ("full", "latent"):
        out = KVCache()
        n = cache.offset if n is None else n
        assert 0 <= n <= cache.offset, (n, cache.offset)
        if n > 0:
            out.keys, out.values, out.offset = cache.keys[..., :n, :], cache.values[..., :n, :], n
        return out
    if is_stored_ring(cache):
        assert n is None or n == cache.caches[0].offset, (n, cache.caches[0].offset)
        return QuantizedRotatingKVCache.from_stored(cache)
    if kind == "rotating":
        assert n is None or n == cache.offset, (n, cache.offset)
        out = RotatingKVCache(cache.max_size, cache.keep)
        out.keys, out.values = _fresh(cache.keys), _fresh(cache.values)
        out.offset, out._idx = cache.offset, cache._idx
        return out
    assert kind == "ssm", kind
    out = copy.copy(cache)
    out.cache = [_fresh(a) for a in cache.cache]
    return out


def arrays(cache) -> list:
    if isinstance(cache, CacheList):
        return [a for c in cache.caches for a in arrays(c)]
    if isinstance(cache, QuantizedKVCache):
        return [] if cache.keys is None else list(cache.keys) + list(cache.values)
    if isinstance(cache, (KVCache, RotatingKVCache)):
        return [a for a in (cache.keys, cache.values) if a is not None]
    return [a for a in getattr(cache, "cache", []) if a is not None]


def layer_nbytes(cache) -> int:
    return sum(a.nbytes for a in arrays(cache))


def num_tokens(cache, kind: str) -> int:
    """Tokens a single-row attention cache has seen (None for recurrent state)."""
    if is_stored_ring(cache):
        return int(cache.caches[0].offset)
    return int(cache.offset) if kind != "ssm" else None
