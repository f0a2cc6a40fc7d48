"""Which batch rows read one shared copy of a prompt prefix (``mlxb.cache.shared``), decided by the runner.

The batch has at most one live shared prefix (its token ids, ``P`` of them, one ``SharedPrefix`` per
full-attention layer). When rows join a batch of two or more rows:

* with a live prefix, a joiner whose prompt opens with its tokens (same LoRA adapter, a longer prompt)
  reads it: its caches drop those tokens *before* they join, so the batch never holds the copy;
* with none, the rows' prompts are planned (``plan``): the longest run of rows (same adapter) whose prompts
  share at least ``min_tokens`` leading tokens, scored by the bytes it saves, ``P x (sharers - 1)``; one
  sharer's first ``P`` cached tokens become the prefix (a copy), every sharer's own copy leaves the buffer;
* a live prefix that only one row still reads gives way to a plan that two or more new rows would share
  (its reader's history is made whole again first, a copy).

Sharing the prefix of one row with rows that computed it elsewhere substitutes bytes that agree to the
last bits, exactly as the prompt cache substitutes a cached prefix. The prefix is freed when the last row
that reads it leaves (a filter drops the layer's reference). Rows with quantized KV, sliding-window and
recurrent layers keep their copies; so does a lone row (its step is the serial graph).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlxb.cache.dense import AlignedBatchKVCache
from mlxb.cache.shared import SharedBatchKVCache, SharedPrefix, install, prefix_of

MIN_TOKENS = 256
# On GPU backends the cascade is several kernels per layer where MLX's fused attention over copies is one: on an
# H100 (synth-llama-8b bf16, reports/h200/session54) its first version was 0.63x of copies at 4 rows x 1k tokens
# and 0.64x at 8 x 2k (7 x 2k = 14k row-tokens saved), 1.20x at 16 x 4k (60k saved) and 1.40x at 32 x 6k (190k).
# So a new prefix there must save at least this many row-tokens, (rows - 1) x P; on the CPU, where MLX's attention
# is the same unfused path, any saving counts. MLXB_SHARE_MIN_SAVED overrides it.
GPU_MIN_SAVED = 49152


def min_saved_default() -> int:
    import os

    env = os.environ.get("MLXB_SHARE_MIN_SAVED")
    if env is not None:
        return max(0, int(env))
    return 0 if mx.default_device() == mx.cpu else GPU_MIN_SAVED


def _dropped(solo: KVCache, n: int) -> KVCache:
    """A single-row cache holding ``solo``'s tokens after its first ``n`` (views; positions are the caller's)."""
    c = KVCache()
    if solo.offset > n:
        c.keys, c.values = solo.keys[..., n:solo.offset, :], solo.values[..., n:solo.offset, :]
        c.offset = solo.offset - n
    return c


def common_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    d = np.flatnonzero(a[:n] != b[:n])
    return int(d[0]) if d.size else n


def plan(prompts: list, adapters: list, min_tokens: int, min_saved: int = 0) -> tuple[int, list[int]]:
    """(P, rows): the prefix length and the rows (indices, two or more) that should share it, or (0, []).
    ``prompts[i]``: row i's shareable token ids (its prompt less the last token, which it must hold); a plan
    must save at least ``min_saved`` row-tokens, P x (rows - 1)."""
    order = sorted(range(len(prompts)), key=lambda i: (str(adapters[i]), prompts[i].tolist()))
    lcp = [common_length(prompts[a], prompts[b]) if adapters[a] == adapters[b] else 0
           for a, b in zip(order, order[1:])]
    best = (0, 0, [])  # saving, P, rows
    for t in sorted({v for v in lcp if v >= min_tokens}):
        i = 0
        while i < len(lcp):  # runs of neighbours sharing at least t tokens
            if lcp[i] < t:
                i += 1
                continue
            j = i
            while j < len(lcp) and lcp[j] >= t:
                j += 1
            P = min(lcp[i:j])
            rows = order[i:j + 1]
            if P * (len(rows) - 1) > best[0] and P * (len(rows) - 1) >= min_saved:
                best = (P * (len(rows) - 1), P, sorted(rows))
            i = j
    return best[1], best[2]


class Sharing:
    """The runner's shared prefix: its tokens, the per-layer copies, and what it has done (``stats``)."""

    def __init__(self, kinds: list, min_tokens: int = MIN_TOKENS, offset_fault: int = 0,
                 min_saved: Optional[int] = None):
        self.layers = [i for i, k in enumerate(kinds) if k == "full"]
        self.min_tokens = max(1, min_tokens)
        self.min_saved = min_saved_default() if min_saved is None else min_saved
        # the engine sets this while requests wait for KV budget: then any saving counts (the memory a prefix saves
        # admits rows, which outweighs the cascade's cost on GPU backends below ``min_saved``), and a new prefix
        # of a half-precision model keeps no float32 copy of its values (``SharedPrefix.keep_f32``)
        self.pressure = False
        # a float32 copy of a new prefix's values (half-precision models): False never (the prefix is stored once;
        # the cascade casts its values each step), None while memory does not bind (serve --share-f32-values:
        # a faster step, the prefix's values held twice), True always
        self.values32: Optional[bool] = False
        self.offset_fault = offset_fault  # parity negative control only
        self.seed_fault = False  # parity negative control only: a live-seeded joiner's positions lack the prefix
        self._tokens: Optional[np.ndarray] = None
        self.version = 0  # changes whenever the live prefix does (admission charges rows again)
        self.adapter = None
        self.prefixes: Optional[list] = None  # per shared layer
        self.counts = {"prefixes": 0, "rows_shared": 0, "unshared": 0, "cohorts": 0, "live_seeds": 0}
        self.cohort: Optional[tuple] = None  # (tokens, adapter, prefixes) of a cohort prefilled sharing, until it joins
        install()

    @property
    def keep_f32(self) -> bool:
        return not self.pressure if self.values32 is None else self.values32

    @property
    def saving_floor(self) -> int:
        """Row-tokens a new prefix must save: ``min_saved``, or any saving while admission waits for memory."""
        return 0 if self.pressure else self.min_saved

    @property
    def tokens(self) -> Optional[np.ndarray]:
        return self._tokens

    @tokens.setter
    def tokens(self, value: Optional[np.ndarray]) -> None:
        if value is not self._tokens:
            self.version += 1
        self._tokens = value

    @property
    def live(self) -> bool:
        return self._tokens is not None

    def _wrap(self, caches: list) -> list:
        out = list(caches)
        for i in self.layers:
            c = out[i]
            if type(c) is AlignedBatchKVCache:
                out[i] = SharedBatchKVCache.wrap(c)
                out[i].offset_fault = self.offset_fault
        return out

    def usable(self, caches: list) -> bool:
        return all(isinstance(caches[i], AlignedBatchKVCache) for i in self.layers) and bool(self.layers)

    @staticmethod
    def _body(row) -> np.ndarray:
        ids = row.req.prompt_ids
        return np.asarray(ids[:-1], dtype=np.int64)

    def _matches(self, row) -> bool:
        return self.covers(row.req) > 0

    def covers(self, req) -> int:
        """Prompt tokens of ``req`` the live prefix would serve (admission charges the rest)."""
        if not self.live:
            return 0
        P = self.tokens.size
        ids = req.prompt_ids
        if req.adapter != self.adapter or len(ids) <= P or not np.array_equal(np.asarray(ids[:P]), self.tokens):
            return 0
        return P

    def prefix_bytes(self, caches: Optional[list]) -> int:
        return sum(c.shared_bytes for c in caches or [] if isinstance(c, SharedBatchKVCache))

    def refresh(self, rows: list) -> None:
        """After a filter: the prefix is gone once no row reads it."""
        if self.live and not any(r.shared for r in rows):
            self.tokens, self.prefixes, self.adapter = None, None, None

    def before_join(self, old_rows: list, old: Optional[list], new_rows: list, new: list) -> tuple:
        """Share what can be shared between the batch (``old_rows`` on ``old`` caches, None when the new
        rows become the batch) and the joining rows on ``new`` (batch caches). Returns (old, new) caches."""
        if not self.usable(new) or (old is not None and not self.usable(old)):
            return old, new
        new = self._wrap(new)
        old = self._wrap(old) if old is not None else None
        self.refresh(old_rows)
        cohort, self.cohort = self.cohort, None
        if any(r.shared for r in new_rows):  # a cohort that prefilled reading a prefix (``cohort_caches``)
            tokens, adapter, prefixes = cohort
            if self.live and prefixes is not self.prefixes:  # another prefix is live: the cohort's rows made whole
                new = [self._unshare(c) if i in self.layers else c for i, c in enumerate(new)]
                for r in new_rows:
                    r.shared = 0
                self.counts["unshared"] += 1
            elif not self.live:  # the cohort's prefix becomes the batch's
                self.tokens, self.adapter, self.prefixes = tokens, adapter, prefixes
                if old is not None:
                    self._share(old, old_rows, [j for j, r in enumerate(old_rows) if self._matches(r)])
        if self.live:
            take = [j for j, r in enumerate(new_rows) if not r.shared and self._matches(r)]
            readers = sum(1 for r in old_rows if r.shared) + sum(1 for r in new_rows if r.shared)
            if readers + len(take) >= 2:
                self._share(new, new_rows, take)
                return old, new
            if readers:  # one reader left: every row made whole, and a better plan may replace the prefix
                old = None if old is None else [self._unshare(c) if i in self.layers else c for i, c in enumerate(old)]
                new = [self._unshare(c) if i in self.layers else c for i, c in enumerate(new)]
                for r in list(old_rows) + list(new_rows):
                    r.shared = 0
                self.tokens, self.prefixes, self.adapter = None, None, None
                self.counts["unshared"] += 1
        rows = list(old_rows) + list(new_rows)
        P, picked = plan([self._body(r) for r in rows], [r.req.adapter for r in rows], self.min_tokens, self.saving_floor)
        if not picked:
            return old, new
        src = picked[0]
        caches = old if src < len(old_rows) else new
        at = src if src < len(old_rows) else src - len(old_rows)
        self.prefixes = [prefix_of(caches[i], at, P, keep_f32=self.keep_f32) for i in self.layers]
        self.tokens = self._body(rows[src])[:P].copy()
        self.adapter = rows[src].req.adapter
        self.counts["prefixes"] += 1
        if old is not None:
            self._share(old, old_rows, [i for i in picked if i < len(old_rows)])
        self._share(new, new_rows, [i - len(old_rows) for i in picked if i >= len(old_rows)])
        return old, new

    def cohort_caches(self, rows: list, starts: list[int], kinds: list, room: int = 0) -> Optional[list]:
        """A cohort about to prefill (rows whose solo caches hold ``starts[i]`` cached tokens): the batch caches
        with the rows that open alike reading one prefix (the live one where they open with it, else the longest
        worth sharing among their cached tokens), so its forward reads the prefix once and the merge copies only
        their own tokens. None: nothing to share (the caller merges copies as before)."""
        from mlxb.cache.protocol import ROW_OPS

        if self.live:
            P = self.tokens.size
            take = [i for i, r in enumerate(rows) if starts[i] >= P and self._matches(r)]
            prefixes, tokens, adapter = self.prefixes, self.tokens, self.adapter
        else:
            P, take = plan([np.asarray(r.req.prompt_ids[:s], dtype=np.int64) for r, s in zip(rows, starts)],
                           [r.req.adapter for r in rows], self.min_tokens, self.saving_floor)
            if len(take) < 2:
                return None
            src = rows[take[0]].solo
            prefixes = [SharedPrefix(mx.contiguous(src[i].keys[..., :P, :]), mx.contiguous(src[i].values[..., :P, :]),
                                     keep_f32=self.keep_f32) for i in self.layers]
            tokens, adapter = np.asarray(rows[take[0]].req.prompt_ids[:P], dtype=np.int64), rows[take[0]].req.adapter
        if not take or any(type(rows[i].solo[j]) is not KVCache for i in take for j in self.layers):
            return None
        flags = [i in take for i in range(len(rows))]
        caches = []
        for j, kind in enumerate(kinds):
            solos = [r.solo[j] for r in rows]
            if j not in self.layers:
                caches.append(ROW_OPS[kind].to_batch(solos, room=room))
                continue
            caches.append(self.reading([_dropped(s, P) if f else s for s, f in zip(solos, flags)], flags,
                                       prefixes[self.layers.index(j)], room=room))
        self.cohort = (tokens, adapter, prefixes)
        for i in take:
            rows[i].shared = P
        self.counts["rows_shared"] += len(take)
        self.counts["prefixes"] += 0 if self.live else 1
        self.counts["cohorts"] += 1
        return caches

    def reading(self, own: list, flags: list, prefix: SharedPrefix, room: int = 0) -> SharedBatchKVCache:
        """One shared batch layer over single-row caches ``own`` (each row's tokens after the prefix where its flag
        is set, its whole history otherwise): flagged rows read ``prefix``; positions stay the true ones."""
        c = AlignedBatchKVCache.merge(own, room=room) if any(o.size() for o in own) else AlignedBatchKVCache([0] * len(own))
        c = SharedBatchKVCache.wrap(c)
        c.offset = c.offset + mx.array([prefix.n - self.offset_fault if f else 0 for f in flags])
        c.share, c.prefix = list(flags), prefix
        c.offset_fault = self.offset_fault
        return c

    def ref(self) -> tuple:
        """The live prefix as (tokens, adapter, per-layer prefixes): what a joiner that reads it from its first
        prefill chunk keeps until it joins (``seed``), whatever becomes of the batch's prefix meanwhile."""
        return self.tokens, self.adapter, self.prefixes

    def seed(self, ref: tuple, lent: Optional[list], cohort: bool) -> list:
        """A joiner's single-row caches when its prefill starts at (or past) the live prefix ``ref`` without
        holding a copy of it. ``lent``: the prompt cache's caches of its first ``start`` tokens (start > P), or None
        (start == P). For a cohort (``cohort_caches`` merges them): plain caches whose first P tokens are the
        prefix's own arrays (references, no copy). Alone: one shared layer per layer, holding only tokens P..start
        and reading the prefix through its prefill, token 0 and its join."""
        tokens, _, prefixes = ref
        P = int(tokens.size)
        self.counts["live_seeds"] += 1
        if cohort:  # (Sharing.cohort_caches counts the rows it shares)
            if lent is not None:
                return lent
            out = []
            for p in prefixes:
                c = KVCache()
                c.keys, c.values, c.offset = p.keys, p.values, P
                out.append(c)
            return out
        self.counts["rows_shared"] += 1
        out = [self.reading([_dropped(lent[j], P) if lent is not None else KVCache()], [True], p)
               for j, p in zip(self.layers, prefixes)]
        if self.seed_fault:  # planted bug: RoPE positions count only the row's own tokens
            for c in out:
                c.offset = c.offset - P
        return out

    def _share(self, caches: list, rows: list, take: list[int]) -> None:
        if not take:
            return
        for i, p in zip(self.layers, self.prefixes):
            caches[i].share_rows(take, p)
        for j in take:
            rows[j].shared = self.tokens.size
        self.counts["rows_shared"] += len(take)
        mx.eval([a for i in self.layers for a in (caches[i].keys, caches[i].values)])

    @staticmethod
    def _unshare(c):
        if isinstance(c, SharedBatchKVCache) and c.sharing:
            return SharedBatchKVCache.wrap(c.unshare())
        return c

    def stats(self, caches: Optional[list], rows: list) -> dict:
        shared = self.prefix_bytes(caches)
        readers = sum(1 for r in rows if r.shared)
        return {
            "layers": len(self.layers),
            "prefix_tokens": int(self.tokens.size) if self.live else 0,
            "rows_sharing": readers,
            "min_saved_row_tokens": self.min_saved,
            "memory_bound": self.pressure,  # requests wait for KV budget: any saving counts for now
            "f32_values": {False: "never", None: "while memory allows", True: "always"}[self.values32],
            "shared_bytes": shared,
            "bytes_saved": shared * max(0, readers - 1),
            **self.counts,
        }


def sharing_off(share_min: Optional[int], kv_plan, join_full: str, kinds: list) -> Optional[str]:
    """Why this runner keeps every row's own copy of its prefix, or None when it shares."""
    if share_min is None:
        return "off (--no-share-prefix)"
    if "full" not in kinds:
        return "no full-attention layers (sliding-window, recurrent and latent layers keep their copies)"
    if kv_plan is not None:
        return "quantized KV (--kv-bits) keeps a copy per row"
    if join_full != "extend":
        return f"--join-full {join_full} re-merges every row at each join"
    return None


def probe(model, kinds: list) -> Optional[str]:
    """One decode step of two rows that share a prefix, through shared layers and through copies: None when
    this model's attention reads a shared layer and agrees, else why sharing stays off (attention computed
    by hand, as Gemma 2's softcapped scores, never reaches the dispatcher)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxb.cache.protocol import ROW_OPS, base_forward

    base_forward(model)
    P, rows = 6, [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 9, 8]]
    solos = []
    for ids in rows:
        c = make_prompt_cache(model)
        model(mx.array([ids]), cache=c)
        solos.append(c)
    out = []
    for share in (False, True):
        caches = [ROW_OPS[k].to_batch([s[i] for s in solos]) for i, k in enumerate(kinds)]
        if share:
            sh = Sharing(kinds)
            caches = sh._wrap(caches)
            for i in sh.layers:
                caches[i].share_rows([0, 1], prefix_of(caches[i], 1, P))
        try:
            out.append(model(mx.array([[10], [11]]), cache=caches)[:, -1].astype(mx.float32))
            mx.eval(out[-1])
        except Exception as e:
            return (f"this model's attention cannot read a shared layer ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:100]}); every row keeps its own copy")
    scale = mx.abs(out[0]).max().item() or 1.0
    err = mx.abs(out[0] - out[1]).max().item() / scale
    if not err <= 2e-2:
        return f"attention over a shared layer differs from attention over copies here ({err:.3g}, relative)"
    return None
