"""The dense batch layer: mlx-lm's ``BatchKVCache`` plus a host-side
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

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxb.cache.holes import compact, unholed

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
        if self.keys is None or other.keys is None:
            return super().extend(other)
        # mlx-lm pads each side that does not end at the longer write position (a copy of that side) and then
        # concatenates (a second copy): where a side needs padding, both are written once into one zero buffer
        idx, size = max(self._idx, other._idx), max(self.keys.shape[2], other.keys.shape[2])
        place = [(idx - c._idx, size - c.keys.shape[2] - (idx - c._idx)) for c in (self, other)]
        if all(p == (0, 0) for p in place) or any(right < 0 for _, right in place):
            return super().extend(other)  # one concatenation already, or mlx-lm's trim of a side's tail
        B1 = self.keys.shape[0]
        parts = [(0, place[0][0], self), (B1, place[1][0], other)]
        self.keys = _placed(B1 + other.keys.shape[0], size, [(lo, left, c.keys) for lo, left, c in parts])
        self.values = _placed(B1 + other.keys.shape[0], size, [(lo, left, c.values) for lo, left, c in parts])
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([self.left_padding + place[0][0], other.left_padding + place[1][0]])
        self._idx = idx

    def extract(self, idx):
        compact(self)
        return super().extract(idx)

    # NOTE: merge and finalize give mlx-lm's arrays bit for bit (a contract test compares them) but
    # move data with contiguous slices and concatenations only. mlx-lm's merge writes row by row into
    # a zero buffer and its finalize rolls with take_along_axis over broadcast indices; on an H200
    # the roll of an 18-row cohort on a 2.2k-token prefix took 236 ms and the merge 41 ms of one
    # iteration (scripts/cohort_cost.py), while the forward itself took 114 ms.
    @classmethod
    def merge(cls, caches, room: int = 0):
        """``room``: free positions after the rows' ends, so a cohort's forward of up to that many tokens writes
        in place (mlx-lm's merge leaves none, and its first update then copies the whole buffer to grow it)."""
        lengths = [c.size() for c in caches]
        width = max(lengths)
        if width == 0:
            return cls([0] * len(caches))
        ref = next(c for c in caches if c.keys is not None and c.size() > 0)
        _, H, _, Dk = ref.keys.shape
        Dv, dt = ref.values.shape[3], ref.keys.dtype
        if room > 0:  # one zero buffer, every row written into it at its place (one pass over the rows)
            held = [(i, width - n, c) for i, (n, c) in enumerate(zip(lengths, caches)) if c.keys is not None and n > 0]
            cache = cls([width - n for n in lengths])
            cache.keys = _placed(len(caches), width + room, [(i, p, c.keys[..., :width - p, :]) for i, p, c in held])
            cache.values = _placed(len(caches), width + room, [(i, p, c.values[..., :width - p, :]) for i, p, c in held])
            cache.offset += width
            cache._idx = width
            return cache

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


def _placed(rows: int, size: int, parts: list) -> mx.array:
    """A zero [rows, H, size, D] buffer with each ``(first_row, position, block)`` of ``parts`` written at its row
    and sequence position: every block copied once (where mlx-lm pads blocks, a copy, then concatenates them)."""
    ref = parts[0][2]
    out = mx.zeros((rows, ref.shape[1], size, ref.shape[3]), dtype=ref.dtype)
    for lo, at, block in parts:
        out[lo:lo + block.shape[0], :, at:at + block.shape[2]] = block
    return out


def roll_rows(x: mx.array, shifts: list[int]) -> mx.array:
    """``mlx_lm.models.cache.dynamic_roll(x, shifts[:, None], axis=2)`` for a [B, H, N, D] array with
    host-side shifts: each row rolled right by its shift along the sequence axis. Rows with equal shifts
    in a run move together; with several runs, each run's two parts are written into one new buffer (every
    element copied once, two slice updates a run) where concatenating each run and then the runs copied
    everything twice in three ops a run: an H100 cohort of 6-9 rows took 19-143 ms rolling its 64 arrays
    (stop 65 trace)."""
    n = x.shape[2]
    runs, i = [], 0
    while i < len(shifts):
        j = i
        while j < len(shifts) and shifts[j] == shifts[i]:
            j += 1
        runs.append((i, j, shifts[i] % n))
        i = j
    if len(runs) == 1:
        s = runs[0][2]
        return mx.concatenate([x[:, :, n - s:], x[:, :, :n - s]], axis=2) if s else x
    out = mx.zeros(x.shape, dtype=x.dtype)
    for i, j, s in runs:
        if s == 0:
            out[i:j] = x[i:j]
            continue
        out[i:j, :, s:] = x[i:j, :, :n - s]
        out[i:j, :, :s] = x[i:j, :, n - s:]
    return out
