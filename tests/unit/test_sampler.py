"""Batched draws (``sample_rows``): rows with the same sampling parameters draw together, each from its own key,
and give exactly the tokens, log-probs and next keys that drawing them one by one gives; mixed batches keep
every row's order; the draw is the target distribution (chi-square)."""

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from mlxb.engine.sampler import RowSampler, sample_rows
from mlxb.request import SamplingParams

V = 512


class _Row:
    def __init__(self, params: SamplingParams):
        self.sampler = RowSampler(params)
        self.context = None


def _rows(params: list[SamplingParams]) -> list[_Row]:
    return [_Row(p) for p in params]


def _one_by_one(rows, logits):
    toks, lps = [], []
    for i, r in enumerate(rows):
        if r.context is not None:
            r.context = mx.concatenate([r.context, mx.zeros(1, dtype=mx.uint32)])
        t, lp = r.sampler(r.context, logits[i : i + 1])
        toks.append(t.reshape(1))
        lps.append(lp)
    return mx.concatenate(toks), lps


MIXES = {
    "same": [SamplingParams(temperature=0.8, seed=s) for s in range(6)],
    "filters": [SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02, top_k=50, seed=s) for s in range(5)],
    "mixed": [SamplingParams(temperature=0.8, seed=1), SamplingParams(seed=0), SamplingParams(temperature=0.8, seed=2),
              SamplingParams(temperature=1.3, top_p=0.5, seed=3), SamplingParams(temperature=0.8, seed=4),
              SamplingParams(temperature=0.6, repetition_penalty=1.2, seed=5), SamplingParams(temperature=1.3, top_p=0.5, seed=6)],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_batched_draws_equal_drawing_row_by_row(mix):
    logits = mx.random.normal((len(MIXES[mix]), V), key=mx.random.key(9)) * 4
    a, b = _rows(MIXES[mix]), _rows(MIXES[mix])
    for r in a + b:
        if r.sampler.processors:
            r.context = mx.array([1, 2, 3], dtype=mx.uint32)
    for _ in range(4):  # several steps: the keys each row carries forward must agree too
        ta, la = sample_rows(a, mx.zeros(len(a), dtype=mx.uint32), logits)
        tb, lb = _one_by_one(b, logits)
        assert ta.tolist() == tb.tolist()
        assert all(mx.array_equal(x, y).item() for x, y in zip(la, lb))
    assert all(mx.array_equal(x.sampler._key, y.sampler._key).item() for x, y in zip(a, b))


def test_a_row_draws_the_same_whoever_shares_its_step():
    """A seeded row's tokens do not depend on its neighbours (their number, order or keys)."""
    logits = mx.random.normal((8, V), key=mx.random.key(3)) * 4
    alone = _rows([SamplingParams(temperature=1.0, seed=42)])
    crowd = _rows([SamplingParams(temperature=1.0, seed=s) for s in (7, 8, 42, 9)])
    x = logits[2:3]
    for _ in range(5):
        t1, _ = sample_rows(alone, mx.zeros(1, dtype=mx.uint32), x)
        t4, _ = sample_rows(crowd, mx.zeros(4, dtype=mx.uint32), mx.concatenate([logits[:2], x, logits[3:4]]))
        assert t1.item() == t4[2].item()


def test_batched_draws_follow_the_distribution():
    """2,000 rows with distinct seeds over one 6-token distribution at temperature 0.5: frequencies fit
    softmax(logits / 0.5) (chi-square); a planted draw at temperature 1 fails the same test."""
    base = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 2000
    rows = _rows([SamplingParams(temperature=0.5, seed=s) for s in range(n)])
    toks, _ = sample_rows(rows, mx.zeros(n, dtype=mx.uint32), mx.broadcast_to(base, (n, 6)))
    counts = np.bincount(np.array(toks), minlength=6)
    want = np.array(mx.softmax(base[0] / 0.5), dtype=np.float64)
    want /= want.sum()
    assert stats.chisquare(counts, want * n).pvalue > 1e-3
    wrong = np.array(mx.softmax(base[0]), dtype=np.float64)
    wrong /= wrong.sum()
    assert stats.chisquare(counts, wrong * n).pvalue < 1e-6  # the test can tell a wrong temperature
