"""The prompt cache under ``--tp``: rank 0 decides, every rank keeps its own shard of each entry.

Rank 0's ``PromptCache`` (``MirroredPromptCache``) makes every decision: lookups, LRU, the budget,
memory pressure. Each entry it stores gets an id, and the other ranks are told, in the words of the
next message (``mlxb.engine.tp``), where their copy of the same snapshot comes from and when to drop it:

* ``PUT id src index tokens``: snapshot single-row caches of this rank into entry ``id``. The source
  is a row's prefill caches (``SRC_ROW``, its key: a chunk-boundary snapshot), a cohort row extracted
  during the last cohort prefill (``SRC_COHORT``: followers extract every cohort row when rank 0
  announces snapshots) or a finishing row extracted before the filter that retires it
  (``SRC_EXTRACT``, after ``EXTRACT``). A full-attention source holding more than ``tokens`` is
  trimmed first, as rank 0 trims a finished row's lookahead token.
* ``SEED key id n``: a new row starts from entry ``id``'s first ``n`` tokens (``lend``).
* ``FREE id``: the entry left rank 0's index (eviction, a longer entry covering it, a reset); sent with
  the next decode step, because rank 0 may still lend from it in the iteration it left.

Only the RAM tier is mirrored: the SSD tier is off under ``--tp``.
"""

from __future__ import annotations

import mlx.core as mx

from mlxb.cache import snapshot as snap
from mlxb.cache.prompt_cache import PromptCache
from mlxb.engine.tp import PUT

SRC_ROW, SRC_COHORT, SRC_EXTRACT = range(3)


class MirroredPromptCache(PromptCache):
    """Rank 0's prompt cache under ``--tp``; ``runner`` (the ``TPRunner``) carries the words."""

    def __init__(self, *args, runner, **kw):
        kw["disk_dir"], kw["disk_bytes"] = None, 0
        super().__init__(*args, **kw)
        self.runner = runner
        self._next = 0
        self.ram.on_remove = self._removed

    def _probe_shapes(self, model) -> list:
        # NOTE: no probe forward here: on rank 0 alone its all_sums would pair with the other ranks'
        # message collectives and the ranks would fall out of step. The shapes only check files read
        # back from the SSD tier, which is off under --tp.
        return []

    def put(self, tokens, layers: list, *, copy: bool = True, adapter: int = -1):
        src = self.runner.cache_source(layers)
        entry = super().put(tokens, layers, copy=copy, adapter=adapter)
        if entry is not None and getattr(entry, "tp_id", None) is None:
            if src is None:
                raise RuntimeError("a prompt-cache snapshot whose source the other ranks cannot name")
            entry.tp_id = self._next
            self._next += 1
            self.runner.queue_cache_op(PUT, entry.tp_id, *src, len(entry.tokens))
            if entry not in self.ram:  # larger than the RAM tier: usable by this iteration only
                self.runner.queue_cache_free_later(entry.tp_id)
        return entry

    def _removed(self, entry) -> None:
        # NOTE: freed with the iteration's decode step, not now: rank 0 may still lend from an entry
        # that left the index this iteration (held since admission, or a leader's fresh snapshot)
        if getattr(entry, "tp_id", None) is not None:
            self.runner.queue_cache_free_later(entry.tp_id)


class FollowerStore:
    """A follower's copies of rank 0's entries (its shard of each), by id."""

    def __init__(self, kinds: list):
        self.kinds = list(kinds)
        self.entries: dict[int, list] = {}
        self.cohort: dict[int, list] = {}  # cohort row index -> its caches, from the last cohort prefill
        self.extracted: list = []  # the last EXTRACT's single-row caches

    def put(self, eid: int, src: int, index: int, tokens: int, rows: dict) -> None:
        layers = (rows[index].solo if src == SRC_ROW else self.cohort[index] if src == SRC_COHORT
                  else self.extracted[index])
        for c, k in zip(layers, self.kinds):
            if k in ("full", "latent") and c.offset > tokens:
                c.trim(c.offset - tokens)
        copy = [snap.snapshot(c, k) for c, k in zip(layers, self.kinds)]
        mx.eval([snap.arrays(c) for c in copy])
        self.entries[eid] = copy

    def lend(self, eid: int, n: int) -> list:
        return [snap.lend(c, k, n if k in ("full", "latent") else None) for c, k in zip(self.entries[eid], self.kinds)]
