"""Fused projections (``--fuse-projections``, ``mlxb.models.fuse``): q/k/v and gate/up as one product each.
Forwards equal the unfused model's (prefill rows, batch rows, one row, 4-bit weights), greedy engine
output is unchanged with joins, a part fed another input than the group's first computes it anew, a
planted wrong column order fails, and unfuse gives the layers back."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlxb.engine.build import use_fused_projections
from mlxb.errors import ValidationError
from mlxb.models import load_model
from mlxb.models import fuse as F

from tests.tiny.test_spec import repetitive_prompts, run, tokens


def forwards(model):
    """A prefill of 6 tokens, a batch step of 3 rows, a one-row step: the logits of each (fresh caches)."""
    from mlx_lm.models.cache import make_prompt_cache

    a = model(mx.array([[5, 6, 7, 8, 9, 10]]), cache=make_prompt_cache(model))
    b = model(mx.array([[11], [12], [13]]))
    c = model(mx.array([[14]]))
    return a, b, c


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-gemma4", "tiny-qwen3.5", "tiny-minicpm", "tiny-glm-mla"])
def test_fused_forwards_equal_the_unfused_model(name):
    model = load_model(name)[0]  # its own copy: this test changes the modules
    before = forwards(model)
    params = {k for k, _ in tree_flatten(model.parameters())}
    n = F.fuse(model)
    assert n > 0
    assert any(".fused." in k for k, _ in tree_flatten(model.parameters()))
    for x, y in zip(before, forwards(model)):
        assert mx.allclose(x, y, atol=1e-5, rtol=1e-5).item() and (x.argmax(-1) == y.argmax(-1)).all().item()
    assert F.unfuse(model) == n
    assert {k for k, _ in tree_flatten(model.parameters())} == params
    for x, y in zip(before, forwards(model)):
        assert mx.array_equal(x, y).item()


def test_quantized_weights_fuse_too():
    model = load_model("tiny-llama")[0]
    nn.quantize(model, group_size=32, bits=4)
    before = forwards(model)
    assert F.fuse(model) > 0
    assert any(type(m) is nn.QuantizedLinear for _, m in model.named_modules() if _.endswith(".fused"))
    for x, y in zip(before, forwards(model)):
        assert mx.allclose(x, y, atol=1e-4, rtol=1e-4).item()


def test_a_planted_column_order_fails(monkeypatch):
    model = load_model("tiny-llama")[0]
    before = forwards(model)
    real = F._Group.__init__

    def swapped(self, sizes):  # planted: gate and up (equal widths) take each other's columns
        real(self, sizes)
        if len(set(sizes)) == 1:
            self.bounds = self.bounds[::-1]

    monkeypatch.setattr(F._Group, "__init__", swapped)
    F.fuse(model)
    assert not mx.allclose(before[1], forwards(model)[1], atol=1e-3).item()


def test_a_part_fed_another_input_computes_it_anew_and_one_row_takes_the_views(monkeypatch):
    model = load_model("tiny-llama")[0]
    attn = model.model.layers[0].self_attn
    wk = attn.k_proj.weight
    F.fuse(model)
    x1, x2 = mx.random.normal((2, 3, wk.shape[1])), mx.random.normal((2, 3, wk.shape[1]))
    attn.q_proj(x1)
    assert mx.allclose(attn.k_proj(x2), x2 @ wk.T, atol=1e-5).item()
    assert mx.allclose(attn.k_proj(x1), x1 @ wk.T, atol=1e-5).item()

    def no_product(*a, **k):
        raise AssertionError("a one-row input took the fused product")

    monkeypatch.setattr(F._Group, "part", no_product)
    one = mx.random.normal((1, 1, wk.shape[1]))
    assert mx.allclose(attn.k_proj(one), one @ wk.T, atol=1e-5).item()


def test_greedy_engine_output_is_unchanged_with_joins(tiny_models):
    base, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts()
    arrive, max_tokens = [0, 2, 5, 9], [20, 13, 17, 9]
    plain, _ = run(base, tok, prompts, arrive, 3, max_tokens)
    model = load_model("tiny-llama")[0]
    F.fuse(model)
    fused, _ = run(model, tok, prompts, arrive, 3, max_tokens)
    assert [tokens(a) for a in plain] == [tokens(b) for b in fused]


def test_refusals_name_the_fix():
    model = load_model("tiny-llama")[0]
    with pytest.raises(ValidationError, match="--adapters"):
        use_fused_projections(model, adapters=True)
    with pytest.raises(ValidationError, match="--tp"):
        use_fused_projections(model, tp=True)
    with pytest.raises(ValidationError, match="no block"):
        use_fused_projections(nn.Sequential(nn.Linear(4, 4)))
