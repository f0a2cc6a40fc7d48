"""What a verify step does to each row: accept drafts (greedy or by the speculative-sampling rule), roll
the rejected tails back out of the caches (``mlxb/cache/holes.py`` for batch layers), settle the rows and
count. Shared by the verify step (``mlxb.spec.verify``), the pipelined lone row (``mlxb.spec.ahead``), the
draft model (``mlxb.spec.draft``) and the ``--tp`` followers."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlxb.cache.holes import compact, compaction, mark_holes, new_holes

HOLE_MIN, HOLE_FRACTION = 32, 8  # compact a batch layer's holes past max(32, width / 8) in one row
# MLX's buffer pool is checked (trimmed past its slack, mlxb.cache.allocator) every this many verify steps: their
# shapes change from step to step (width, holes, rollbacks), so freed buffers fit later requests less often than a
# plain step's; with no check in verify steps an H100 sweep's fixed K=8 arm at B=32 grew the pool to 57.6 GB and
# ran out of device memory (reports/h100/session69)
VERIFY_TRIM_STEPS = 32


def accept_sampled(sampler, logprobs: mx.array, draft: int, q: Optional[mx.array] = None) -> tuple[int, bool]:
    """The speculative-sampling rule. ``q`` ([V]): the distribution the draft was drawn from (a draft
    model's sampled row): keep it with probability min(1, pi(d) / q(d)), else draw from the residual
    max(pi - q, 0) normalized (Leviathan et al.). Without ``q`` the draft is a point mass (lookup, or a
    greedy draft model): keep it with probability pi(d), else draw from pi without d (module notes).
    Both give exactly pi; with the draft's own q more drafts are kept."""
    x = sampler.draw_logits(logprobs)  # [1, V]
    pi = mx.softmax(x, axis=-1)
    u = mx.random.uniform(key=sampler.next_key())
    if q is None:
        if (u < pi[0, draft]).item():
            return draft, True
        rest = mx.where(mx.arange(x.shape[-1]) == draft, -mx.inf, x)
    else:
        if (u * q[draft] < pi[0, draft]).item():
            return draft, True
        rest = mx.log(mx.maximum(pi - q[None].astype(pi.dtype), 0))
    return int(mx.random.categorical(rest, key=sampler.next_key()).item()), False

def rollback(caches: list, kinds: list, shifts: list[int], merged: bool) -> None:
    """Drop each row's last ``shifts[i]`` cache entries: single-row caches ``trim``; in batch layers
    they become masked holes in place (``mlxb/cache/holes.py``), compacted into the left padding once
    a row holds more than ``max(HOLE_MIN, width // HOLE_FRACTION)`` of them."""
    if not any(shifts):
        return
    if not merged:
        for c in caches:
            c.trim(shifts[0])
        return
    made, plan = new_holes(shifts), None  # every layer took the same steps: one mask, one gather order
    for c, k in zip(caches, kinds):
        assert k in ("full", "latent"), k
        mark_holes(c, shifts, made)
        if c.hole_counts and max(c.hole_counts) > max(HOLE_MIN, c._idx // HOLE_FRACTION):
            plan = plan or compaction(c)
            compact(c, plan)

def settle_holes(r) -> None:
    """Compact every batch layer's holes now (adaptive speculation, on a step the bar or the pauses made
    plain): more plain steps follow, and a step over a layer with holes pays the masked attention path.
    On the H200 (synth-llama-8b, B=8) plain steps after a verify step took 12.5 ms against 8.2 ms aligned
    (``scripts/spec_trace.py``). One gather per array, once; --spec-fixed keeps the compaction bound of the
    parity protocol (a plain step there is rare). The padding every row then shares leaves the buffer
    (``trim``): a batch that was aligned before the verify step and whose rows all kept as many drafts
    (all of none, say) is aligned again, so its plain steps skip the mask once more."""
    plan = None
    for c, k in zip(r.caches, r.kinds):
        if k in ("full", "latent") and getattr(c, "holes", None) is not None:
            plan = plan or compaction(c, trim=True)
            compact(c, plan)
    if plan is not None:
        r._align()
        if hasattr(r, "mirror_compact"):  # --tp: every rank compacts its shard alike
            r.mirror_compact()

def settle(r, kept: list[int], last: list[int], width: int) -> None:
    """After a verify step of ``width`` drafts a row, in which row i kept ``kept[i]`` and ends on token
    ``last[i]``: roll the rejected tails back and move the rows on (every --tp rank does this)."""
    from mlxb.cache.quantized import maybe_quantize

    shifts = [width - a for a in kept]
    if "spec_rollback_off_by_one" in r.faults:  # planted bug (parity control): one rejected entry stays
        shifts = [max(0, s - 1) for s in shifts]
    rollback(r.caches, r.kinds, shifts, r.merged)
    if r.kv is not None and not r.merged:  # a lone row converts as generate_step does
        off = next((c.offset for c, k in zip(r.caches, r.kinds) if k == "full"), 0)
        r.caches = maybe_quantize(r.caches, r.kinds, r.kv, int(off))
    for row, a in zip(r.rows, kept):
        row.base += a  # the step counter adds the pending input; accepted drafts are extra
    r.register = mx.array(last, dtype=mx.uint32)
    r.pending = [None] * len(r.rows)
    r.pending_geo = None
    r.count_step(VERIFY_TRIM_STEPS)
    r.last_verify = (kept, last, width)
    r._align()

def follow_verify(r, props: list[list[int]]) -> None:
    """A --tp follower's verify forward: rank 0's feed (each row's pending token, its drafts, padding
    with that token), built from this rank's register (``settle`` follows with rank 0's outcome)."""
    width = max(len(p) for p in props)
    drafts = mx.array([p + [0] * (width - len(p)) for p in props], dtype=mx.uint32)
    real = mx.array([[j < len(p) for j in range(width)] for p in props])
    reg = r.register[:, None]
    mx.eval(r.fwd(r.rows, mx.concatenate([reg, mx.where(real, drafts, reg)], axis=1), r.caches))

def greedy_keep(r, row, p: list[int], choice: list[int], lps: mx.array, geo=None) -> tuple[list, int]:
    """A greedy row without processors (under a grammar, ``choice`` and ``lps`` come from logits masked per
    position): its drafts ``p`` are kept while they equal ``choice`` (the target's argmax at each position);
    emits the kept drafts and the target's token after them (log-probs from ``lps`` [1 + W, V] where the
    request wants them), and nothing after a token that completes the row's grammar. Returns (emitted,
    drafts kept)."""
    a = 0
    while a < len(p) and p[a] == choice[a]:
        a += 1
    want_lp = r._needs_vectors(row)
    out = []
    for j, t in enumerate(choice[: a + 1]):
        out.append(r._emit(row, t, lps[j : j + 1] if want_lp else None, geo))
        if out[-1].grammar_done:
            return out, j
    return out, a

def tally(r, row, n: int, a: int) -> None:
    """A row drafted ``n`` and kept ``a`` in a verify step: its adaptive state, usage and the counters."""
    if row.spec is not None and n:
        row.spec.adapt(n, a, r.step_cost.ratio_at(len(r.rows)), getattr(r, "spec_pooled", None),
                       shadows=getattr(r.proposer, "shadows", False))
        row.req.spec_drafted, row.req.spec_accepted = row.spec.drafted, row.spec.accepted
    r.spec_counts["drafted"] += n
    r.spec_counts["accepted"] += a
