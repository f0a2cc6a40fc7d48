"""Pipelined verify steps for a lone greedy row (``--spec-pipeline``, ``mlxb.spec.ahead``): the
next verify step is launched before the current one is read. Greedy output stays token-identical to
plain decoding through kept, dropped and cancelled guesses (joins, retirements, EOS and max_tokens in a
block, the prompt cache storing a row that had a step in flight); a planted cancel that leaves the
guessed step's entries in the caches fails; ``auto`` leaves CPUs alone."""

from dataclasses import replace

import pytest

from mlxb.cache.prompt_cache import PromptCache
from mlxb.spec import ahead as spec_ahead
from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.request import Request

from tests.tiny.test_spec import SPEC, repetitive_prompts, run, tokens

ON = replace(SPEC, pipeline="on")


def counts(eng):
    st = eng.spec_stats()
    return st["pipelined_kept"], st["pipelined_dropped"], st["pipelined_cancelled"]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-glm-mla"])
def test_a_lone_row_is_token_identical_with_guesses_kept_and_dropped(tiny_models, name):
    model, tok = tiny_models(name)[:2]
    kept = dropped = 0
    for p in repetitive_prompts():
        plain, _ = run(model, tok, [p], [0], 2, 60)
        spec, eng = run(model, tok, [p], [0], 2, 60, spec=ON)
        assert tokens(plain[0]) == tokens(spec[0]) and len(tokens(spec[0])) == 60
        assert max(abs(x.logprob.logprob - y.logprob.logprob) for x, y in zip(plain[0], spec[0]) if x.logprob) < 1e-4
        kept, dropped = kept + counts(eng)[0], dropped + counts(eng)[1]
    assert kept > 0 and dropped > 0  # guesses held, and others failed (rolled back with the rejected tail)


def test_joins_and_retirements_cancel_the_step_in_flight(tiny_models):
    model, tok = tiny_models("tiny-llama")[:2]
    pr = repetitive_prompts()
    prompts, arrive, max_tokens = [pr[2], pr[0], pr[1]], [0, 16, 17], [120, 10, 12]  # two join a lone row in flight
    plain, _ = run(model, tok, prompts, arrive, 4, max_tokens)
    spec, eng = run(model, tok, prompts, arrive, 4, max_tokens, spec=ON)
    assert [tokens(a) for a in plain] == [tokens(b) for b in spec]
    kept, _, cancelled = counts(eng)
    assert kept > 0 and cancelled > 0


def test_planted_cancel_that_keeps_the_guessed_entries_fails(tiny_models, monkeypatch):
    model, tok = tiny_models("tiny-llama")[:2]
    pr = repetitive_prompts()
    prompts, arrive, max_tokens = [pr[2], pr[0], pr[1]], [0, 16, 17], [120, 10, 12]  # two join a lone row in flight
    plain, _ = run(model, tok, prompts, arrive, 4, max_tokens)

    def forget(r):  # planted: the step in flight is forgotten, its cache entries stay
        if r.ahead is not None:
            r.ahead = None
            r.spec_counts["pipelined_cancelled"] += 1

    monkeypatch.setattr("mlxb.engine.runner.cancel_ahead", forget)
    spec, eng = run(model, tok, prompts, arrive, 4, max_tokens, spec=ON)
    assert counts(eng)[2] > 0
    assert [tokens(a) for a in plain] != [tokens(b) for b in spec]


def test_eos_and_max_tokens_inside_a_pipelined_block(tiny_models):
    model, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts()[:1]
    ref, _ = run(model, tok, prompts, [0], 2, 40)
    toks = tokens(ref[0])
    eos = toks[17]
    cut = toks.index(eos)
    spec, eng = run(model, tok, prompts, [0], 2, 40, spec=ON, eos=[eos])
    assert tokens(spec[0]) == toks[:cut] and spec[0][-1].finish_reason == "stop"
    for n in (2, 9, 14, 29):
        out, eng = run(model, tok, prompts, [0], 2, n, spec=ON)
        assert tokens(out[0]) == toks[:n] and out[0][-1].finish_reason == "length"
        assert eng.runner.ahead is None and not eng.runner.rows


def test_the_prompt_cache_stores_a_pipelined_row_at_its_true_length(tiny_models):
    """A row that ends (EOS) with a guessed step in flight is stored without that step's entries: a
    follow-up whose prompt extends the first conversation reuses it and decodes what a cold engine does."""
    model, tok = tiny_models("tiny-llama")[:2]
    p = repetitive_prompts()[0]
    ref, _ = run(model, tok, [p], [0], 2, 60)
    eos = tokens(ref[0])[43]  # ends the row inside a pipelined run of verify steps (found by a scan)

    def ask(eng, prompt, n):
        r = Request(f"q{len(prompt)}-{n}", prompt, n)
        st = OutputStream(r.request_id)
        eng.accept(r, st)
        while eng._live:  # driven here: a finished row is stored before the loop ends
            eng.iterate()
        out = []
        while not st._q.empty():
            x = st._q.get()
            if getattr(x, "token", None) is not None:
                out.append(x.token)
        return out, r

    outs = {}
    for mode in ("cold", "warm"):
        eng = Engine(model, tok, max_batch=2, prefill_chunk=16, spec=ON)
        eng.eos_ids = eng.delivery.eos_ids = {eos}
        if mode == "warm":
            eng.attach_prompt_cache(PromptCache(model, eng.kinds, max_bytes=1 << 30))
        first, _ = ask(eng, p, 60)
        cancelled = counts(eng)[2]
        if mode == "warm":  # every stored entry's caches hold exactly its tokens
            assert eng.prompt_cache.ram.entries()
            for e in eng.prompt_cache.ram.entries():
                assert {int(c.offset) for c in e.layers} == {e.num_tokens}
        second, r = ask(eng, p + first + p[:7], 25)
        outs[mode] = (first, second, r.cached_tokens, cancelled)
    assert outs["cold"][:2] == outs["warm"][:2]
    assert outs["warm"][3] > 0  # the row ended with a step in flight
    assert outs["warm"][2] >= len(p) + len(outs["warm"][0])  # and the stored conversation was reused


def test_auto_pipelines_only_on_a_gpu_backend(tiny_models, monkeypatch):
    model, tok = tiny_models("tiny-llama")[:2]
    p = repetitive_prompts()[:1]
    auto = replace(SPEC, pipeline="auto")
    _, eng = run(model, tok, p, [0], 2, 60, spec=auto)
    assert counts(eng) == (0, 0, 0) and eng.spec_stats()["verify_steps"] > 0  # this CPU: never
    monkeypatch.setattr(spec_ahead, "on_gpu", lambda: True)
    plain, _ = run(model, tok, p, [0], 2, 60)
    out, eng = run(model, tok, p, [0], 2, 60, spec=auto)
    assert tokens(out[0]) == tokens(plain[0]) and counts(eng)[0] > 0
    _, eng = run(model, tok, p, [0], 2, 60, spec=replace(SPEC, pipeline="off"))
    assert counts(eng) == (0, 0, 0)


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="--spec-pipeline"):
        replace(SPEC, pipeline="always")


def test_sampled_rows_are_never_pipelined_and_repeat_exactly(tiny_models):
    """The guess needs the greedy choice: a seeded sampled row takes the ordinary verify step under ``on``
    and gives the same tokens as with the pipeline off."""
    from mlxb.request import SamplingParams

    model, tok = tiny_models("tiny-llama")[:2]
    p = repetitive_prompts()[:1]
    # a low temperature: still a sampled row, close enough to the greedy loop of the repetitive prompt that its
    # lookups find drafts whatever the seed (at 0.7 a few seeds in ten drafted at all, under either draw method)
    sp = SamplingParams(temperature=0.1, seed=11)
    off, _ = run(model, tok, p, [0], 2, 40, spec=SPEC, sp=sp)
    on, eng = run(model, tok, p, [0], 2, 40, spec=ON, sp=sp)
    assert tokens(on[0]) == tokens(off[0]) and counts(eng) == (0, 0, 0)
    assert eng.spec_stats()["verify_steps"] > 0
