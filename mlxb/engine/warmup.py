"""Start-up warm-up: run every batching path once before the first request.

MLX compiles a kernel the first time an op meets a new kind of input (dtype, rank, layout); on
CUDA one such compile takes from a tenth of a second to seconds. Left to traffic, the first late
joiners pay it while other rows decode: on the H200 (8B shape) the first and second joiners of a
fresh process stalled the running row 0.7-8.9 s, the third 39-64 ms (``reports/h200/``).

``warm_up`` drives a short scripted schedule through the real scheduler and runner of an engine
that has not started, the way the parity driver does, so that each path runs once with tiny
prompts: a lone adopted row, a join into it, retirement to a merged single row, a join onto that
merged batch, an idle cohort with padding and an aligned one (no mask); with the prompt cache on,
also a shared-prefix burst (split leader, followers' cached cohort), a repeat and a left-padded
cohort of a hit and a miss (snapshots, borrowed rows, extraction). Kernels depend on the kind
of input rather than its exact size, so later traffic with other lengths finds them compiled. The
engine is left idle with its counters at zero.
"""

from __future__ import annotations

import gc
import time

from mlxb.kernels import dense_attention
from mlxb.spec.control import StepCost
from mlxb.engine.stream import OutputStream
from mlxb.errors import MlxbError
from mlxb.request import Request

# (arrival iteration, prompt tokens, max_tokens): at most two rows decode at once
SCRIPT = [
    (0, 12, 8),  # alone: adopted single-row caches
    (2, 20, 12),  # joins the adopted row (longer: the batch is padded); row 0 retires first
    (10, 9, 5),  # joins the merged single-row batch left by the retirement
    (22, 10, 4), (22, 16, 4),  # an idle cohort of different lengths (padded)
    (30, 14, 3), (30, 14, 3),  # an idle cohort of equal lengths (aligned: no mask)
]
SERIAL = [(0, 12, 4)]
# with the prompt cache on: (arrival, (shared prefix tokens, own tokens, salt), max_tokens)
PREFIX = [
    (44, (40, 3, 1), 4),  # a leader whose chunk is split at the shared length
    (44, (40, 5, 2), 4), (44, (40, 6, 3), 4),  # followers: one cohort from the leader's snapshot
    (56, (40, 3, 1), 3),  # the leader's prompt again: a cache hit, prefilled alone
    (64, (40, 7, 4), 3), (64, (0, 24, 5), 3),  # a hit and a miss together: a left-padded cached cohort
]
SERIAL_PREFIX = [(6, (40, 3, 1), 3), (12, (40, 5, 2), 3)]


def _ids(n: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt) % 200 + 5 for i in range(n)]  # ids every tokenizer has


def _prompt(spec, k: int) -> list[int]:
    if isinstance(spec, int):
        return _ids(spec, k)
    shared, own, salt = spec
    return _ids(shared, 97) + _ids(own, 11 * salt + 3)


def warm_up(engine, max_iterations: int = 200) -> dict:
    """Run the script on ``engine`` (not started); returns what ran and how long it took.

    A row the engine could never admit (a tiny ``--kv-budget`` or context limit) is left out; rows
    still unfinished after ``max_iterations`` are cancelled, so the engine always ends idle. The prompt cache's
    SSD tier is detached meanwhile: with a RAM tier smaller than the warm-up's entries, every start wrote them to
    the SSD folder and the next start restored them (its counters then mixed warm-up restores with traffic)."""
    assert not engine._thread.is_alive(), "warm up before start()"
    pc = engine.prompt_cache
    disk = pc.disk if pc is not None else None
    if disk is not None:  # the SSD tier stays out of it: warm-up prompts are neither written there nor restored
        pc.disk = None
    try:
        return _warm_up(engine, max_iterations)
    finally:
        if disk is not None:
            pc.disk = disk


def _warm_up(engine, max_iterations: int) -> dict:
    script = SCRIPT if engine.mode == "batch" else SERIAL
    if engine.prompt_cache is not None:  # the cache paths too: snapshots, borrowed rows, cached cohorts
        script = script + (PREFIX if engine.mode == "batch" else SERIAL_PREFIX)
    mechanism = "continuous" if engine.mode == "batch" else "serial"
    plan: list[tuple[int, Request]] = []
    skipped = 0
    for k, (at, n, max_tokens) in enumerate(script):
        req = Request(f"warmup-{k}", _prompt(n, k), max_tokens, ignore_eos=True)
        req.mechanism = mechanism
        try:
            engine.check_admissible(req)
        except MlxbError:
            skipped += 1
            continue
        plan.append((at, req))
    t0 = time.perf_counter()
    streams: list[OutputStream] = []
    it = 0
    while it < max_iterations and (len(streams) < len(plan) or engine._live):
        for at, req in plan:
            if at == it:
                st = OutputStream(req.request_id)
                engine.accept(req, st)
                streams.append(st)
        engine.iterate()
        it += 1
    for live in engine._live.values():  # did not finish in time: cancel, then drain
        live.cancelled = True
    for _ in range(4):
        if not engine._live:
            break
        engine.iterate()
    if engine._live:
        raise RuntimeError("warm-up could not drain its requests")
    stats_spec = _warm_verify(engine, mechanism) if engine.runner.proposer is not None else None
    finished = [list(st)[-1].finish_reason for st in streams]  # every stream is closed by now
    stats = {"seconds": time.perf_counter() - t0, "iterations": it, "requests": len(streams), "skipped": skipped,
             "batched_steps": engine.counters["batched_steps"], "finished": finished}
    if dense_attention.enabled():  # --kv-attention fused: every query count's kernel, compiled now, not mid-traffic
        tk = time.perf_counter()
        r = engine.runner  # a verify step brings its pending token and up to --num-draft-tokens drafts
        queries = 1 + (r.spec.num_draft_tokens if r.proposer is not None else 0)
        stats["attention_variants"] = dense_attention.warm_variants(prefix=r.sharing is not None, queries=queries)
        stats["attention_variants_s"] = round(time.perf_counter() - tk, 2)
        stats["seconds"] = time.perf_counter() - t0
    if stats_spec is not None:
        stats["verify_steps"] = stats_spec
    if engine.prompt_cache is not None:
        stats["cached_tokens"] = engine.prompt_cache.counters["cached_tokens"]
        engine.prompt_cache.reset()  # serve with an empty RAM tier: warm-up prompts are not kept
    engine.runner.drop_all()
    engine.runner.timing.clear()
    engine.runner.spec_counts.clear()
    engine.runner.step_cost.clear()  # first-shape compiles are not what a step costs
    for key in engine.counters:
        engine.counters[key] = 0
    engine.scheduler.num_submitted = 0
    return stats


class _FreeVerify(StepCost):
    """The step cost the warm-up's verify steps see: one plain step, never stale, no mask penalty, so the
    bar always opens. The real measurements (timing of first-shape compiles, noisy on a shared CPU) could
    otherwise keep every warm-up row plain and leave the verify kernels to the first request."""

    def ratio_at(self, rows: int, aligned: bool = False) -> float:
        return 1.0

    def penalty_at(self, rows: int) -> float:
        return 1.0

    def stale_at(self, rows: int) -> bool:
        return False


class _RepeatLast:
    """Warm-up drafts for lookup: the last token k times (usually rejected, which also runs the
    rollback); real lookups need repeated text, which tiny warm-up prompts may not have."""

    def propose(self, history, k: int) -> list[int]:
        return [int(history[-1])] * k


def _warm_verify(engine, mechanism: str, max_iterations: int = 80) -> int:
    """--spec: verify steps at B=1 (and B=2 where --spec-max-batch allows), every draft width the
    adaptive length reaches, so their kernels are compiled before traffic. Returns the verify steps."""
    r = engine.runner
    real, cost = r.proposer, r.step_cost
    if not hasattr(real, "propose_rows"):
        r.proposer = _RepeatLast()
    r.step_cost = _FreeVerify()  # the draft length still shrinks only at the end of max_tokens: widths k..1
    try:
        reqs = [Request(f"warmup-spec-{i}", _ids(12, 40 + i), r.spec.num_draft_tokens + 8, ignore_eos=True)
                for i in range(min(2, r.spec.max_batch))]
        for req in reqs:
            req.mechanism = mechanism
            engine.accept(req, OutputStream(req.request_id))
        for _ in range(max_iterations):
            if not engine._live:
                break
            for row in r.rows:  # a batch speculates only on evidence of acceptance: warm-up has none
                if row.spec is not None:
                    row.spec.evidence = max(1, row.spec.evidence)
            engine.iterate()
        for live in engine._live.values():
            live.cancelled = True
        for _ in range(4):
            if engine._live:
                engine.iterate()
    finally:
        r.proposer, r.step_cost = real, cost
    return r.spec_counts["verify_steps"]


def freeze_heap() -> None:
    """Collect once, then take every object alive now (model, tokenizer, imported modules) out of
    the cyclic collector's view, as vLLM does after start-up: the full collections that serving
    traffic triggers then scan only what serving allocated (here a full scan of the start-up heap
    took tens of milliseconds, one stalled decode step)."""
    gc.collect()
    gc.freeze()
