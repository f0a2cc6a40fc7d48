"""Joiner prefill on the engine thread: a row's chunk alone, a cohort of whole prompts, and what a
failed prefill does (out of device memory: requeue; anything else: fail only those rows).

Functions of the engine (``eng``): they use its runner, scheduler, prompt-cache glue, delivery and
trace, and run inside an iteration under the device lock.
"""

from __future__ import annotations

import time

from mlxb.errors import EngineFailure
from mlxb.request import RequestStatus

MAX_REQUEUES = 2  # out-of-memory prefills a request may retry before it fails
# A cohort's forward is right-padded to its longest uncached body, so every row pays for the longest one. In an
# agent loop the turns that arrive together fall into a few lengths (a turn whose cached conversation ends
# before the last reply prefills that reply again: ~280 tokens against ~150 for the others); on an H100 the
# cohort's cost followed its padded tokens (~150 ms per 1k at a 2-3k-token context, trace of stop 61). A cohort
# is split by length when that saves at least this many padded tokens (each extra group costs one more
# held-back-token step and one more join); 0 keeps one cohort, as mlx-lm's prompt batch does.
COHORT_SPLIT_MIN = 1024
MAX_GROUPS = 3


def split_by_length(lengths: list[int], min_saved: int, max_groups: int = MAX_GROUPS) -> list[list[int]]:
    """Indices into ``lengths`` (uncached body lengths of a cohort's rows) in groups to prefill one after
    another: one group (every index, in order) unless a split saves at least ``min_saved`` padded tokens
    (rows x longest body, summed over groups). Split groups hold rows of similar length, shortest first."""
    n = len(lengths)
    if min_saved <= 0 or n < 2:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: lengths[i])  # stable: equal lengths keep their arrival order
    groups = [order]
    while len(groups) < max_groups:
        best = None  # (saved, group, cut)
        for gi, g in enumerate(groups):
            whole = len(g) * lengths[g[-1]]
            for k in range(1, len(g)):
                saved = whole - k * lengths[g[k - 1]] - (len(g) - k) * lengths[g[-1]]
                if best is None or saved > best[0]:
                    best = (saved, gi, k)
        if best is None or best[0] < min_saved:
            break
        _, gi, k = best
        groups[gi:gi + 1] = [groups[gi][:k], groups[gi][k:]]
    if len(groups) == 1:
        return [list(range(n))]
    return [sorted(g) for g in groups]


def is_out_of_memory(e: BaseException) -> bool:
    """MLX raises RuntimeError with the allocator's message ("out of memory", cudaMalloc...)."""
    msg = str(e).lower()
    return "out of memory" in msg or "outofmemory" in msg or "insufficient memory" in msg


def prefill_failed(eng, failed: list, e: Exception) -> None:
    """Out of device memory (often transient: cached prefixes, allocator buffers, or another
    process on the device): free what the engine holds and put the rows back at the head of
    the queue, up to ``MAX_REQUEUES`` times each, instead of failing them. Rows of the same
    iteration that fail after it (a follower whose leader was requeued) go back too. Any other
    error fails only these rows."""
    oom = is_out_of_memory(e) or eng._requeued_this_iteration
    if not oom:  # out of memory is the rows' size against what is free, handled here by requeueing
        eng.device_health.failed(e)
    if not eng._requeued_this_iteration:  # memory errors: MLX's cache, then prompt-cache entries, LRU first
        need = sum(eng.scheduler.projected_bytes(live.req) for _, live in failed)
        eng.reuse.after_device_error(e, need, whole=any(live.req.requeues > 0 for _, live in failed))
    for chunk, live in failed:
        if oom and live.req.requeues < MAX_REQUEUES:
            live.req.requeues += 1
            live.row = None
            eng.scheduler.requeue(chunk.request_id)
            eng.counters["requeued"] += 1
            eng._requeued_this_iteration = True
            continue
        eng.scheduler.on_finished(chunk.request_id, RequestStatus.FINISHED_ERROR)
        eng.delivery.finish(live, RequestStatus.FINISHED_ERROR, error=EngineFailure(f"prefill failed: {e}"))

def token0_event(eng, req, cohort: int) -> None:
    """Trace (``MLXB_TRACE``) where a request's time to its first token went on the engine side."""
    if eng.trace.on:
        t = req.timings
        eng.trace.event("token0", prompt=req.num_prompt_tokens, cached=req.cached_tokens, cohort=cohort,
                        wait_ms=round(1000 * (t.admitted - t.submitted), 2),
                        prefill_ms=round(1000 * (t.prefill_done - t.admitted), 2))


def seed(eng, row, start: int, cohort: bool) -> None:
    """A joiner's caches before its first chunk: its cached prefix lent by the prompt cache (``start`` tokens),
    or, when it was admitted to read the live shared prefix (``req.reads_prefix``), that prefix without a copy
    plus whatever the prompt cache holds past it."""
    P = row.req.reads_prefix
    if P:
        eng.runner.seed(row, eng.reuse.seed(row.req, start) if start > P else None, cohort)
    elif start > 0:
        row.solo = eng.reuse.seed(row.req, start)


def prefill_one(eng, chunk) -> None:
    """One joiner's prefill chunk alone; its last chunk samples token 0 and joins the batch."""
    live = eng._live[chunk.request_id]
    row = live.row
    try:
        if not row.seeded:
            seed(eng, row, chunk.start, cohort=False)
            row.seeded = True
        eng.runner.prefill_chunk(row, chunk.start, chunk.end, chunk.is_last)
        eng.trace.mark("chunk")
        eng.scheduler.on_prefill_chunk(chunk)
        eng.reuse.boundary_snapshot(row, chunk)
        eng.trace.mark("snapshot")
        if not chunk.is_last:
            return
        em = eng.runner.first_token(row)
        eng.trace.mark("token0")
    except Exception as e:  # a prefill error rejects only the joiner (or requeues it: memory)
        prefill_failed(eng, [(chunk, live)], e)
        return
    live.req.timings.prefill_done = time.perf_counter()
    token0_event(eng, live.req, cohort=1)
    status = eng.delivery.deliver(em)
    if status is None:
        eng.runner.join(row, em.token)
        eng.scheduler.on_joined(chunk.request_id)
        eng.trace.mark("join")
    else:  # finished at token 0: never joins
        if eng.reuse.keeps(row.req, status):
            eng.reuse.put_finished(row.req.prompt_ids, eng.runner.whole(row), row.req.num_prompt_tokens, row.req.adapter)
        eng.scheduler.on_finished(chunk.request_id, status)

def prefill_cohorts(eng, chunks) -> None:
    """Whole uncached prompts admitted together: one batched prefill (or one per group of similar lengths,
    ``split_by_length`` with the engine's ``cohort_split_min``), each group joining as it is done."""
    groups = split_by_length([c.end - c.start for c in chunks], eng.cohort_split_min)
    if len(groups) > 1:
        eng.counters["cohort_splits"] += 1
    for g in groups:
        part = [chunks[i] for i in g]
        live = [c for c in part if c.request_id in eng._live and eng._live[c.request_id].req.status is RequestStatus.PREFILLING]
        if len(live) == 1:
            prefill_one(eng, live[0])
        elif live:
            prefill_cohort(eng, live)


def prefill_cohort(eng, chunks) -> None:
    """Whole uncached prompts admitted together: one batched prefill, then they join together."""
    lives = [eng._live[c.request_id] for c in chunks]
    rows = [lv.row for lv in lives]
    try:
        for c, row in zip(chunks, rows):
            seed(eng, row, c.start, cohort=True)
            row.seeded = True
        eng.trace.mark("seed")
        caches, emitted = eng.runner.prefill_cohort(rows, [c.start for c in chunks], eng.reuse.cohort_snapshot(rows))
        eng.trace.mark("cohort")
    except Exception as e:  # a prefill error rejects only the joiners (or requeues them: memory)
        prefill_failed(eng, list(zip(chunks, lives)), e)
        return
    keep, tokens, ended = [], [], {}
    now = time.perf_counter()
    for i, (c, lv, em) in enumerate(zip(chunks, lives, emitted)):
        eng.scheduler.on_prefill_chunk(c)
        lv.req.timings.prefill_done = now
        token0_event(eng, lv.req, cohort=len(chunks))
        tokens.append(em.token)
        status = eng.delivery.deliver(em)
        if status is None:
            keep.append(i)
        else:
            ended[c.request_id] = status
    eng.runner.join_cohort(caches, rows, tokens, keep)
    eng.trace.mark("join")
    for i, c in enumerate(chunks):
        if i in keep:
            eng.scheduler.on_joined(c.request_id)
        else:  # finished at token 0: never joins
            eng.scheduler.on_finished(c.request_id, ended[c.request_id])
