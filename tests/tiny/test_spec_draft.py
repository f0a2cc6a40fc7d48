"""Speculative decoding with a draft model (--draft-model) on the batch lane: the target as its own draft keeps
every draft and changes no token, a batch of draft rows probes without having drafted alone, a lone row gives
mlx-lm's ``speculative_generate_step``, the draft's KV counts at admission, unusable drafts are refused, and
sampled drafts drawn from the draft's distribution keep the target's (chi-square)."""

import mlx.core as mx
import numpy as np
import pytest

from mlxb.engine.engine import Engine
from mlxb.spec.verify import SpecConfig, accept_sampled
from mlxb.request import SamplingParams
from tests.tiny.test_spec import repetitive_prompts, run, tokens


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_self_draft_accepts_everything_and_changes_no_token(tiny_models, batch):
    """The target as its own draft: every draft is the target's own choice (the mechanism's ceiling),
    with joins and retirements; a different draft model (tiny-llama drafting for tiny-minicpm) is
    mostly rejected and still changes no token."""
    target, tok = tiny_models("tiny-minicpm")[:2]
    other = tiny_models("tiny-llama")[0]
    prompts = repetitive_prompts()
    arrive, max_tokens = [0, 2, 5, 9], [40, 23, 31, 17]
    plain, _ = run(target, tok, prompts, arrive, batch, max_tokens)
    for draft, full in ((target, True), (other, False)):
        spec, eng = run(target, tok, prompts, arrive, batch, max_tokens, spec=SpecConfig("draft", 4, draft_model=draft, max_batch=8))
        assert [tokens(a) for a in plain] == [tokens(b) for b in spec]
        st = eng.spec_stats()
        assert st["drafted"] > 0 and (st["accepted"] == st["drafted"]) == full


def test_a_draft_models_batch_probes_without_having_drafted_alone(tiny_models):
    """Adaptive speculation with a draft model, an idle cohort of four (prefilled together, never alone): its rows have
    no check but a verify step, so they probe at the starting guess (before, they waited for evidence
    that only a lone row could get, and drafted nothing). The target as its own draft keeps every draft
    and changes no token."""
    target, tok = tiny_models("tiny-minicpm")[:2]
    prompts = [p[:12] for p in repetitive_prompts()]  # one chunk each, equal lengths: one aligned cohort
    plain, _ = run(target, tok, prompts, [0, 0, 0, 0], 4, 24)
    spec, eng = run(target, tok, prompts, [0, 0, 0, 0], 4, 24, spec=SpecConfig("draft", 4, draft_model=target, max_batch=8))
    assert [tokens(a) for a in plain] == [tokens(b) for b in spec]
    st = eng.spec_stats()
    assert st["verify_steps"] > 0 and st["drafted"] > 0 and st["accepted"] == st["drafted"], st
    assert [n for why, n, *rest in eng.runner.step_cost.trace if why == "verify"].count(4) > 0, eng.runner.step_cost.trace


def test_lone_row_matches_mlx_lm_speculative_generate_step(tiny_models):
    from mlx_lm.generate import speculative_generate_step

    target, tok = tiny_models("tiny-minicpm")[:2]
    draft = tiny_models("tiny-llama")[0]
    for p in repetitive_prompts()[:2]:
        ref = [int(t) for t, _, _ in speculative_generate_step(mx.array(p), target, draft, num_draft_tokens=3,
                                                                 max_tokens=30, prefill_step_size=16)]
        ours, _ = run(target, tok, [p], [0], 2, 30, spec=SpecConfig("draft", 3, draft_model=draft, max_batch=8))
        assert tokens(ours[0]) == ref


def test_draft_models_that_cannot_serve_are_refused(tiny_models):
    from mlxb.engine.build import build_spec
    from mlxb.errors import ValidationError

    target, tok = tiny_models("tiny-llama")[:2]
    with pytest.raises(ValidationError, match="cannot roll back rejected"):
        build_spec(target, tok, "draft", 4, 3, "tiny-gemma3", None)
    with pytest.raises(ValidationError, match="needs --draft-model"):
        build_spec(target, tok, "draft", 4, 3, None, None)
    with pytest.raises(ValidationError, match="choose one of"):
        build_spec(target, tok, "medusa", 4, 3, None, None)


def test_draft_model_kv_counts_at_admission(tiny_models):
    target, tok = tiny_models("tiny-minicpm")[:2]
    draft = tiny_models("tiny-llama")[0]
    alone = Engine(target, tok, max_batch=4).projection.row_bytes(1000)
    with_draft = Engine(target, tok, max_batch=4, spec=SpecConfig("draft", 4, draft_model=draft)).projection.row_bytes(1000)
    draft_only = Engine(draft, tok, max_batch=4).projection.row_bytes(1000)
    assert with_draft == alone + draft_only


def test_drafts_drawn_from_the_drafts_distribution_keep_the_targets():
    """A draft d drawn from q, kept with probability min(1, pi(d)/q(d)), else a draw from max(pi - q, 0):
    the output follows pi (chi-square) and more drafts are kept than by the point-mass rule. Told the
    wrong q (uniform, while d came from a peaked q), the same test fails: it can tell."""
    from scipy.stats import chisquare

    from mlxb.engine.sampler import RowSampler

    lp = mx.array([[2.0, 0.5, 1.5, -1.0, 0.0, -3.0]])
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    pi = np.array(mx.softmax(lp, axis=-1))[0].astype(np.float64)
    near = np.array(mx.softmax(mx.array([[1.5, 0.8, 1.5, -0.5, 0.2, -2.0]]), axis=-1))[0]
    peaked = np.array(mx.softmax(mx.array([[0.0, 0.0, 0.0, 0.0, 4.0, 0.0]]), axis=-1))[0]

    def trial(q_draw, q_told, n=3000):
        rng = np.random.default_rng(0)
        counts, kept = np.zeros(6), 0
        for seed in range(n):
            d = int(rng.choice(6, p=q_draw / q_draw.sum()))
            q = None if q_told is None else mx.array(q_told.astype(np.float32))
            t, ok = accept_sampled(RowSampler(SamplingParams(temperature=1.0, seed=seed)), lp, d, q)
            counts[t] += 1
            kept += ok
        return chisquare(counts, pi / pi.sum() * n).pvalue, kept / n

    p_q, kept_q = trial(near, near)
    p_point, kept_point = trial(near, None)
    assert p_q > 1e-3 and p_point > 1e-3 and kept_q > kept_point + 0.1, (kept_q, kept_point)
    assert trial(peaked, np.full(6, 1 / 6))[0] < 1e-6


def test_sampled_rows_keep_every_self_draft(tiny_models):
    """The target as its own draft at temperature 0.8: each draft is drawn from the distribution the
    verify step computes, so pi/q is 1 and every draft is kept (the point-mass rule keeps only a
    fraction); a seed repeats."""
    model, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts()
    sp = SamplingParams(temperature=0.8, seed=5)
    cfg = SpecConfig("draft", 4, draft_model=model, max_batch=8, adaptive=False)
    a, eng = run(model, tok, prompts, [0, 1, 2, 3], 4, 24, spec=cfg, sp=sp)
    st = eng.spec_stats()
    assert st["drafted"] > 40 and st["accepted"] == st["drafted"], st
    b, _ = run(model, tok, prompts, [0, 1, 2, 3], 4, 24, spec=cfg, sp=sp)
    assert [tokens(x) for x in a] == [tokens(y) for y in b]
