"""One row-operation protocol for every cache layer kind.

A layer's kind is read once from the model's prototype caches (``layer_kinds``); routing elsewhere
goes through ``ROW_OPS[kind]``, never through class-name checks scattered in the engine.

Row operations (all on mlx-lm caches; batch caches are left-padded, see ``BatchKVCache``):

* ``to_batch(solos, room)`` merge single-row caches into one batch cache (rows in order; full layers leave
  ``room`` free positions after the rows, so a cohort's forward writes in place)
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

Full and latent batch layers are ``AlignedBatchKVCache`` (``mlxb.cache.dense``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
)

from mlxb.cache.dense import AlignedBatchKVCache, roll_rows  # noqa: F401 (re-exported)
from mlxb.cache.projection import KVProjection, LayerBytes

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

    def to_batch(self, solos, room: int = 0):
        """``room``: positions to leave free after the rows (full layers; the others ignore it)."""
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
    def to_batch(self, solos, room: int = 0):
        if any(hasattr(s, "bits") for s in solos):  # quantized rows (--kv-bits): the packed batch layout
            from mlxb.cache.quantized import BatchQuantizedKVCache

            if not all(hasattr(s, "bits") or s.size() == 0 for s in solos):
                raise ValueError("quantized and plain rows cannot share a batch layer")
            return BatchQuantizedKVCache.merge(solos)
        if all(s.size() == 0 for s in solos):  # mlx-lm's merge returns its own class when empty
            return AlignedBatchKVCache([0] * len(solos))
        return AlignedBatchKVCache.merge(solos, room=room)

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
        if getattr(batch, "share", None) is not None:
            batch.share = [batch.share[i] for i in idx]
            batch._share_arr = None
        if batch.keys is not None:
            batch.keys, batch.values = batch.keys[idx], batch.values[idx]
        batch.offset, batch.left_padding = batch.offset[idx], batch.left_padding[idx]
        return batch


class _Rotating(_Full):
    def to_batch(self, solos, room: int = 0):
        if any(hasattr(s, "bits") for s in solos):  # quantized rings (--kv-bits): three lanes
            from mlxb.cache.quantized_ring import BatchQuantizedRotatingKVCache

            return BatchQuantizedRotatingKVCache.merge(solos)
        return BatchRotatingKVCache.merge(solos)

    def join_batch(self, batch, cohort, mode: str = "merge"):
        return super().join_batch(batch, cohort, "merge" if mode != "extend" else "extend")

    def filter(self, batch, keep, trim_padding: bool = True):
        return _RowOps.filter(self, batch, keep)


class _SSM(_RowOps):
    def to_batch(self, solos, room: int = 0):
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
