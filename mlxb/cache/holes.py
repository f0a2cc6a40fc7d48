"""Rejected speculative entries as masked holes in a left-padded batch layer (no data moves per step).

A verify step writes 1 + W entries per row; row i keeps 1 + a_i of them. Moving each row right by its
rejected count would copy the whole cache every step (and, with rows of different counts, run many
small copies per layer). Instead the rejected entries stay where they are and become *holes*:

* ``holes`` is a [B, width] boolean array on the layer (None when there are none), True where a
  column of that row is a rejected entry; the attention mask hides those columns (masked keys add
  exact zeros), on top of the causal and left-padding mask;
* the row's ``offset`` (its RoPE position) goes back by the rejected count, so the tokens it writes
  next get the positions they would have had without the rejected ones;
* ``compact`` moves every row's holes to its left padding in one gather per array (holes first,
  then the row's columns in order); row operations that hand rows elsewhere (filter, extend,
  extract) compact first, and the verify step compacts when a row's holes pass a bound
  (``hole_counts``, kept on the host); before plain steps, adaptive speculation compacts with ``trim``,
  which also drops the padding every row then shares.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np


def _arrays(c) -> list:
    if c.keys is None:
        return []
    return list(c.keys) + list(c.values) if isinstance(c.keys, tuple) else [c.keys, c.values]


def new_holes(shifts: list[int]) -> tuple[mx.array, mx.array]:
    """The [B, max(shifts)] hole columns and the offset decrement for ``shifts`` (built once per step,
    shared by every layer)."""
    S = max(shifts)
    return mx.array(np.arange(S)[None, :] >= (S - np.asarray(shifts))[:, None]), mx.array(shifts)


def mark_holes(c, shifts: list[int], made: Optional[tuple] = None) -> None:
    """Row i's last ``shifts[i]`` written entries become holes; its offset goes back by as many."""
    S = max(shifts)
    if S == 0 or c.keys is None:
        return
    width = c._idx
    new, dec = made or new_holes(shifts)
    old = c.holes
    if old is None:
        old = mx.zeros((len(shifts), width - S), dtype=mx.bool_)
    elif old.shape[1] >= width - S:
        tail = old[:, width - S : width]
        if tail.shape[1] < S:
            tail = mx.concatenate([tail, mx.zeros((len(shifts), S - tail.shape[1]), dtype=mx.bool_)], axis=1)
        new = new | tail
        old = old[:, : width - S]
    else:
        old = mx.concatenate([old, mx.zeros((len(shifts), width - S - old.shape[1]), dtype=mx.bool_)], axis=1)
    c.holes = mx.concatenate([old, new], axis=1)
    c.offset = c.offset - dec
    counts = getattr(c, "hole_counts", None) or [0] * len(shifts)
    c.hole_counts = [h + s for h, s in zip(counts, shifts)]


def unholed(c, mask: mx.array) -> mx.array:
    """``mask`` ([B, 1, N, T] booleans) with the layer's holes hidden."""
    h = c.holes
    T = mask.shape[-1]
    if h.shape[1] < T:
        h = mx.concatenate([h, mx.zeros((h.shape[0], T - h.shape[1]), dtype=mx.bool_)], axis=1)
    return mask & ~h[:, None, None, :T]


def compaction(c, trim: bool = False) -> tuple[mx.array, mx.array, int]:
    """(gather index [B, 1, T - m, 1]: each row's holes first, then its columns in order; holes per row;
    m), read from ``c``'s holes (one host read). ``trim``: m is the padding every row has once its holes
    join it (also a host read), dropped from the front, so that a batch whose rows all rejected as many
    entries is unpadded (aligned) again; else 0. Layers that took the same steps share it."""
    T = c._idx
    h = np.array(c.holes[:, :T])
    if h.shape[1] < T:
        h = np.concatenate([h, np.zeros((h.shape[0], T - h.shape[1]), dtype=bool)], axis=1)
    counts = h.sum(axis=1)
    m = int((np.array(c.left_padding) + counts).min()) if trim else 0
    cols = np.arange(T)
    order = np.stack([np.concatenate([cols[r], cols[~r]])[m:] for r in h]).astype(np.int32)
    return mx.array(order)[:, None, :, None], mx.array(counts.astype(np.int32)), m


def compact(c, plan: Optional[tuple] = None) -> None:
    """Move every row's holes to its left padding (one gather per array); no holes afterwards.
    ``plan``: a ``compaction`` already read from a layer with the same holes (with ``trim``, the
    padding all rows share leaves the buffer: the same gather writes ``m`` columns fewer)."""
    if getattr(c, "holes", None) is None:
        return
    ix, counts, m = plan or compaction(c)
    T = c._idx
    n = T - m
    for a in _arrays(c):
        a[..., :n, :] = mx.take_along_axis(a[..., :T, :], ix, axis=2)
    c.left_padding = c.left_padding + counts - m
    c._idx = n
    c.holes, c.hole_counts = None, None
