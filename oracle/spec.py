"""The ``spec`` case's reference: prompt-lookup proposals verified by mlx-lm's model at the same B.

The protocol (``mlxb.parity.protocol``, next to ``SPEC_HOLE_MIN``) fixes what each row proposes and how
a verify step is fed; this module is an independent implementation of it on mlx-lm's classes:

* ``lookup``: the n-gram rule, written out plainly (lists, no shared code with the engine's proposer);
* the verify forward is mlx-lm's model over ``[B, 1 + W]``; a row keeps its drafts while they equal
  the argmax, then the argmax;
* rollback: a lone row is mlx-lm's ``KVCache`` and ``trim``s its rejected tail; a batch layer is
  mlx-lm's ``BatchKVCache`` whose rejected entries stay in place as holes (``HBatch``): the row's
  ``offset`` (its RoPE position) goes back, its mask hides them, and before rows join or leave (and
  past the protocol's bound) each row's holes move into its left padding with one gather.

No mlxb engine code is imported here.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from mlxb.parity.protocol import SPEC_HOLE_FRACTION, SPEC_HOLE_MIN


def lookup(history: list[int], k: int, ngram: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the history's last n tokens (n = ngram down to
    1), preferring an occurrence followed by k tokens; [] when none."""
    n_hist = len(history)
    if k <= 0 or n_hist < 2:
        return []
    for n in range(min(ngram, n_hist - 1), 0, -1):
        tail = history[n_hist - n:]
        hits = [s for s in range(n_hist - n) if history[s : s + n] == tail]
        if hits:
            full = [s for s in hits if s + n + k <= n_hist]
            s = (full or hits)[-1] + n
            return history[s : s + k]
    return []


class HBatch(BatchKVCache):
    """mlx-lm's ``BatchKVCache`` with rejected speculative entries kept as masked holes."""

    holes = None  # numpy bool [B, width] or None
    counts = None  # holes per row

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        mask = super().make_mask(N, return_array=return_array or self.holes is not None, **kwargs)
        if self.holes is None:
            return mask
        T = mask.shape[-1]
        h = np.zeros((self.holes.shape[0], T), dtype=bool)
        w = min(T, self.holes.shape[1])
        h[:, :w] = self.holes[:, :w]
        return mask & ~mx.array(h)[:, None, None, :]

    def mark(self, shifts: list[int]) -> None:
        """Row i's last ``shifts[i]`` written entries become holes; its position goes back by as many."""
        width = self._idx
        h = np.zeros((len(shifts), width), dtype=bool)
        if self.holes is not None:
            w = min(width, self.holes.shape[1])
            h[:, :w] = self.holes[:, :w]
        for i, s in enumerate(shifts):
            h[i, width - s : width] = s > 0
        self.holes = h
        self.offset = self.offset - mx.array(shifts)
        self.counts = [a + b for a, b in zip(self.counts or [0] * len(shifts), shifts)]

    def compact(self) -> None:
        if self.holes is None:
            return
        T = self._idx
        holes = np.zeros((self.holes.shape[0], T), dtype=bool)
        holes[:, : min(T, self.holes.shape[1])] = self.holes[:, :T]
        self.holes = holes
        order = np.stack([np.concatenate([np.flatnonzero(r), np.flatnonzero(~r)]) for r in holes])
        ix = mx.array(order.astype(np.int32))[:, None, :, None]
        self.keys[..., :T, :] = mx.take_along_axis(self.keys[..., :T, :], ix, axis=2)
        self.values[..., :T, :] = mx.take_along_axis(self.values[..., :T, :], ix, axis=2)
        self.left_padding = self.left_padding + mx.array(holes.sum(axis=1).astype(np.int32))
        self.holes, self.counts = None, None

    def filter(self, batch_indices):
        self.compact()
        super().filter(batch_indices)

    def extend(self, other):
        self.compact()
        if isinstance(other, HBatch):
            other.compact()
        super().extend(other)

    def extract(self, idx):
        self.compact()
        return super().extract(idx)


def proposals(case, batch: list[int], history, produced: dict) -> list[list[int]]:
    """Each batch row's drafts this iteration ([] for rows that do not speculate or may not draft)."""
    out = []
    for r in batch:
        k = min(case.spec["rows"][r], case.rows[r].max_tokens - produced[r] - 1)
        out.append(lookup(history(r), k, case.spec["ngram"]) if k > 0 else [])
    return out


def verify(model, caches: list, merged: bool, last: list[int], props: list[list[int]]):
    """One verify forward; returns (log-softmax [B, 1 + W, V], argmax rows as lists, kept drafts per row).
    The caller records, then calls ``rollback``."""
    width = max(len(p) for p in props)
    fed = [[t] + p + [t] * (width - len(p)) for t, p in zip(last, props)]
    if merged:
        for c in caches:
            if type(c) is BatchKVCache:
                c.__class__ = HBatch
    logits = model(mx.array(fed, dtype=mx.uint32), cache=caches)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    choice = mx.argmax(lp, axis=-1)
    mx.eval(choice, lp)
    choice = choice.tolist()
    kept = []
    for p, c in zip(props, choice):
        a = 0
        while a < len(p) and p[a] == c[a]:
            a += 1
        kept.append(a)
    return lp, choice, kept, width


def rollback(caches: list, merged: bool, shifts: list[int]) -> None:
    if not any(shifts):
        return
    if not merged:
        for c in caches:
            c.trim(shifts[0])
        return
    for c in caches:
        c.mark(shifts)
    c0 = caches[0]
    if max(c0.counts) > max(SPEC_HOLE_MIN, c0._idx // SPEC_HOLE_FRACTION):
        for c in caches:
            c.compact()
