"""mlx-lm's batch mode, corrected where its Gemma 2 attention meets a padded batch's mask.

``mlx_lm.models.gemma2`` adds the mask to ``(B, kv_heads, repeats, L, S)`` scores, and the mask a
``BatchKVCache`` makes is ``(B, 1, L, S)``: broadcast from the right, its batch axis meets the kv-head
axis (wrong at B equal to the kv-head count, an error at other B; a lone row is unaffected). The oracle
keeps mlx-lm's model code and caches and instead gives the module's mask function an extra axis for
four-axis masks, so the reference is mlx-lm's batch mode as it would be with the shapes right. The
engine corrects the attention modules instead (``mlxb/models/model_fixes.py``); the two are
independent, so parity checks one against the other.
"""

from __future__ import annotations

import importlib

import mlx.core as mx

MODULES = ("mlx_lm.models.gemma2",)
_ORIGINAL: dict = {}


def correct_masks(model) -> None:
    """For a model of one of ``MODULES`` whose attention folds query heads (more query than kv heads):
    its module's mask function gives four-axis masks a fifth; otherwise mlx-lm's function as shipped.
    Affects only this (the oracle's) process, which holds one model at a time."""
    name = type(model).__module__
    if name not in MODULES:
        return
    mod = importlib.import_module(name)
    orig = _ORIGINAL.setdefault(name, mod.create_attention_mask)
    folded = any(getattr(m, "repeats", 1) > 1 for _, m in model.named_modules())

    def create_attention_mask(*args, **kwargs):
        mask = orig(*args, **kwargs)
        if isinstance(mask, mx.array) and mask.ndim == 4:
            mask = mx.expand_dims(mask, 2)  # (B, 1, L, S) -> (B, 1, 1, L, S)
        return mask

    mod.create_attention_mask = create_attention_mask if folded else orig
