"""Models whose layers keep an mlx-lm ``CacheList`` (Falcon-H1: an SSM state and a KV cache per layer),
seen as one flat list of plain layer caches.

Every row operation, the KV projection, the prompt cache and speculation's checks work per layer cache
of a known kind (full, rotating, ssm, latent); a ``CacheList`` is none of them, so such models were served
on the serial lane only. ``FlatCacheModel`` hands out the sub-caches as if they were layers of their own
(``make_cache``) and groups them back into ``CacheList``s around the same objects on each call, so the
model's code updates the very caches the engine joins, filters and extracts. Everything else is the
wrapped model's (attributes, parameters, modules).
"""

from __future__ import annotations


class FlatCacheModel:
    """``model`` with its ``CacheList`` layers flattened; ``layout[i]``: layer i's sub-cache count (0: a
    plain layer cache)."""

    def __init__(self, model, layout: list[int]):
        self.__dict__["inner"] = model
        self.__dict__["layout"] = layout

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def make_cache(self) -> list:
        from mlx_lm.models.cache import CacheList

        out = []
        for c in self.inner.make_cache():
            out += list(c.caches) if isinstance(c, CacheList) else [c]
        return out

    def group(self, flat: list) -> list:
        from mlx_lm.models.cache import CacheList

        out, i = [], 0
        for n in self.layout:
            out.append(CacheList(*flat[i : i + n]) if n else flat[i])
            i += n or 1
        if i != len(flat):
            raise ValueError(f"{len(flat)} layer caches for a model that takes {i}")
        return out

    def __call__(self, inputs, cache=None, **kwargs):
        return self.inner(inputs, cache=None if cache is None else self.group(cache), **kwargs)


def flatten_cache_lists(model):
    """``model`` itself, or a ``FlatCacheModel`` where its ``make_cache`` gives ``CacheList`` layers of
    plain caches (a nested list is left alone: the serial lane serves it)."""
    from mlx_lm.models.cache import CacheList

    if not hasattr(model, "make_cache") or isinstance(model, FlatCacheModel):
        return model
    proto = model.make_cache()
    if not any(isinstance(c, CacheList) for c in proto):
        return model
    if any(isinstance(s, CacheList) for c in proto if isinstance(c, CacheList) for s in c.caches):
        return model
    return FlatCacheModel(model, [len(c.caches) if isinstance(c, CacheList) else 0 for c in proto])
