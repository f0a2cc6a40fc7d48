"""Pipelined verify steps for a lone greedy row (``--spec-pipeline``): launch the next verify step
before the current one is read, on the guess that every draft of the current one holds.

A plain decode step is pipelined (``Runner._plain_step`` launches step t+1 from the unread token of
step t), but a verify step has to be read before the next drafts can be looked up, so the device idles
while the host reads, accepts, rolls back, looks up and builds. Measured on the H200 (synth-llama-8b,
B=1): a verify step took 10-15 ms in the engine against 4.5-7 ms for a pipelined plain step.

Here, while verify step N runs, the host assumes all of N's drafts ``p`` hold and looks up the next
drafts from ``history + p``: the lookup returns ``[c0, c1, ...]``, where ``c0`` is its guess for N's
bonus token. Step N+1 feeds N's real bonus token (the unread argmax, a lazy array) followed by
``c1, ...`` and is launched at once; then N is read.

* All of N's drafts held: N+1 ran on the right cache. It stays in flight and the next decode step
  reads it (and launches N+2 first, the same way). If ``c0`` was not the bonus token, N+1's drafts
  will mostly fail, but its first token is still the target's own choice after the real bonus.
* Some draft of N failed: N+1 is discarded. Its cache entries leave with N's rejected tail (one trim:
  a lone row's caches are mlx-lm's single-row caches). The device time it took is the price of the guess.

Every kept token is the argmax of a forward over the same cache state and inputs a verify step
would see, so the output is what unpipelined speculation gives. Any change to the batch (a join, a
retirement, an extraction into the prompt cache) cancels the step in flight first (``cancel``).

Only where it can pay: one row (not merged), greedy without processors or grammar, prompt lookup,
full-width KV, not ``--tp`` and not a parity capture. ``auto`` pipelines on a GPU backend once the row's
rate of verify steps whose drafts all held (``RowSpec.full``) is at least ``FULL_MIN``: a wrong guess
costs a whole verify forward, which on a compute-bound CPU is several plain steps while the host time it
would hide is small there, so ``auto`` leaves CPUs alone; ``on`` pipelines every eligible step.

It is off by default, because it measured no gain (README, "Pipelined verify steps"): on MLX's CUDA
backend the host's ``mx.async_eval`` of a [1, 5] verify graph takes 7-13 ms (its 2-8 row matmuls go to
cuBLAS, whose launches cost the host far more than the one-row gemv's), and that launch is not hidden by
launching earlier; a guessed step saved about 1.5 ms and a dropped one cost a whole forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

MODES = ("auto", "on", "off")
FULL_MIN = 0.5  # auto: the all-drafts-held rate above which a guess is expected to pay on a GPU


@dataclass
class Ahead:
    """A verify step in flight for the lone row: its drafts, feed and lazy results."""

    props: list
    choice: mx.array  # [1, 1 + K] argmax per position
    lp: mx.array  # [1, 1 + K, V] log-probabilities


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def eligible(r) -> bool:
    """The lone-row verify step can be pipelined here (module notes)."""
    mode = getattr(r.spec, "pipeline", "off")
    if mode == "off" or r.merged or len(r.rows) != 1 or r.kv is not None or r.capture is not None:
        return False
    from mlxb.spec.lookup import LookupProposer

    if not getattr(r, "pipeline_verify", False) or not isinstance(r.proposer, LookupProposer):
        return False
    row = r.rows[0]
    s = row.sampler
    if row.spec is None or not s.greedy or s.processors or s.constraint is not None:
        return False
    return mode == "on" or (on_gpu() and row.spec.full >= FULL_MIN)


def launch(r, props: list, first: mx.array) -> Ahead:
    """Build the lone row's verify forward over ``first`` (its [1] input token, possibly unread) and
    ``props``, and start it."""
    x = mx.concatenate([first.reshape(1, 1).astype(mx.uint32), mx.array([props], dtype=mx.uint32)], axis=1)
    logits = r.fwd(r.rows, x, r.caches)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    choice = mx.argmax(lp, axis=-1)
    mx.async_eval(choice)
    return Ahead(list(props), choice, lp)


def guess_next(r, cur: Ahead) -> list:
    """The drafts for the step after ``cur``, looked up as if all of ``cur``'s drafts held ([] if none,
    or if the row would not speculate then)."""
    from mlxb.spec.control import pays

    row = r.rows[0]
    st = row.spec
    if st.cooldown > 0 or not pays(r):
        return []
    steps = row.steps + len(cur.props) + 1  # the row's tokens once cur's are emitted
    k = min(st.kmax, st.k + 1) if st.adaptive else st.k
    k = min(k, row.req.max_tokens - steps - 1)
    if k < 1:
        return []
    hist = np.concatenate([st.history(row.tokens), np.asarray(cur.props, dtype=np.int64)])
    c = r.proposer.propose(hist, k + 1)  # c[0]: the guess for cur's bonus token
    return c[1:]


def run(r, props: list[int]) -> list:
    """A verify step for the lone row from its register (nothing in flight)."""
    t0 = time.perf_counter()
    cur = launch(r, props, r.register)
    r.timing["verify_build_s"] += time.perf_counter() - t0
    return resolve(r, cur)


def resolve(r, cur: Ahead) -> list:
    """Launch the guessed next step, then read ``cur``: emit its tokens, keep or drop the next step."""
    from mlxb.spec.rows import greedy_keep, settle, tally

    t0 = time.perf_counter()
    row = r.rows[0]
    st = row.spec
    nxt_props = guess_next(r, cur) if eligible(r) else []
    nxt = launch(r, nxt_props, cur.choice[:, -1]) if nxt_props else None
    t1 = time.perf_counter()
    choice = cur.choice.tolist()[0]
    t2 = time.perf_counter()
    p = cur.props
    out, a = greedy_keep(r, row, p, choice, cur.lp[0])
    toks = choice[: a + 1]
    tally(r, row, len(p), a)
    c = r.spec_counts
    c["verify_steps"] += 1
    keep = nxt is not None and a == len(p) and st.cooldown == 0
    if nxt is not None:
        c["pipelined_kept" if keep else "pipelined_dropped"] += 1
    t3 = time.perf_counter()
    width = len(p) + (1 + len(nxt.props) if nxt is not None and not keep else 0)
    settle(r, [a], [toks[-1]], width)  # a dropped next step's entries leave with the rejected tail
    r.ahead = nxt if keep else None
    tm = r.timing
    tm["verify_build_s"] += t1 - t0
    tm["verify_wait_s"] += t2 - t1
    tm["verify_accept_s"] += t3 - t2
    tm["verify_rollback_s"] += time.perf_counter() - t3
    return out


def cancel(r) -> None:
    """Drop the verify step in flight (the batch is about to change): its entries leave the caches."""
    from mlxb.spec.rows import rollback

    nxt = getattr(r, "ahead", None)
    if nxt is None:
        return
    r.ahead = None
    if r.caches is not None:
        rollback(r.caches, r.kinds, [1 + len(nxt.props)], r.merged)
    r.spec_counts["pipelined_cancelled"] += 1
