"""What the engine runs: mlx-lm's model with the corrections batched decoding needs (``engine_view``).

1. Layers that keep an mlx-lm ``CacheList`` are seen as plain layer caches (``mlxb.models.flat``).
2. Attention that meets a padded batch's mask on the wrong axis gets the axis (below).

The parity oracle runs mlx-lm's model as shipped (``load_model(engine_view=False)``) and corrects mlx-lm's
batch mode its own way (``oracle/grouped.py``), so parity checks these against an independent reference.

Gemma 2's attention (``mlx_lm.models.gemma2.Attention``) folds the query heads into
``(B, kv_heads, repeats, L, S)`` scores and adds the mask to them itself. A padded batch's mask is
``(B, 1, L, S)``; broadcast from the right against five axes its batch axis lands on the kv-head axis.
At B equal to the kv-head count that is silently wrong (row b's padding masks kv head b of every row),
at other B it raises "Shapes ... cannot be broadcast" in the decode step. A lone row's mask broadcasts
either way, so mlx-lm's single-stream path never meets it; its own batch mode does, the same way.

``fix_grouped_masks`` gives each such module a subclass whose call inserts the missing axis,
``(B, 1, 1, L, S)``, before mlx-lm's own code runs; masks of two axes, no mask, and a lone row are
passed on unchanged.
"""

from __future__ import annotations

import mlx.core as mx

GROUPED = {("mlx_lm.models.gemma2", "Attention")}  # (module, class) of attention with folded query heads
_SUBCLASSES: dict[type, type] = {}


def _grouped(cls: type) -> type:
    if cls not in _SUBCLASSES:

        def __call__(self, x, mask=None, cache=None):
            if isinstance(mask, mx.array) and mask.ndim == 4 and self.repeats > 1:
                mask = mx.expand_dims(mask, 2)  # (B, 1, L, S) -> (B, 1, 1, L, S) against (B, kv, rep, L, S)
            return cls.__call__(self, x, mask, cache)

        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                                       "mlxb_grouped_mask": True})
    return _SUBCLASSES[cls]


def fix_grouped_masks(model) -> int:
    """Patch every attention module of a ``GROUPED`` class in ``model`` not patched yet; returns how many."""
    n = 0
    for _, m in model.named_modules():
        cls = type(m)
        if (cls.__module__, cls.__name__) in GROUPED and not getattr(cls, "mlxb_grouped_mask", False):
            m.__class__ = _grouped(cls)
            n += 1
    return n


def engine_view(model):
    """``model`` corrected for the engine (idempotent: ``load_model`` applies it, the Engine again for
    models built elsewhere)."""
    from mlxb.models.flat import flatten_cache_lists

    fix_grouped_masks(model)
    return flatten_cache_lists(model)

