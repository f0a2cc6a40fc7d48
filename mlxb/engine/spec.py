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
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from mlxb.cache.holes import compact, compaction, mark_holes, new_holes
from mlxb.engine import spec_ahead
from mlxb.engine.spec_control import (MAX_COOLDOWN, MIN_GAIN, MISS_LIMIT, RowSpec, StepCost,  # noqa: F401 (re-exported)
                                      aligned, pays, shadow, wants_verify)

METHODS = ("lookup", "draft")
HOLE_MIN, HOLE_FRACTION = 32, 8  # compact a batch layer's holes past max(32, width / 8) in one row


@dataclass(frozen=True)
class SpecConfig:
    """``--spec lookup --num-draft-tokens K --lookup-ngram N``."""

    method: str = "lookup"
    num_draft_tokens: int = 4
    lookup_ngram: int = 3
    draft_model: Any = field(default=None, compare=False, repr=False)  # the loaded model (--spec draft)
    draft_name: Optional[str] = None
    max_batch: int = 1  # speculate only while the batch has at most this many rows (--spec-max-batch)
    adaptive: bool = True  # False (--spec-fixed): every row drafts num_draft_tokens each step, as mlx-lm does
    pipeline: str = "off"  # --spec-pipeline: a lone row's next verify step launched before this one is read

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--spec {self.method}: choose one of {', '.join(METHODS)}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("--spec draft needs --draft-model (and --draft-model needs --spec draft)")
        if self.max_batch < 1:
            raise ValueError("--spec-max-batch must be at least 1")
        if not 1 <= self.num_draft_tokens <= 32:
            raise ValueError("--num-draft-tokens must be between 1 and 32")
        if self.pipeline not in spec_ahead.MODES:
            raise ValueError(f"--spec-pipeline {self.pipeline}: choose one of {', '.join(spec_ahead.MODES)}")
        if not 1 <= self.lookup_ngram <= 16:
            raise ValueError("--lookup-ngram must be between 1 and 16")


class LookupProposer:
    """Prompt lookup (n-gram copy): find the most recent earlier occurrence of the history's last n
    tokens (n from ``ngram`` down to 1) that is followed by k tokens (else the most recent one) and
    propose the tokens that followed it."""

    def __init__(self, ngram: int = 3):
        self.ngram = ngram

    shadows = True  # a plain step can check its drafts against what follows for free (spec_control.shadow)

    def propose(self, history: np.ndarray, k: int) -> list[int]:
        """The match is searched from the positions that hold the last token (one vectorized compare),
        narrowed token by token: the same windows as comparing every n-gram, at a fraction of the host
        time (it runs on every step of every speculating row)."""
        n_hist = history.shape[0]
        if k <= 0 or n_hist < 2:
            return []
        ends = np.flatnonzero(history[:-1] == history[-1])  # where an earlier window could end
        for n in range(min(self.ngram, n_hist - 1), 0, -1):
            e = ends[ends >= n - 1]
            for d in range(1, n):
                if not e.size:
                    break
                e = e[history[e - d] == history[-1 - d]]
            if e.size:  # the latest match that is followed by k tokens, else the latest match
                hits = e - (n - 1)
                full = hits[hits + n + k <= n_hist]
                s = int(full[-1] if full.size else hits[-1]) + n
                return history[s : s + k].tolist()
        return []


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
        if r.spec.adaptive and r.spec_why == "bar" and isinstance(r.proposer, LookupProposer):
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


def setup(spec: Optional[SpecConfig], kinds: list) -> tuple:
    """(config, why it cannot run on this model or None, proposer or None)."""
    off = off_reason(kinds) if spec is not None else None
    if spec is None or off is not None:
        return spec, off, None
    from mlxb.kernels import causal_split

    causal_split.install()  # CUDA only: a lone row's verify attention on MLX's vector kernel
    if spec.method == "draft":
        from mlxb.engine.draft import DraftProposer

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
    r.num_steps += 1
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
        if not props and st.adaptive:  # a run of lookups that find nothing pauses them (each costs the pipelining)
            st.misses += 1
            if st.misses >= MISS_LIMIT:
                st.misses, st.cooldown, st.backoff = 0, st.backoff, min(2 * st.backoff, MAX_COOLDOWN)
        else:
            st.misses = 0
        out.append(props)
    return out


def greedy_keep(r, row, p: list[int], choice: list[int], lps: mx.array, geo=None) -> tuple[list, int]:
    """A greedy row without processors or grammar: its drafts ``p`` are kept while they equal ``choice`` (the
    target's argmax at each position); emits the kept drafts and the target's token after them (log-probs
    from ``lps`` [1 + W, V] where the request wants them). Returns (emitted, drafts kept)."""
    a = 0
    while a < len(p) and p[a] == choice[a]:
        a += 1
    want_lp = r._needs_vectors(row) or row.req.sampling.logprobs
    return [r._emit(row, t, lps[j : j + 1] if want_lp else None, geo) for j, t in enumerate(choice[: a + 1])], a


def tally(r, row, n: int, a: int) -> None:
    """A row drafted ``n`` and kept ``a`` in a verify step: its adaptive state, usage and the counters."""
    if row.spec is not None and n:
        row.spec.adapt(n, a, r.step_cost.ratio_at(len(r.rows)))
        row.req.spec_drafted, row.req.spec_accepted = row.spec.drafted, row.spec.accepted
    r.spec_counts["drafted"] += n
    r.spec_counts["accepted"] += a


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
        fast = row.sampler.greedy and not row.sampler.processors and row.sampler.constraint is None
        want_lp = r._needs_vectors(row) or row.req.sampling.logprobs
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
