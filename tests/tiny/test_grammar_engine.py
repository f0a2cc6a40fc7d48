"""Constrained rows in the engine: the serial path and the batch lane agree, mixed batches stay valid, and a
mask applied one step late (planted bug) breaks the output."""

import json
import re

import jsonschema
import numpy as np
import pytest

from mlxb.engine.engine import Engine
from mlxb.constrain.grammar import Grammars
from mlxb.engine.stream import OutputStream
from mlxb.request import Request, SamplingParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "s": {"enum": ["x", "yy", "zzz"]}},
          "required": ["n", "s"], "additionalProperties": False}
REGEX = r"(ab){3}!"


@pytest.fixture(scope="module")
def llama(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    return model, tok, Grammars(tok, model.args.vocab_size, sorted(tok.eos_token_ids))


def run(model, tok, grammars, specs, batch, faults=frozenset(), eng=None, reqs=None):
    """specs: (prompt, grammar or None, temperature, seed); returns (text, finish reason) per request.
    ``eng``: an engine to use instead of a plain one; ``reqs``: a list that receives the requests."""
    eng = eng or Engine(model, tok, max_batch=batch, faults=faults)
    streams = []
    for i, (prompt, grammar, temp, seed) in enumerate(specs):
        r = Request(f"g{i}", prompt, 40, SamplingParams(temperature=temp, seed=seed))
        r.constraint = grammars.constraint(grammar, "test") if grammar else None
        r.mechanism = "continuous" if batch > 1 else "serial"
        streams.append(OutputStream(r.request_id))
        if reqs is not None:
            reqs.append(r)
        eng.accept(r, streams[-1])
    while eng._live or eng._serial:
        eng.iterate()
    out = []
    for st in streams:
        recs = list(st)
        out.append((tok.decode([o.token for o in recs if o.token is not None and o.token not in tok.eos_token_ids]),
                    recs[-1].finish_reason))
    return out


def test_serial_path_and_batch_lane_give_the_same_constrained_text(llama):
    model, tok, g = llama
    gs = g.validate(g.from_schema(SCHEMA, "s"), "s")
    for temp, seed in ((0.0, None), (0.9, 7)):
        spec = [(list(range(20, 60)), gs, temp, seed)]
        serial = run(model, tok, g, spec, batch=1)
        lane = run(model, tok, g, spec, batch=4)
        assert serial == lane
        jsonschema.validate(json.loads(serial[0][0]), SCHEMA)
        assert serial[0][1] == "stop"


def test_mixed_batch_rows_are_valid_and_unconstrained_rows_run_free(llama):
    model, tok, g = llama
    gs, gr = g.validate(g.from_schema(SCHEMA, "s"), "s"), g.validate(g.from_regex(REGEX, "r"), "r")
    specs = [(list(range(10 + i, 40 + 2 * i)), [gs, None, gr, None][i % 4], [0.0, 0.7][i % 2], i) for i in range(8)]
    out = run(model, tok, g, specs, batch=8)
    for i, (text, reason) in enumerate(out):
        if i % 4 == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
            assert reason == "stop"
        elif i % 4 == 2:
            assert re.fullmatch(REGEX, text) and reason == "stop"
        else:
            assert reason == "length"


def test_a_mask_one_step_late_breaks_the_output(llama):
    """Negative control: the batch lane must advance a row's matcher with the token it sampled before it
    builds that row's next mask; with the order reversed the regex is not followed."""
    model, tok, g = llama
    gr = g.validate(g.from_regex(REGEX, "r"), "r")
    specs = [(list(range(30, 50)), gr, 0.0, None), (list(range(60, 75)), None, 0.0, None)]
    good = run(model, tok, g, specs, batch=4)
    bad = run(model, tok, g, specs, batch=4, faults=frozenset({"grammar_one_step_late"}))
    assert re.fullmatch(REGEX, good[0][0])
    assert not re.fullmatch(REGEX, bad[0][0])


def test_constrained_rows_with_quantized_kv(llama):
    """Grammar rows and --kv-bits together in one batch: every constrained reply is still valid."""
    from mlxb.cache.quantized import KVScheme

    model, tok, g = llama
    gs = g.validate(g.from_schema(SCHEMA, "s"), "s")
    eng = Engine(model, tok, max_batch=4, kv_scheme=KVScheme(4, 32, 0))
    streams = []
    for i in range(4):
        r = Request(f"q{i}", list(range(20 + i, 50 + 3 * i)), 40, SamplingParams(temperature=0.5 * (i % 2), seed=i))
        r.constraint = g.constraint(gs, "json") if i % 2 == 0 else None
        streams.append(OutputStream(r.request_id))
        eng.accept(r, streams[-1])
    while eng._live:
        eng.iterate()
    assert eng.counters["batched_steps"] > 0
    for i, st in enumerate(streams):
        recs = list(st)
        if i % 2 == 0:
            text = tok.decode([o.token for o in recs if o.token is not None and o.token not in tok.eos_token_ids])
            jsonschema.validate(json.loads(text), SCHEMA)


def test_constrained_rows_speculate_and_keep_their_grammar(llama):
    """--spec lookup on grammar rows: each position's mask follows the tokens before it, so greedy rows
    give plain decoding's text and seeded rows still match their grammar."""
    out, plain, reqs, eng = _constrained_spec_run(*llama)
    assert out[0] == plain[0] and out[1] == plain[1] and out[3] == plain[3]
    jsonschema.validate(json.loads(out[2][0]), ARRAY)
    assert re.fullmatch(LOOPING, out[1][0])
    assert eng.spec_stats()["verify_steps"] > 0
    assert any(r.spec_drafted for r in reqs[:2])  # the greedy constrained rows drafted (grammar-valid drafts only)
    assert any(r.spec_accepted for r in reqs[:2])  # ... and kept some through their per-position masks


ARRAY = {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "minItems": 10, "maxItems": 10}
LOOPING = r"(ab|cd){14}!"


def _constrained_spec_run(model, tok, g):
    """Greedy array and regex rows (output that repeats itself, so lookup finds drafts the grammar allows), a
    seeded array row and a free row, with lookup speculation and without."""
    from mlxb.spec.verify import SpecConfig

    ga = g.validate(g.from_schema(ARRAY, "s"), "s")
    gr = g.validate(g.from_regex(LOOPING, "r"), "r")
    prompts = [list(range(20, 60)), tok.encode("abcdab! " * 3, add_special_tokens=False), list(range(30, 50)) * 2]
    specs = [(prompts[0], ga, 0.0, None), (prompts[1], gr, 0.0, None), (prompts[2], ga, 0.9, 5), (prompts[1], None, 0.0, None)]
    plain = run(model, tok, g, specs, batch=4)
    eng, reqs = Engine(model, tok, max_batch=4, spec=SpecConfig("lookup", 4, 3, max_batch=8)), []
    out = run(model, tok, g, specs, batch=4, eng=eng, reqs=reqs)
    return out, plain, reqs, eng


def test_draft_masks_one_position_late_break_the_constrained_rows(llama, monkeypatch):
    """Negative control for the per-position masks of a verify step: each position masked with the state after
    one more draft (planted) changes the greedy constrained rows' text."""
    from mlxb.constrain.grammar import Constraint

    right = Constraint.draft_masks
    monkeypatch.setattr(Constraint, "draft_masks", lambda self, d: np.concatenate([right(self, d)[1:], right(self, d)[-1:]]))
    out, plain, reqs, eng = _constrained_spec_run(*llama)
    assert eng.spec_stats()["verify_steps"] > 0
    assert out[0] != plain[0] or out[1] != plain[1]


def test_a_kept_grammar_is_not_compiled_again_and_its_matchers_are_independent(llama):
    model, tok, _ = llama
    g = Grammars(tok, model.args.vocab_size, sorted(tok.eos_token_ids))
    gs = g.validate(g.from_schema(SCHEMA, "s"), "s")
    a = g.constraint(gs, "test")
    start = a.bitmask().copy()
    a.advance(tok.encode("{", add_special_tokens=False))
    assert (a.bitmask() != start).any()

    class NoCompile:  # a kept grammar reaches neither llguidance's validation nor its compiler
        class LLMatcher:
            def __init__(self, *args, **kw):
                raise AssertionError("compiled again")

            @staticmethod
            def validate_grammar(*args):
                raise AssertionError("validated again")

    real, g.ll = g.ll, NoCompile
    assert g.validate(gs, "s") == gs
    b, c = g.constraint(gs, "test"), g.constraint(gs, "test")
    assert (b.bitmask() == start).all()  # a copy of the unused matcher, not of a's
    b.advance(tok.encode('{"n', add_special_tokens=False))
    assert (c.bitmask() == start).all() and (b.bitmask() != a.bitmask()).any()
    g.ll, g.KEEP = real, 2
    for r in ("a+", "b+", "c+"):
        g.constraint(g.validate(g.from_regex(r, "r"), "r"), "test")
    assert len(g._matchers) == 2 and gs not in g._matchers  # least recently used out


def test_draft_walk_stops_at_a_forbidden_draft_or_the_grammar_end_and_leaves_the_matcher(llama):
    model, tok, g = llama
    c = g.constraint(g.validate(g.from_regex(REGEX, "r"), "r"), "test")
    ab, bang = tok.encode("ab", add_special_tokens=False), tok.encode("!", add_special_tokens=False)
    assert len(ab) == 1 and len(bang) == 1
    before = c.bitmask()
    assert c.allowed_drafts(ab * 3 + bang + ab) == 4  # nothing follows the "!" that completes (ab){3}!
    assert c.allowed_drafts(bang + ab) == 0 and c.allowed_drafts(ab + bang) == 1
    masks = c.draft_masks(ab * 3 + bang + ab)
    assert masks.shape[0] == 5 and (masks[0] == before).all()
    allowed = lambda m, t: bool((int(m[t // 32]) >> (t % 32)) & 1)
    assert allowed(masks[2], ab[0]) and not allowed(masks[3], ab[0]) and allowed(masks[3], bang[0])
    assert (c.bitmask() == before).all() and not c.done and c.consumed == 0  # rolled back


def test_grammar_threads_setting_gives_the_same_masks_and_refuses_bad_values(llama, monkeypatch):
    import mlxb.constrain.grammar as G

    model, tok, g = llama
    gs, gr = g.validate(g.from_schema(SCHEMA, "s"), "s"), g.validate(g.from_regex(REGEX, "r"), "r")
    rows = [g.constraint(gs, "json"), g.constraint(gr, "regex"), g.constraint(gs, "json")]
    rows[2].advance(tok.encode('{"', add_special_tokens=False))  # a row past its start: a different mask
    monkeypatch.setattr(G, "_EXECUTOR", [])
    default = G.batch_bitmask(rows)
    monkeypatch.setenv("MLXB_GRAMMAR_THREADS", "1")
    monkeypatch.setattr(G, "_EXECUTOR", [])
    one = G.batch_bitmask(rows)
    assert (default == one).all() and not (one[0] == one[2]).all()
    monkeypatch.setenv("MLXB_GRAMMAR_THREADS", "zero")
    with pytest.raises(ValueError, match="MLXB_GRAMMAR_THREADS"):
        G.grammar_threads()
