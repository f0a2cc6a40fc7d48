"""Speculative decoding (--spec lookup) on the batch lane: greedy output is token-identical to plain
decoding at the same B with joins and retirements, rows roll back their rejected tails (a planted
off-by-one fails), EOS and max_tokens inside an accepted block end the row where plain decoding does,
and the sampling rule keeps the target distribution (chi-square)."""

import mlx.core as mx
import numpy as np
import pytest

from mlxb.engine.engine import Engine
from mlxb.spec.verify import LookupProposer, SpecConfig, accept_sampled
from mlxb.engine.stream import OutputStream
from mlxb.request import Request, SamplingParams

SPEC = SpecConfig("lookup", 4, 3, max_batch=8, adaptive=False)  # the mechanism, not the cost gate (tested apart)


def repetitive_prompts(seed=2):
    """Prompts that repeat themselves, so lookup finds drafts the random models often follow."""
    rng = np.random.default_rng(seed)
    base = rng.integers(5, 8000, size=12).tolist()
    return [base * 4, rng.integers(5, 8000, size=17).tolist() * 2, base[:5] * 6, base[3:9] * 3]


def run(model, tok, prompts, arrive, batch, max_tokens, spec=None, eos=None, sp=None, **kw):
    """Drive the engine iteration by iteration; returns per request the delivered outputs and the engine."""
    eng = Engine(model, tok, max_batch=batch, prefill_chunk=16, spec=spec, **kw)
    if eos is not None:
        eng.eos_ids = eng.delivery.eos_ids = set(eos)
    streams, todo, k = {}, list(enumerate(zip(prompts, arrive))), 0
    while todo or eng._live:
        for i, (p, a) in list(todo):
            if a == k:
                n = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
                r = Request(f"r{i}", p, n, sp or SamplingParams(logprobs=True), ignore_eos=eos is None)
                streams[i] = OutputStream(r.request_id)
                eng.accept(r, streams[i])
                todo.remove((i, (p, a)))
        eng.iterate()
        k += 1
    outs = []
    for i in range(len(prompts)):
        s = streams[i]
        items = []
        while not s._q.empty():
            x = s._q.get()
            if hasattr(x, "request_id"):
                items.append(x)
        outs.append(items)
    return outs, eng


def tokens(out):
    return [o.token for o in out if o.token is not None]


def test_lookup_proposes_what_followed_the_latest_match():
    p = LookupProposer(ngram=3)
    h = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert p.propose(h, 3) == [7, 8, 1]  # the latest earlier "1 2 3" is followed by 7 8 1
    assert p.propose(h, 1) == [7]
    assert p.propose(np.array([5, 6, 7, 6]), 4) == [7, 6]  # falls back to the 1-gram "6"
    assert p.propose(np.array([1, 2, 3]), 4) == []  # no earlier occurrence
    assert p.propose(h, 0) == []


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-minicpm", "tiny-glm-mla"])
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_greedy_output_is_token_identical_with_joins_and_retirements(tiny_models, name, batch):
    model, tok = tiny_models(name)[:2]
    prompts = repetitive_prompts()
    arrive, max_tokens = [0, 2, 5, 9], [40, 23, 31, 17]
    plain, _ = run(model, tok, prompts, arrive, batch, max_tokens)
    spec, eng = run(model, tok, prompts, arrive, batch, max_tokens, spec=SPEC)
    for a, b, n in zip(plain, spec, max_tokens):
        assert tokens(a) == tokens(b) and len(tokens(b)) == n
        # logprobs of the verify forward equal plain decoding's up to the last bits (other shapes)
        assert max(abs(x.logprob.logprob - y.logprob.logprob) for x, y in zip(a, b) if x.logprob) < 1e-4
    st = eng.spec_stats()
    assert st["verify_steps"] > 0 and st["accepted"] > 0
    assert st["active"] == (batch > 1)  # a --batch 1 server places every row on the strict serial lane
    usage = [o[-1].usage for o in spec]
    assert sum(u["draft_tokens"] for u in usage) == st["drafted"]
    assert sum(u["accepted_tokens"] for u in usage) == st["accepted"]


def test_planted_rollback_off_by_one_changes_the_output(tiny_models, monkeypatch):
    import mlxb.spec.rows as S

    model, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts()
    plain, _ = run(model, tok, prompts, [0, 2, 5, 9], 4, 30)
    real = S.rollback
    monkeypatch.setattr(S, "rollback", lambda caches, kinds, shifts, merged: real(
        caches, kinds, [max(0, s - 1) for s in shifts], merged))
    bad, eng = run(model, tok, prompts, [0, 2, 5, 9], 4, 30, spec=SPEC)
    assert eng.spec_stats()["verify_steps"] > 0  # rows shorter than the widest proposal roll back padding
    assert any(tokens(a) != tokens(b) for a, b in zip(plain, bad))


def test_quantized_kv_rows_speculate_and_roll_back_packed(tiny_models):
    from mlxb.cache.kv_plan import KVScheme

    model, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts(3)
    for bits in (8, 4):
        kw = {"kv_scheme": KVScheme(bits, 32, 0)}
        plain, _ = run(model, tok, prompts, [0, 2, 5, 9], 3, 30, **kw)
        spec, eng = run(model, tok, prompts, [0, 2, 5, 9], 3, 30, spec=SPEC, **kw)
        assert [tokens(a) for a in plain] == [tokens(b) for b in spec]
        assert eng.spec_stats()["accepted"] > 0


def test_eos_and_max_tokens_inside_an_accepted_block(tiny_models):
    """A row ends at the EOS or the max_tokens that falls inside a verify block, exactly where plain
    decoding ends it; nothing after it is delivered or counted."""
    model, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts()[:1]
    ref, _ = run(model, tok, prompts, [0], 2, 40, spec=SPEC)
    toks = tokens(ref[0])
    eos = toks[9]  # the row's own 10th token becomes its end of sequence
    cut = toks.index(eos)
    plain, _ = run(model, tok, prompts, [0], 2, 40, eos=[eos])
    spec, eng = run(model, tok, prompts, [0], 2, 40, spec=SPEC, eos=[eos])
    assert tokens(plain[0]) == tokens(spec[0]) == toks[:cut]
    assert spec[0][-1].finish_reason == "stop" and spec[0][-1].usage["completion_tokens"] == cut
    for n in (1, 2, 7, 13):
        out, _ = run(model, tok, prompts, [0], 2, n, spec=SPEC)
        assert tokens(out[0]) == toks[:n] and out[0][-1].finish_reason == "length"


def test_rows_with_and_without_speculation_share_the_batch(tiny_models):
    model, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts()
    eng = Engine(model, tok, max_batch=4, prefill_chunk=16, spec=SPEC)
    reqs = [Request(f"r{i}", p, 25, SamplingParams(), ignore_eos=True, num_draft_tokens=0 if i % 2 else None)
            for i, p in enumerate(prompts)]
    for r in reqs:
        eng.accept(r, OutputStream(r.request_id))
    while eng._live:
        eng.iterate()
    assert [r.spec_drafted for r in reqs][1::2] == [None, None]  # off: no speculation fields at all
    assert all(r.spec_drafted is not None for r in reqs[::2]) and eng.spec_stats()["drafted"] > 0
    plain, _ = run(model, tok, prompts, [0, 0, 0, 0], 4, 25, sp=SamplingParams())
    assert [r.num_generated for r in reqs] == [25] * 4
    assert all(len(tokens(p)) == 25 for p in plain)


def test_penalty_rows_take_the_processor_path_and_stay_identical(tiny_models):
    model, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts()
    sp = SamplingParams(repetition_penalty=1.3, repetition_context_size=8, logprobs=True)
    plain, _ = run(model, tok, prompts, [0, 2, 5, 9], 3, 20, sp=sp)
    spec, eng = run(model, tok, prompts, [0, 2, 5, 9], 3, 20, spec=SPEC, sp=sp)
    assert [tokens(a) for a in plain] == [tokens(b) for b in spec]


def test_models_that_cannot_roll_back_decode_plainly_and_say_why(tiny_models):
    model, tok = tiny_models("tiny-gemma3")[:2]
    prompts = repetitive_prompts()[:2]
    plain, _ = run(model, tok, prompts, [0, 1], 2, 12)
    spec, eng = run(model, tok, prompts, [0, 1], 2, 12, spec=SPEC)
    st = eng.spec_stats()
    assert not st["active"] and "rotating" in st["off_reason"] and st["verify_steps"] == 0
    assert [tokens(a) for a in plain] == [tokens(b) for b in spec]


def test_seeded_sampled_rows_repeat_with_speculation(tiny_models):
    model, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts()
    sp = SamplingParams(temperature=0.7, seed=11)
    a, _ = run(model, tok, prompts, [0, 2, 5, 9], 4, 20, spec=SPEC, sp=sp)
    b, _ = run(model, tok, prompts, [0, 2, 5, 9], 4, 20, spec=SPEC, sp=sp)
    assert [tokens(x) for x in a] == [tokens(y) for y in b]


@pytest.mark.parametrize("draft", [0, 2, 5])
def test_sampling_rule_keeps_the_target_distribution(draft):
    """Temperature 1, a fixed draft: over many seeds the accepted-or-resampled token follows the
    target's distribution (chi-square), for a likely, an unlikely and a filtered-out (top_k) draft."""
    from scipy.stats import chisquare

    from mlxb.engine.sampler import RowSampler

    logits = mx.array([[2.0, 0.5, 1.5, -1.0, 0.0, -3.0]])
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    n = 3000
    counts = np.zeros(6)
    for seed in range(n):
        s = RowSampler(SamplingParams(temperature=1.0, top_k=5, seed=seed))
        t, _ = accept_sampled(s, lp, draft)
        counts[t] += 1
    target = np.array(mx.softmax(RowSampler(SamplingParams(temperature=1.0, top_k=5)).draw_logits(lp), axis=-1))[0]
    assert counts[5] == 0 and target[5] == 0  # top_k removed the least likely token (draft 5 always rejected)
    expected = target[:5].astype(np.float64) / target[:5].astype(np.float64).sum() * counts[:5].sum()
    assert chisquare(counts[:5], expected).pvalue > 1e-3


# ---- --spec draft (--draft-model) ---------------------------------------------------------------
def test_speculation_pauses_while_the_batch_is_larger_than_spec_max_batch(tiny_models, monkeypatch):
    import mlxb.spec.verify as S

    model, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts()
    sizes, real = [], S.verify_step
    monkeypatch.setattr(S, "verify_step", lambda r, props: (sizes.append(len(r.rows)), real(r, props))[1])
    plain, _ = run(model, tok, prompts, [0, 0, 0, 0], 4, [20, 30, 40, 50])
    out, wide = run(model, tok, prompts, [0, 0, 0, 0], 4, [20, 30, 40, 50], spec=SpecConfig("lookup", 4, 3, max_batch=2))
    assert sizes and max(sizes) <= 2  # verify steps only once rows retired down to two
    assert [tokens(a) for a in plain] == [tokens(b) for b in out]
    _, alone = run(model, tok, prompts, [0, 0, 0, 0], 4, [20, 30, 40, 50], spec=SpecConfig("lookup", 4, 3, max_batch=1))
    assert alone.spec_stats()["verify_steps"] > 0


def test_holes_compacted_every_step_change_no_token(tiny_models, monkeypatch):
    """Rejected entries stay as masked holes; compacting them into the left padding at every step (the
    bound at zero) gives the same tokens as leaving them until rows retire."""
    import mlxb.spec.rows as S

    model, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts()
    lazy, _ = run(model, tok, prompts, [0, 2, 5, 9], 4, 30, spec=SPEC)
    monkeypatch.setattr(S, "HOLE_MIN", 0)
    monkeypatch.setattr(S, "HOLE_FRACTION", 10**9)
    eager, _ = run(model, tok, prompts, [0, 2, 5, 9], 4, 30, spec=SPEC)
    assert [tokens(a) for a in lazy] == [tokens(b) for b in eager]


def test_warm_up_runs_verify_steps_then_leaves_the_engine_clean(tiny_models):
    from mlxb.engine.warmup import warm_up

    model, tok = tiny_models("tiny-llama")[:2]
    eng = Engine(model, tok, max_batch=4, prefill_chunk=16, spec=SpecConfig("lookup", 4, 3, max_batch=2))
    stats = warm_up(eng)
    assert stats["verify_steps"] > 0
    assert eng.spec_stats()["verify_steps"] == 0 and not eng._live and eng.counters["steps"] == 0
    assert eng.runner.proposer.__class__.__name__ == "LookupProposer"


def test_warm_up_verifies_even_where_this_machines_step_costs_shut_the_bar(tiny_models):
    """Warm-up's verify steps do not hang on the measured cost: a machine whose first-shape compiles made
    verify steps look 30x a plain one (planted here) still compiles them (CI once got none)."""
    from mlxb.engine.warmup import warm_up

    model, tok = tiny_models("tiny-llama")[:2]
    eng = Engine(model, tok, max_batch=4, prefill_chunk=16, spec=SpecConfig("lookup", 4, 3, max_batch=2))
    cost = eng.runner.step_cost
    for rows in (1, 2):
        for aligned in (False, True):
            for _ in range(16):
                cost.observe(False, 0.001, rows, aligned=aligned)
        cost.observe(True, 0.030, rows)  # 30 plain steps: under the cap, so it is sampled
    assert cost.ratio_at(2) > 10 and cost.ratio_at(1) > 10
    stats = warm_up(eng)
    assert stats["verify_steps"] > 0
    assert eng.runner.step_cost is cost and not cost.sizes  # the engine's own, cleared


def test_adaptive_speculation_compacts_the_holes_when_the_batch_goes_plain(tiny_models):
    """With the adaptive controller, the first step that the bar makes plain compacts every batch layer's
    rejected entries (a step over holes pays the masked path); the output stays token-identical to plain
    decoding."""
    from mlxb.spec.verify import StepCost, prepare

    model, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts()
    eng = Engine(model, tok, max_batch=4, prefill_chunk=64, spec=SPEC)
    streams = []
    for i, p in enumerate(prompts):
        r = Request(f"h{i}", p, 30, SamplingParams(), ignore_eos=True)
        streams.append(OutputStream(r.request_id))
        eng.accept(r, streams[-1])
    r = eng.runner
    holed = lambda: [c for c, k in zip(r.caches, r.kinds) if k == "full" and c.holes is not None]  # noqa: E731
    for _ in range(200):
        eng.iterate()
        if r.merged and len(r.rows) == 4 and holed():
            break
    assert holed(), "no verify step left holes"
    r.spec = SpecConfig("lookup", 4, 3, max_batch=8)  # adaptive from here on
    r.step_cost = StepCost()
    r.step_cost.observe(True, 1.0, rows=4)  # a verify step costs far more than any gain here
    for _ in range(StepCost.REFILL + 1):
        r.step_cost.observe(False, 0.001, rows=4)
    flushed, props = prepare(r)  # right after a verify step nothing is pending: nothing flushed
    assert props is None and not flushed and r.spec_why == "bar" and not holed()
    assert all(c.hole_counts is None for c, k in zip(r.caches, r.kinds) if k == "full")
    # the padding every row shares left the buffer, and the aligned flag follows the rows' lengths
    full = [c for c, k in zip(r.caches, r.kinds) if k == "full"]
    assert all(int(mx.min(c.left_padding).item()) == 0 for c in full)
    assert all(c.aligned == (len({row.base + r.num_steps for row in r.rows}) == 1) for c in full)
    while eng._live:
        eng.iterate()
    plain, _ = run(model, tok, prompts, [0, 0, 0, 0], 4, 30, sp=SamplingParams())
    for a, s in zip(plain, streams):
        got = []
        while not s._q.empty():
            x = s._q.get()
            if hasattr(x, "request_id") and x.token is not None:
                got.append(x.token)
        assert tokens(a) == got


def test_verify_steps_have_the_buffer_pool_checked(tiny_models, monkeypatch):
    """A run of verify steps only (fixed K, every draft wrong, no prefill after the start) still has MLX's buffer
    pool checked against its slack as plain steps do (``VERIFY_TRIM_STEPS``): without it the pool of an H100's
    fixed-K arm grew until the device ran out of memory."""
    import mlxb.engine.engine as engine_mod
    from mlxb.spec.rows import VERIFY_TRIM_STEPS

    class Wrong:  # always drafts, never right: every step is a verify step that keeps one token
        shadows = False

        def propose(self, history, k):
            return [3] * k

    model, tok, _, _ = tiny_models("tiny-llama")
    eng = Engine(model, tok, max_batch=2, prefill_chunk=64, spec=SPEC)
    eng.runner.proposer = Wrong()
    checks = []
    monkeypatch.setattr(engine_mod, "trim_allocator_cache", lambda keep=0: checks.append(eng.runner.num_steps))
    rng = np.random.default_rng(4)
    for i in range(2):
        r = Request(f"r{i}", rng.integers(5, 8000, size=20).tolist(), 3 * VERIFY_TRIM_STEPS, ignore_eos=True)
        eng.accept(r, OutputStream(r.request_id))
    while eng._live and eng.runner.num_steps < 2:  # prefill (which asks for a check) and the first steps
        eng.iterate()
    checks.clear()
    verify_before = eng.runner.spec_counts["verify_steps"]
    while eng._live:
        eng.iterate()
    verified = eng.runner.spec_counts["verify_steps"] - verify_before
    assert verified >= 2 * VERIFY_TRIM_STEPS
    assert len(checks) >= verified // VERIFY_TRIM_STEPS - 1, (checks, verified)
