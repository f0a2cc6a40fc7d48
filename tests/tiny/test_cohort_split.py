"""Issue 46: a cohort of several body lengths prefills in groups of similar length (``cohort_split_min``), with the
tokens of one cohort; composed with quantized KV."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.request import Request


@pytest.mark.parametrize("split_min", [48, 0])
def test_a_cohort_of_two_lengths_prefills_in_two_groups_and_keeps_its_tokens(tiny_models, split_min):
    """Issue 46: a cohort's forward is padded to its longest body. Turns of two lengths admitted together (four
    of ~10 tokens, four of ~70) prefill as two groups when that saves ``cohort_split_min`` padded tokens, and
    every row still gives the tokens it gives alone. With the split off (the control) one forward is padded to
    the longest, which the padded-token count below tells apart."""
    model, tok, _, _ = tiny_models("tiny-llama")
    rng = np.random.default_rng(11)
    turns = [rng.integers(3, 8000, size=n).tolist() for n in (10, 71, 12, 69, 11, 70, 9, 72)]
    alone = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=5)] for p in turns]
    eng = Engine(model, tok, max_batch=8, prefill_chunk=1024, cohort_split_min=split_min)
    widths = []
    fwd = eng.runner.fwd

    def recording(rows, x, cache):
        if x.shape[1] > 1:  # a cohort's bodies (the held-back tokens' steps are one wide)
            widths.append(x.shape[0] * x.shape[1])
        return fwd(rows, x, cache)

    eng.runner.fwd = recording
    streams = {f"t{i}": OutputStream(f"t{i}") for i in range(len(turns))}
    for i, p in enumerate(turns):
        eng.accept(Request(f"t{i}", p, 5, ignore_eos=True), streams[f"t{i}"])
    first = eng.iterate()
    assert len(first.admitted) == len(turns)  # one iteration admits them all (an idle engine's burst)
    while any(k in eng._live for k in streams):
        eng.iterate()
    got = [[o.token for o in streams[f"t{i}"] if o.token is not None] for i in range(len(turns))]
    assert got == alone
    assert eng.counters["cohort_splits"] == (1 if split_min else 0)
    padded = sum(widths)
    assert (padded <= 4 * 11 + 4 * 71) if split_min else (padded == 8 * 71), widths


def _tokens(model, tok, turns, **kw):
    eng = Engine(model, tok, max_batch=8, prefill_chunk=1024, **kw)
    streams = {f"t{i}": OutputStream(f"t{i}") for i in range(len(turns))}
    for i, p in enumerate(turns):
        eng.accept(Request(f"t{i}", p, 5, ignore_eos=True), streams[f"t{i}"])
    while any(k in eng._live for k in streams):
        eng.iterate()
    return [[o.token for o in streams[f"t{i}"] if o.token is not None] for i in range(len(turns))], eng


def test_a_split_cohort_with_quantized_kv_gives_the_tokens_of_one_cohort(tiny_models):
    """--kv-bits 8 rows (the packed batch layout, which ignores the merge's room) split by length as plain rows do."""
    from mlxb.cache.kv_plan import KVScheme

    model, tok, _, _ = tiny_models("tiny-llama")
    rng = np.random.default_rng(3)
    turns = [rng.integers(3, 8000, size=n).tolist() for n in (10, 71, 12, 69, 11, 70)]
    one, e1 = _tokens(model, tok, turns, kv_scheme=KVScheme(8, 32, 0), cohort_split_min=0)
    split, e2 = _tokens(model, tok, turns, kv_scheme=KVScheme(8, 32, 0), cohort_split_min=48)
    assert e1.counters["cohort_splits"] == 0 and e2.counters["cohort_splits"] == 1
    assert split == one
