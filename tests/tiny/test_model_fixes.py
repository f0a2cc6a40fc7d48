"""mlx-lm architectures whose code meets batching or quantized KV differently from the presets'."""

import mlx.core as mx
import numpy as np
import pytest

from mlxb.models.presets import _tiny
from mlxb.models.synth import build_model

GEMMA2 = dict(model_type="gemma2", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, query_pre_attn_scalar=32,
              attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=16)


def _padded_step(model, prompts):
    """Prefill each prompt alone, merge the rows (left padding) and run one decode step of the batch
    through mlx-lm's own caches; returns the batch's last-position logits and each row's alone."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    solo, alone = [], []
    for p in prompts:
        c = make_prompt_cache(model)
        model(mx.array(p)[None], cache=c)
        solo.append(c)
    nxt = [[7], [11], [13]][: len(prompts)]
    for p, t in zip(prompts, nxt):
        c = make_prompt_cache(model)
        alone.append(model(mx.array(p + t)[None], cache=c)[0, -1])
    caches = [BatchKVCache.merge([s[i] for s in solo]) for i in range(len(solo[0]))]
    out = model(mx.array(nxt), cache=caches)[:, -1]
    return out, mx.stack(alone)


@pytest.mark.parametrize("rows", [2, 3])
def test_gemma2_padded_batch_mask_gets_its_kv_head_axis(rows):
    """Gemma 2 folds query heads into (B, kv, repeats, L, S) scores: mlx-lm's (B, 1, L, S) batch mask lands
    on the wrong axis (silently wrong at B = kv heads = 2, an error at B = 3). After the fix each padded row
    gives what it gives alone (to float rounding); a second call patches nothing more."""
    from mlxb.models.model_fixes import fix_grouped_masks

    model = build_model(_tiny("g2", "gemma2", **GEMMA2))
    prompts = [[1, 2, 3, 4, 5, 6], [8, 9], [3, 4, 5, 6]][:rows]
    if rows == 2:  # the unfixed model: row 1's padding masks kv head 1 of every row
        out, alone = _padded_step(model, prompts)
        assert float(mx.abs(out - alone).max()) > 1e-3
    else:
        with pytest.raises(ValueError, match="broadcast"):
            _padded_step(model, prompts)
    assert fix_grouped_masks(model) == 2 and fix_grouped_masks(model) == 0  # once per module
    out, alone = _padded_step(model, prompts)
    np.testing.assert_allclose(np.array(out), np.array(alone), atol=1e-4)
    cls = type(model.model.layers[0].self_attn)
    assert cls.__module__ == "mlx_lm.models.gemma2" and cls.__mro__[1].__module__ == "mlx_lm.models.gemma2"


def test_kv_bits_refused_at_start_up_for_attention_that_reads_keys_itself():
    """Gemma 2 computes softcapped scores itself, so it cannot read packed keys (mlx-lm's kv_bits fails on it
    too): the engine refuses the scheme when it is built, naming the attention and the fix, instead of
    failing every request; a Llama preset with the same scheme builds."""
    from mlxb.cache.kv_plan import KVScheme
    from mlxb.cache.protocol import kv_projection, layer_kinds
    from mlxb.models.presets import PRESETS

    model = build_model(_tiny("g2", "gemma2", **GEMMA2))
    with pytest.raises(ValueError, match=r"gemma2\.Attention\) cannot read a quantized cache.*without --kv-bits"):
        kv_projection(model, layer_kinds(model), KVScheme(8, 32, 0))
    llama = build_model(PRESETS["tiny-llama"])
    assert kv_projection(llama, layer_kinds(llama), KVScheme(8, 32, 0)).layers


def test_speculation_on_a_serial_only_model_is_off_with_a_reason():
    """A model with a layer cache the batch does not hold is served on the serial lane: with --spec the engine
    starts and says why it does not speculate (it raised a TypeError at start-up before). Falcon-H1 as mlx-lm
    builds it (``CacheList`` layers) stands for one here; ``load_model`` flattens those lists, so served
    Falcon-H1 batches (next test)."""
    from mlxb.cache.protocol import layer_kinds
    from mlxb.spec.verify import SpecConfig, setup

    cfg = dict(model_type="falcon_h1", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
               mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
               mamba_expand=2, mamba_chunk_size=16)
    kinds = layer_kinds(build_model(_tiny("fh1", "falcon_h1", **cfg)))
    assert None in kinds
    spec, off, proposer = setup(SpecConfig(), kinds)
    assert proposer is None and "serial lane only" in off


def test_cache_list_layers_flattened_and_grouped_around_the_same_objects():
    """``FlatCacheModel`` gives the engine one plain cache per part and groups the very same objects back
    into CacheLists for the model, so a forward through the flat list updates what the engine holds;
    its logits equal the model's own on its own CacheLists."""
    from mlx_lm.models.cache import CacheList

    from mlxb.cache.protocol import layer_kinds
    from mlxb.models.flat import FlatCacheModel, flatten_cache_lists

    cfg = dict(model_type="falcon_h1", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
               mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
               mamba_expand=2, mamba_chunk_size=16)
    raw = build_model(_tiny("fh1", "falcon_h1", **cfg))
    flat = flatten_cache_lists(raw)
    assert isinstance(flat, FlatCacheModel) and flatten_cache_lists(flat) is flat
    assert layer_kinds(flat) == ["ssm", "full", "ssm", "full"]
    caches = flat.make_cache()
    x = mx.array([[1, 2, 3, 4, 5]])
    ours = flat(x, cache=caches)
    assert caches[1].offset == 5 and caches[0][0] is not None  # the engine's objects were updated in place
    theirs = raw(x, cache=raw.make_cache())
    assert mx.array_equal(ours, theirs)
    grouped = flat.group(caches)
    assert isinstance(grouped[0], CacheList) and grouped[0][1] is caches[1]
    with pytest.raises(ValueError, match="3 layer caches"):
        flat.group(caches[:3])
    llama = build_model(_tiny("l", "llama", model_type="llama", hidden_size=64, num_hidden_layers=1,
                              intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6))
    assert flatten_cache_lists(llama) is llama  # no CacheList: the model itself
