"""Speculative decoding on the batch lane: proposers, per-row acceptance, rollback of rejected tails.

One verify step replaces one decode step when some row has proposals:

* each row's proposer looks at the row's history (prompt + emitted tokens) and returns 0..k draft
  tokens; the step feeds ``[B, 1 + W]`` tokens (the row's pending input, its drafts, then padding up to
  the widest proposal W) in one target forward;
* each row walks its own positions: a draft is kept while it equals the target's choice (greedy), or
  by the speculative-sampling rule for a sampled row (below); the first mismatch is replaced by the
  target's own token, and a row whose drafts all pass also gets the bonus token after them. Rows
  without drafts get exactly one token, as in a plain step;
* the rejected tail (and the padding) leaves the caches per row: single-row caches ``trim``; in batch
  layers the rejected entries stay in place as masked holes and the row's position goes back
  (``mlxb/cache/holes.py``), compacted into the left padding now and then (``rollback``).

Sampled rows (temperature > 0) with a lookup draft, which has no draft distribution (a point mass on
the draft token d): accept d with probability pi(d), where pi is the distribution the row would draw
from (its filters and temperature); on rejection draw from pi with d removed and renormalized. Then
P(d) = pi(d) and P(y) = (1 - pi(d)) * pi(y) / (1 - pi(d)) = pi(y): the output distribution is the
target's exactly.

Only full-attention and latent layers can roll back a rejected tail here; a model with sliding-window
or recurrent layers decodes plainly, and ``/stats`` says why. Constrained (grammar) rows speculate
through the per-row path: each position's mask comes from the matcher after the tokens before it,
so a draft the grammar forbids is never kept.
"""

from __future__ import annotations

import time
from typing import Optional

import mlx.core as mx
import numpy as np

from mlxb.constrain.grammar import apply_position_masks
from mlxb.spec import ahead as spec_ahead
from mlxb.spec.config import METHODS, SpecConfig  # noqa: F401 (re-exported)
from mlxb.spec.control import (MAX_COOLDOWN, MIN_GAIN, MISS_LIMIT, RowSpec, StepCost,  # noqa: F401 (re-exported)
                               aligned, pays, shadow, wants_verify)
from mlxb.spec.lookup import LookupProposer
from mlxb.spec.rows import (HOLE_FRACTION, HOLE_MIN, accept_sampled, follow_verify, greedy_keep,  # noqa: F401
                            rollback, settle, settle_holes, tally)


def decode(r, plain=None, verify=None) -> list:
    """A decode step with speculation on: a verify step where some row drafts, else the plain one;
    its wall time feeds ``r.step_cost``. ``plain()`` / ``verify(props)`` run the forward (default: this
    process's; ``--tp`` passes calls that tell the other ranks first)."""
    t, n = time.perf_counter(), len(r.rows)
    ahead = r.ahead  # a verify step launched before the last one was read (spec_ahead)
    if ahead is not None:
        r.spec_why, flushed, props = "ahead", [], [ahead.props]
    else:
        flushed, props = prepare(r)
    flat = aligned(r)
    if ahead is not None:
        out = spec_ahead.resolve(r, ahead)
    elif props is None:
        out = flushed + (plain or r._plain_step)()
        if r.spec.adaptive and r.spec_why in ("bar", "paused") and getattr(r.proposer, "shadows", False):
            shadow(r, r.proposer)
    else:
        out = flushed + (verify or (lambda ps: verify_step(r, ps)))(props)
    dt = time.perf_counter() - t
    r.step_cost.observe(props is not None, dt, n, steady=r.spec_why != "no drafts", aligned=flat)
    kept = sum(r.last_verify[0]) if props is not None else 0
    c = r.caches[r._geo_layer] if r.merged and r._geo_layer is not None else None
    state = "-" if c is None else "H" if getattr(c, "holes", None) is not None else "A" if c.aligned else "M"
    r.step_cost.trace.append((r.spec_why, n, sum(map(len, props or [])), kept, dt, r.step_cost.ratio_at(n), state))
    return out

def setup(spec: Optional[SpecConfig], kinds: list) -> tuple:
    """(config, why it cannot run on this model or None, proposer or None)."""
    off = off_reason(kinds) if spec is not None else None
    if spec is None or off is not None:
        return spec, off, None
    from mlxb.kernels import causal_split

    causal_split.install()  # CUDA only: a lone row's verify attention on MLX's vector kernel
    if spec.method == "draft":
        from mlxb.spec.draft import DraftProposer

        return spec, off, DraftProposer(spec.draft_model)
    return spec, off, LookupProposer(spec.lookup_ngram)

def row_spec(r, req) -> Optional[RowSpec]:
    """A new row's speculation state: the request's ``num_draft_tokens`` (0: off) or the server's."""
    if r.proposer is None:
        return None
    k = r.spec.num_draft_tokens if req.num_draft_tokens is None else req.num_draft_tokens
    if k <= 0:
        return None
    req.spec_drafted = 0
    return RowSpec(k, k, np.asarray(req.prompt_ids, dtype=np.int64), adaptive=r.spec.adaptive)

def off_reason(kinds: list) -> Optional[str]:
    if any(k is None for k in kinds):  # a layer cache the batch cannot hold: the serial lane only
        return "this model is served on the serial lane only (a layer cache the batch cannot hold); no speculation"
    bad = sorted({k for k in kinds if k not in ("full", "latent")})
    if bad:
        return (f"this model has {', '.join(bad)} layers, whose rejected tails cannot be rolled back here; "
                "it decodes without speculation")
    return None

def prepare(r) -> tuple[list, Optional[list]]:
    """(tokens read early, every row's drafts or None: a plain step). Drafts need every emitted token,
    so a row that may propose first has the pending (pipelined) tokens read."""
    for row in r.rows:
        if row.spec is not None and row.spec.cooldown > 0:
            row.spec.cooldown -= 1
    r.spec_why = ("batch" if len(r.rows) > r.spec.max_batch else "paused" if not wants_verify(r.rows)
                  else "bar" if not pays(r) else "verify")
    if r.spec_why != "verify":
        if r.spec.adaptive and r.merged:
            settle_holes(r)
        return [], None
    flushed = []
    if any(p is not None for p in r.pending):
        flushed = r._emit_pending(r.register, r.pending, r.pending_geo)
        r.pending = [None] * len(r.rows)
    props = propose_all(r)
    if not any(props):
        r.spec_why = "no drafts"
    return flushed, (props if any(props) else None)

def propose_all(r) -> list[list[int]]:
    """Every row's drafts for this step ([] for rows that do not speculate now)."""
    ks = []
    for row in r.rows:
        st = row.spec
        if st is None or st.cooldown > 0:
            ks.append(0)
            continue
        ks.append(max(0, min(st.k, row.req.max_tokens - row.steps - 1)))  # a verify step emits up to k + 1
    if hasattr(r.proposer, "propose_rows"):  # a draft model proposes for the whole batch at once
        return r.proposer.propose_rows(r, ks)
    out = []
    for row, k in zip(r.rows, ks):
        st = row.spec
        if st is None or k == 0:
            out.append([])
            continue
        props = r.proposer.propose(st.history(row.tokens), k)
        if props and row.sampler.constraint is not None:  # drafts the row's grammar forbids can never be kept
            props = props[:row.sampler.constraint.allowed_drafts(props)]
        if not props and st.adaptive:  # a run of lookups that find nothing pauses them (each costs the pipelining)
            st.misses += 1
            if st.misses >= MISS_LIMIT:
                st.misses, st.cooldown, st.backoff = 0, st.backoff, min(2 * st.backoff, MAX_COOLDOWN)
        else:
            st.misses = 0
        out.append(props)
    return out

def verify_step(r, props: list[list[int]]) -> list:
    """One target forward over every row's pending input and drafts; returns the emitted tokens (all
    of them read: nothing stays pending, except a lone row's next verify step, ``spec_ahead``)."""
    if spec_ahead.eligible(r):
        return spec_ahead.run(r, props[0])
    t0 = time.perf_counter()
    rows = r.rows
    width = max(len(p) for p in props)
    regs = r.register.tolist()
    fed = [[regs[i]] + p + [regs[i]] * (width - len(p)) for i, p in enumerate(props)]
    x = mx.array(fed, dtype=mx.uint32)
    logits = r.fwd(r.rows, x, r.caches)  # [B, 1 + W, V]
    # greedy grammar rows without processors: every position's mask made on the host before the read (the
    # matcher walks the drafts and rolls back), so they keep drafts as free rows do, with one read for the step
    # instead of one per position
    masked = {i: row.sampler.constraint.draft_masks(props[i]) for i, row in enumerate(rows)
              if row.sampler.constraint is not None and row.sampler.greedy and not row.sampler.processors}
    if masked:
        logits = apply_position_masks(logits, masked)
    lp_all = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    choice = mx.argmax(lp_all, axis=-1)
    t1 = time.perf_counter()
    mx.eval(choice)
    choice = choice.tolist()
    geo = r._geometry() if r.capture is not None else [None] * len(rows)  # parity: the buffer this forward read
    t2 = time.perf_counter()
    out, kept, last = [], [], []
    for i, row in enumerate(rows):
        p = props[i]
        fast = row.sampler.greedy and not row.sampler.processors and (row.sampler.constraint is None or i in masked)
        want_lp = r._needs_vectors(row)
        toks = []
        if fast:
            emitted, a = greedy_keep(r, row, p, choice[i], lp_all[i], geo[i])
            out += emitted
            toks = choice[i][: a + 1]
        else:
            for j in range(len(p) + 1):
                ctx = None if row.context is None else mx.concatenate([row.context, x[i, : j + 1]])
                lg = row.sampler.process(ctx, logits[i, j : j + 1])
                if row.sampler.constraint is not None:
                    lg = row.sampler.constraint.apply(lg)
                lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
                if j < len(p):
                    q = getattr(r.proposer, "q", None)
                    q = q[i][j] if q and q[i] is not None else None  # a draft model's own distribution
                    t, ok = ((int(mx.argmax(lp, axis=-1).item()), None) if row.sampler.greedy
                             else accept_sampled(row.sampler, lp, p[j], q))
                    ok = (t == p[j]) if ok is None else ok
                else:
                    t, ok = int(row.sampler.sample(lp).item()), False
                toks.append(t)
                out.append(r._emit(row, t, lp if want_lp else None, geo[i]))  # a grammar row's matcher advances here
                if not ok or out[-1].grammar_done:
                    break
            a = len(toks) - 1
        if row.context is not None:
            row.context = mx.concatenate([row.context, x[i, : a + 1]])
        tally(r, row, len(p), a)
        kept.append(a)
        last.append(toks[-1])
    t3 = time.perf_counter()
    settle(r, kept, last, width)
    if hasattr(r.proposer, "commit"):
        r.proposer.commit(r, kept)
    r.spec_counts["verify_steps"] += 1
    tm = r.timing  # host seconds: build the forward, wait for it, accept and emit, roll back
    tm["verify_build_s"] += t1 - t0
    tm["verify_wait_s"] += t2 - t1
    tm["verify_accept_s"] += t3 - t2
    tm["verify_rollback_s"] += time.perf_counter() - t3
    return out
