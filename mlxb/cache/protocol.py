"""One row-operation protocol for every cache layer kind.

A layer's kind is read once from the model's prototype caches (``layer_kinds``); routing elsewhere
goes through ``ROW_OPS[kind]``, never through class-name checks scattered in the engine.

Row operations (all on mlx-lm caches; batch caches are left-padded, see ``BatchKVCache``):

* ``to_batch(solos)``   merge single-row caches into one batch cache (rows in order)
* ``join(batch, solo)`` add one row at the end (the one-row case of ``join_batch``): full/latent/ssm extend (pad + one batch-axis
  concat, running rows untouched); rotating re-merges every row's temporal view, which is safe
  across ring wraps. ``join_full="merge"`` re-merges full layers instead (a different pad layout,
  so it has its own parity case).
* ``join_batch(batch, cohort)`` add every row of another batch cache (a prefill cohort) at the end:
  full/latent/ssm extend; rotating (and ``merge`` mode) re-merge every row's temporal view.
* ``filter(batch, keep)`` keep rows in order (in place); full layers drop left padding shared by
  every survivor, exactly as mlx-lm's ``BatchKVCache.filter`` does.
* ``extract(batch, i)`` one row back as a single cache with the solo run's bytes.
* ``nbytes(cache)``     bytes held now.

The single-row (adopted) caches are KVCache / RotatingKVCache / ArraysCache: a row alone in the
batch keeps them, so a B=1 step is the serial graph.

Full and latent batch layers are ``AlignedBatchKVCache``: mlx-lm's ``BatchKVCache`` plus a host-side
``aligned`` flag the runner sets when no row has left padding. A one-token step over an aligned
batch then needs no attention mask (every key is visible to every row), exactly like the single-row
cache; the mask is skipped, which on some backends also selects a faster attention kernel.
The mask is skipped only where attention without it gives the same bits as with an all-True mask
(``mask_free_is_exact``, probed once per head size and dtype): on MLX's CUDA backend it did not for
tiny-gemma4, whose batched rows then differed from mlx-lm in the last bits. ``MLXB_ALIGNED_NO_MASK=0``
always keeps the mask; ``=force`` always skips it (faster on CUDA, not bit-exact there).
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
)

from mlxb.cache.holes import compact, unholed
from mlxb.engine.outputs import KVProjection, LayerBytes

_SKIP_ALIGNED_MASK = os.environ.get("MLXB_ALIGNED_NO_MASK", "1") != "0"
# "force": skip it even where the probe says the bits differ (CUDA: ~1.4-1.9 ms faster per 8B decode step,
# measured; logits then differ from mlx-lm's batch mode in the last bits)
_FORCE_ALIGNED_NO_MASK = os.environ.get("MLXB_ALIGNED_NO_MASK") == "force"


_MASK_FREE: dict = {}


def mask_free_is_exact(keys) -> bool:
    """Whether one-token attention over keys shaped like ``keys`` gives the same bits with no mask as
    with an all-True mask on this backend (the kernel chosen may differ); probed once per shape class."""
    if keys is None:
        return False
    if not isinstance(keys, mx.array):  # packed quantized keys: their own attention path, not probed here
        return True
    H, D, dt = keys.shape[1], keys.shape[-1], keys.dtype
    key = (H, D, str(dt))
    if key not in _MASK_FREE:
        ok = True
        for T in (5, 64, 300):
            for G in (1, 2, 4, 8):  # query heads per KV head (GQA ratios of real models)
                k1, k2, k3 = mx.random.split(mx.random.key(T * 7 + G), 3)
                q = mx.random.normal((2, H * G, 1, D), key=k1).astype(dt)
                k = mx.random.normal((2, H, T, D), key=k2).astype(dt)
                v = mx.random.normal((2, H, T, D), key=k3).astype(dt)
                a = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=None)
                b = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5,
                                                         mask=mx.ones((2, 1, 1, T), dtype=mx.bool_))
                ok = ok and bool(mx.array_equal(a, b).item())
        _MASK_FREE[key] = ok
    return _MASK_FREE[key]


class AlignedBatchKVCache(BatchKVCache):
    """``BatchKVCache`` whose owner may declare it unpadded (``aligned``); see the module notes."""

    aligned = False  # set by the runner from host-side row lengths; never guessed
    holes = None  # rejected speculative entries, masked in place (mlxb/cache/holes.py)
    hole_counts = None

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        if self.holes is not None:
            return unholed(self, BatchKVCache.make_mask(self, N, return_array=True, **kwargs))
        if (N == 1 and self.aligned and not return_array and _SKIP_ALIGNED_MASK
                and (_FORCE_ALIGNED_NO_MASK or mask_free_is_exact(self.keys))):
            return None  # the same result as an all-True mask
        return super().make_mask(N, return_array=return_array, **kwargs)

    # rows leave or join only without holes (moved to the left padding first)
    def filter(self, batch_indices):
        compact(self)
        super().filter(batch_indices)

    def extend(self, other):
        compact(self)
        compact(other)
        super().extend(other)

    def extract(self, idx):
        compact(self)
        return super().extract(idx)

    # NOTE: merge and finalize give mlx-lm's arrays bit for bit (a contract test compares them) but
    # move data with contiguous slices and concatenations only. mlx-lm's merge writes row by row into
    # a zero buffer and its finalize rolls with take_along_axis over broadcast indices; on an H200
    # the roll of an 18-row cohort on a 2.2k-token prefix took 236 ms and the merge 41 ms of one
    # iteration (scripts/cohort_cost.py), while the forward itself took 114 ms.
    @classmethod
    def merge(cls, caches):
        lengths = [c.size() for c in caches]
        width = max(lengths)
        if width == 0:
            return cls([0] * len(caches))
        ref = next(c for c in caches if c.keys is not None and c.size() > 0)
        _, H, _, Dk = ref.keys.shape
        Dv, dt = ref.values.shape[3], ref.keys.dtype

        def rows(attr, D):
            out = []
            for n, c in zip(lengths, caches):
                a = getattr(c, attr)
                if a is None or n == 0:
                    out.append(mx.zeros((1, H, width, D), dtype=dt))
                    continue
                a = a[..., :n, :]
                out.append(mx.pad(a, [(0, 0), (0, 0), (width - n, 0), (0, 0)]) if n < width else a)
            return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)

        cache = cls([width - n for n in lengths])
        cache.keys, cache.values = rows("keys", Dk), rows("values", Dv)
        cache.offset += width
        cache._idx = width
        return cache

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        self._right_host = list(right_padding) if right_padding is not None and max(right_padding) > 0 else None

    def finalize(self):
        shifts = getattr(self, "_right_host", None)
        if self._right_padding is None or shifts is None:
            return super().finalize()
        self.keys, self.values = roll_rows(self.keys, shifts), roll_rows(self.values, shifts)
        padding = self._right_padding
        self.offset = self.offset - padding
        self.left_padding += padding
        self._right_padding = self._right_host = None


def roll_rows(x: mx.array, shifts: list[int]) -> mx.array:
    """``mlx_lm.models.cache.dynamic_roll(x, shifts[:, None], axis=2)`` for a [B, H, N, D] array with
    host-side shifts: each row rolled right by its shift along the sequence axis (rows with equal
    shifts in a run are rolled together)."""
    n = x.shape[2]
    parts, i = [], 0
    while i < len(shifts):
        j = i
        while j < len(shifts) and shifts[j] == shifts[i]:
            j += 1
        s = shifts[i] % n
        block = x[i:j] if (i, j) != (0, len(shifts)) else x
        parts.append(mx.concatenate([block[:, :, n - s:], block[:, :, :n - s]], axis=2) if s else block)
        i = j
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


LATENT_MODEL_TYPES = {"glm4_moe_lite", "deepseek_v2", "deepseek_v3", "kimi_k2"}


def layer_kind(cache, latent: bool = False) -> Optional[str]:
    """Capability-based kind of one layer cache; None means not batchable."""
    if type(cache) in (KVCache, BatchKVCache, AlignedBatchKVCache):
        return "latent" if latent else "full"
    if isinstance(cache, (RotatingKVCache, BatchRotatingKVCache)) or hasattr(cache, "lanes"):
        return "rotating"  # ``lanes``: the quantized rings of mlxb/cache/quantized_ring.py
    if isinstance(cache, ArraysCache):
        return "ssm"
    return None


def layer_kinds(model) -> list[Optional[str]]:
    from mlx_lm.models.cache import make_prompt_cache

    latent = getattr(getattr(model, "args", None), "model_type", None) in LATENT_MODEL_TYPES
    return [layer_kind(c, latent) for c in make_prompt_cache(model)]


class _RowOps:
    """What every kind shares: ``join`` is the one-row case of ``join_batch``."""

    def to_batch(self, solos):
        raise NotImplementedError

    def join_batch(self, batch, cohort, mode: str):
        raise NotImplementedError

    def join(self, batch, solo, mode: Optional[str] = None):
        cohort = self.to_batch([solo])
        return self.join_batch(batch, cohort) if mode is None else self.join_batch(batch, cohort, mode)

    def filter(self, batch, keep, trim_padding: bool = True):
        batch.filter(keep)
        return batch

    def extract(self, batch, i):
        return batch.extract(i)


class _Full(_RowOps):
    def to_batch(self, solos):
        if any(hasattr(s, "bits") for s in solos):  # quantized rows (--kv-bits): the packed batch layout
            from mlxb.cache.quantized import BatchQuantizedKVCache

            if not all(hasattr(s, "bits") or s.size() == 0 for s in solos):
                raise ValueError("quantized and plain rows cannot share a batch layer")
            return BatchQuantizedKVCache.merge(solos)
        if all(s.size() == 0 for s in solos):  # mlx-lm's merge returns its own class when empty
            return AlignedBatchKVCache([0] * len(solos))
        return AlignedBatchKVCache.merge(solos)

    def join_batch(self, batch, cohort, mode: str = "extend"):
        if mode == "merge":
            rows = [c.extract(i) for c in (batch, cohort) for i in range(c.offset.shape[0])]
            return self.to_batch(rows)
        batch.extend(cohort)
        return batch

    def filter(self, batch, keep, trim_padding: bool = True):
        if trim_padding:
            return super().filter(batch, keep)
        # NOTE: only the parity negative control takes this branch (planted bug).
        idx = keep
        if batch.keys is not None:
            batch.keys, batch.values = batch.keys[idx], batch.values[idx]
        batch.offset, batch.left_padding = batch.offset[idx], batch.left_padding[idx]
        return batch


class _Rotating(_Full):
    def to_batch(self, solos):
        if any(hasattr(s, "bits") for s in solos):  # quantized rings (--kv-bits): three lanes
            from mlxb.cache.quantized_ring import BatchQuantizedRotatingKVCache

            return BatchQuantizedRotatingKVCache.merge(solos)
        return BatchRotatingKVCache.merge(solos)

    def join_batch(self, batch, cohort, mode: str = "merge"):
        return super().join_batch(batch, cohort, "merge" if mode != "extend" else "extend")

    def filter(self, batch, keep, trim_padding: bool = True):
        return _RowOps.filter(self, batch, keep)


class _SSM(_RowOps):
    def to_batch(self, solos):
        return ArraysCache.merge(solos)

    def join_batch(self, batch, cohort, mode: str = "extend"):
        batch.extend(cohort)
        return batch


ROW_OPS = {"full": _Full(), "latent": _Full(), "rotating": _Rotating(), "ssm": _SSM()}
DEFAULT_JOIN = {"full": "extend", "latent": "extend", "rotating": "merge", "ssm": "extend"}


def nbytes(cache) -> int:
    try:
        return int(cache.nbytes)
    except Exception:
        return 0


def base_forward(model) -> None:
    """Before a probe forward outside the runner: LoRA rows off (an earlier engine's slots would not fit)."""
    lora = getattr(model, "mlxb_lora", None)
    if lora is not None:
        lora.set([-1])


def kv_projection(model, kinds: list[Optional[str]], scheme=None) -> KVProjection:
    """Per-layer KV bytes measured from one real 1-token forward (dtype and head shapes included).
    With a quantized scheme (--kv-bits), full-attention and sliding-window layers hold
    ``scheme.start`` tokens at full width and the rest packed (values + scales + biases)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxb.cache.kv_plan import as_plan

    caches = make_prompt_cache(model)
    base_forward(model)
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    plan = as_plan(scheme, len(caches))
    layers = []
    for i, (c, kind) in enumerate(zip(caches, kinds)):
        scheme = plan.layers[i] if plan is not None else None
        if kind in ("full", "latent", "rotating"):
            per_tok = (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
            window = c.max_size if kind == "rotating" else None
            if kind in ("full", "rotating") and scheme is not None:
                dims = {c.keys.shape[3], c.values.shape[3]}
                if any(d % scheme.group_size for d in dims):
                    fits = [g for g in (32, 64, 128) if not any(d % g for d in dims)]
                    raise ValueError(f"--kv-group-size {scheme.group_size} does not divide this model's head dimension "
                                     f"({', '.join(map(str, sorted(dims)))}); choose a group size that divides it: "
                                     + (" or ".join(map(str, fits)) if fits else "none of 32, 64, 128 does"))
                q = scheme.bytes_per_token(c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype.size)
                layers.append(LayerBytes(kind, q, window, 0, per_tok, scheme.start))
                continue
            layers.append(LayerBytes(kind, per_tok, window))
        elif kind == "ssm":
            layers.append(LayerBytes(kind, 0, None, sum(a.nbytes for a in c.cache if a is not None)))
    if plan is not None:
        _reads_packed(model, caches, kinds, plan)
    return KVProjection(tuple(layers))


def admission_projection(model, kinds: list[Optional[str]], scheme=None, spec=None) -> KVProjection:
    """What admission counts per row: the model's KV bytes (``kv_projection``), plus a draft model's
    (``--spec draft`` keeps one plain cache row of the draft per target row)."""
    proj = kv_projection(model, kinds, scheme)
    draft = getattr(spec, "draft_model", None)
    if draft is None:
        return proj
    return KVProjection(proj.layers + kv_projection(draft, layer_kinds(draft)).layers)


def _reads_packed(model, caches: list, kinds: list, plan) -> None:
    """One more 1-token forward over the probe's caches converted under ``plan``: attention that computes
    its scores by hand (Gemma 2's softcapped scores) instead of through ``scaled_dot_product_attention``
    cannot read packed keys; refuse the flag at start-up rather than fail every request."""
    import mlx.core as mx

    from mlxb.cache.quantized import quantize_now

    try:
        mx.eval(model(mx.array([[1]]), cache=quantize_now(caches, kinds, plan)))
    except Exception as e:
        attn = sorted({f"{type(m).__module__.rsplit('.', 1)[-1]}.{type(m).__name__}" for _, m in model.named_modules()
                       if type(m).__name__.endswith("Attention")})
        raise ValueError(f"--kv-bits: this model's attention ({', '.join(attn) or type(model).__module__}) cannot "
                         f"read a quantized cache: {type(e).__name__}: {str(e).splitlines()[0][:120]} (attention "
                         "computed by hand, as Gemma 2's softcapped scores, or attention sinks, as gpt-oss's, which "
                         "MLX's quantized attention lacks; mlx-lm's own kv_bits fails on such models too). Serve it "
                         "without --kv-bits / --kv-config.") from None
