"""The prompt cache on the engine thread: what the engine asks of it, in one place.

The scheduler sees token counts only (``lookup`` is its admission callback); everything that
touches cache arrays happens here, on the engine thread, inside the device lock:

* ``lookup`` at admission: the longest usable cached prefix; the entry is held until the row seeds.
* ``seed`` a row's first chunk: single-row caches lent from that entry, or from a leader's snapshot
  taken earlier in the same iteration (``fresh``).
* ``boundary_snapshot`` / ``cohort_snapshot`` during prefill, ``put_finished`` when a row ends.
* ``respect_budget`` after every insert: live rows + entries within ``--kv-budget``, device memory
  under the cache's pressure limit. ``after_device_error``: a failed forward gives RAM-tier memory back
  (least recently used first; all of it when the failure repeats).
* ``serial_prefill``: the ``--batch 1`` path through the same cache, with the same snapshots.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlxb.cache.prefix import PrefixMatch
from mlxb.cache.allocator import clear_pool, trim_allocator_cache
from mlxb.engine.scheduler import chunk_end
from mlxb.request import Request, RequestStatus


class PrefixReuse:
    def __init__(self, engine):
        self.engine = engine
        self.cache = None  # mlxb.cache.prompt_cache.PromptCache, or None: off
        self.hits: dict = {}  # request id -> PrefixMatch found at admission (held until the row seeds)
        self.fresh: dict = {}  # prompt prefix -> entry snapshotted this iteration (followers read it)

    def attach(self, cache) -> None:
        self.cache = cache
        self.engine.scheduler.prefix_lookup = self.lookup if cache is not None else None

    def end_iteration(self) -> None:
        self.hits.clear()
        self.fresh.clear()

    def prefetch(self, req: Request) -> None:
        """On the submitting thread, as a request arrives: the SSD tier checks the file its lookup may restore
        ahead of admission, so the engine thread does not hash it while every running row waits."""
        pc = self.cache
        if pc is not None and req.cache_prompt and req.num_prompt_tokens > 1:  # (no SSD tier: nothing to do)
            pc.prefetch(req.prompt_ids, req.num_prompt_tokens - 1, req.adapter)

    # ---- scheduler callbacks (token counts and bytes only) -----------------------------------
    def nbytes(self) -> int:
        return self.cache.nbytes if self.cache is not None else 0

    def evict(self, num_bytes: int) -> int:
        return self.cache.evict(num_bytes) if self.cache is not None else 0

    def lookup(self, req: Request) -> int:
        """Cached prompt tokens usable by ``req`` (at most all but the last); held until seeded."""
        body = req.num_prompt_tokens - 1
        m = self.cache.lookup(req.prompt_ids, body, req.adapter)
        hit = 0 if m is None else m.num_tokens
        self.mark_shared(req, hit)
        if m is None:
            return 0
        self.hits[req.request_id] = m
        return hit

    def mark_shared(self, req: Request, hit: int) -> None:
        """Exact snapshots only (recurrent or sliding-window layers): where this prompt leaves the cached
        prompts it shares a prefix with, beyond the snapshot it hit, its prefill ends a chunk and snapshots,
        so the next prompt with that prefix (agents with one system prompt) starts from there."""
        body, least = req.num_prompt_tokens - 1, self.engine.scheduler.min_shared
        if self.cache.trimmable or body - hit < least:  # no room for a mark: skip the trie walk (5 ms at 32k tokens)
            return
        shared = self.cache.shared_prefix(req.prompt_ids, body, req.adapter)
        if shared - hit >= least:
            req.snapshot_at = sorted({*req.snapshot_at, shared})

    # ---- rows --------------------------------------------------------------------------------
    def seed(self, req: Request, n: int) -> list:
        """Single-row caches holding ``req``'s first ``n`` prompt tokens, lent from the cache."""
        entry = self.fresh.get(tuple(req.prompt_ids[:n]))
        if entry is None:
            m = self.hits.get(req.request_id)
            assert m is not None and m.num_tokens >= n, (req.request_id, n)
            entry = m.entry
        n_eff = n - 1 if "prefix_off_by_one" in self.engine.runner.faults else n  # planted bug (parity control)
        mirror = getattr(self.engine.runner, "mirror_seed", None)  # --tp: the other ranks seed from their copy
        if mirror is not None:
            mirror(req, entry, n_eff)
        return self.cache.lend(PrefixMatch(entry, n_eff))

    def boundary_snapshot(self, row, chunk) -> None:
        """Snapshot a solo prefill at its chunk end where a later row can reuse it: every boundary
        for exact-only kinds, the prompt body (len - 1) and shared split points for all."""
        pc = self.cache
        if pc is None or not row.req.cache_prompt or chunk.end <= 0:
            return
        if pc.trimmable and not (chunk.is_last or chunk.shared):
            return
        key = tuple(row.req.prompt_ids[:chunk.end])
        entry = pc.put(key, self.engine.runner.whole(row), adapter=row.req.adapter)
        pc.counters["mark_snapshots"] += chunk.end in row.req.snapshot_at
        if chunk.shared:
            self.fresh[key] = entry
        self.respect_budget()

    def cohort_snapshot(self, rows: list):
        """Exact-only models: each cohort row's ``len(prompt) - 1`` snapshot, extracted from the batch
        (a repeat of the prompt hits it). Trimmable models skip the copy: the row's finish stores
        prompt + output, which serves every shorter prefix."""
        pc = self.cache
        if pc is None or pc.trimmable:
            return None

        def put(i: int, layers: list) -> None:
            if rows[i].req.cache_prompt and rows[i].req.num_prompt_tokens > 1:
                pc.put(rows[i].req.prompt_ids[:-1], layers, adapter=rows[i].req.adapter)
                self.respect_budget()

        return put

    def keeps(self, req: Request, status: Optional[RequestStatus]) -> bool:
        """A finished row goes back to the cache (it is on, the request allows it, it ended normally)."""
        return (self.cache is not None and req.cache_prompt
                and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH))

    def put_finished(self, tokens: list, layers: list, fed: int, adapter: int = -1) -> None:
        """Store a finished row's caches under the tokens they hold (prompt + fed output)."""
        self.put_finished_many([(tokens, layers, fed, adapter)])

    def put_finished_many(self, rows: list) -> None:
        """``put_finished`` for every ``(tokens, layers, fed, adapter)`` of rows that ended on one step,
        evaluated together (``PromptCache.put_many``)."""
        pc, items = self.cache, []
        for tokens, layers, fed, adapter in rows:
            if fed > len(tokens):  # a lookahead token we never read: trim it where the kinds allow
                if not pc.trimmable:
                    continue
                for c in layers:
                    c.trim(fed - len(tokens))
                fed = len(tokens)
            items.append((tokens[:fed], layers, adapter))
        if items:
            pc.put_many(items)
            self.respect_budget()

    # ---- memory ------------------------------------------------------------------------------
    def respect_budget(self) -> None:
        s = self.engine.scheduler
        if s.kv_budget is not None:
            over = s.used_bytes + self.cache.nbytes - s.kv_budget
            if over > 0:
                self.cache.evict(over)
        self.cache.relieve_pressure()

    def after_device_error(self, e: Exception, need: int = 0, whole: bool = False) -> None:
        """A failed forward (often out of memory): MLX's cached free buffers go back, then cached prefixes give
        memory back, least recently used first, so the next attempt runs instead of failing the same way: at
        least twice ``need`` (the failed rows' projected KV bytes) and a quarter of the RAM tier, or the whole
        tier when ``whole`` (a repeated failure, a failed decode step). Emptying the tier on the first failure
        dropped a 32-agent fleet's every conversation at once (H100, stop 59: the next turns prefilled ~950
        tokens each instead of ~150, p95 TTFT 6.5 s), and most of it never reached the SSD tier."""
        clear_pool()
        if self.cache is not None and "memory" in str(e).lower():
            tier = self.cache.nbytes
            self.cache.evict(tier if whole else min(tier, max(2 * need, tier // 4)))

    # ---- the serial path ---------------------------------------------------------------------
    def serial_prefill(self, req: Request, row) -> tuple[list, int]:
        """``--batch 1`` prefill with the cache: start from the longest cached prefix, prefill the
        body in chunks with the same snapshots as the batch lane, hold back the last token for
        generate_step. A request with penalty processors does not reuse (mlx-lm's generate_step
        would see only the uncached suffix as their context), but still stores."""
        from mlx_lm.models.cache import make_prompt_cache

        eng, pc, ids = self.engine, self.cache, req.prompt_ids
        body = len(ids) - 1
        cache, pos = make_prompt_cache(eng.model), 0
        if not row.sampler.processors:
            m = pc.lookup(ids, body, req.adapter)
            if m is not None:
                cache, pos = pc.lend(m), m.num_tokens
                req.cached_tokens = pos
        self.mark_shared(req, pos)
        while pos < body:
            end = chunk_end(pos, min(pos + eng.prefill_chunk, body), req.snapshot_at)
            eng.runner.fwd([row], mx.array(ids[pos:end])[None], cache)
            mx.eval([c.state for c in cache])
            trim_allocator_cache()
            pos = end
            if not pc.trimmable or pos == body:
                pc.put(ids[:pos], cache, adapter=req.adapter)
                pc.counters["mark_snapshots"] += pos in req.snapshot_at
                self.respect_budget()
        return cache, body

    def stats(self) -> dict:
        if self.cache is None:
            return {"enabled": False}
        return {**self.cache.stats(), "shared_prefill_rows": self.engine.scheduler.num_shared}
