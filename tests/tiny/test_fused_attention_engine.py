"""``--kv-attention fused`` through the engine: with the dense decode kernel's dispatch switched on and the kernel
itself run by the CPU emulation of its CUDA source (tests/unit/cuda_emulation.py), a batch of staggered rows
(left padding, rows joining and leaving) and a fleet that shares a prompt prefix decode the same tokens as MLX's
attention, with logits within float32 rounding, and the masked decode reads (or the shared prefix) took the kernel."""

import mlx.core as mx
import numpy as np
import pytest

from mlxb.cache import shared as shared_cache
from mlxb.kernels import dense_attention as da
from tests.tiny.test_shared_engine import _fleet, _serve
from tests.unit.test_dense_attention_emulated import emulated


DELAYS = [0, 0, 0.02, 0.04]  # two rows start together, two join while they decode: left-padded, masked batches


@pytest.fixture
def emulated_fused(monkeypatch):
    """Turn the dispatch on as ``set_enabled(True)`` would on CUDA, with the emulated kernel behind it."""
    calls = {"dense": 0, "prefix": 0, "queries>1": 0, "drop_mask": False}

    def run(q, k, v, scale, mask=None, prefix=None):
        calls["prefix" if prefix is not None else "dense"] += 1
        calls["queries>1"] += q.shape[2] > 1
        if calls["drop_mask"]:  # planted bug: the padding and holes are read as keys
            mask = None
        f = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
        pre = None if prefix is None else (f(prefix[0]), f(prefix[1]), None if prefix[2] is None else np.array(prefix[2]))
        out, _ = emulated(da._PART, f(q), f(k), f(v), scale, None if mask is None else np.array(mask), pre)
        return mx.array(out).astype(q.dtype)

    shared_cache.install()  # so that the wrap below sits in front of the shared-prefix dispatcher, as at start-up
    monkeypatch.setattr(da, "_ORIGINAL", mx.fast.scaled_dot_product_attention)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", da._dispatch)
    monkeypatch.setattr(da, "fused_decode", run)
    monkeypatch.setattr(da, "_ON", True)
    return calls


@pytest.mark.parametrize("name,share_min", [pytest.param("tiny-llama", None, marks=pytest.mark.full), ("tiny-llama", 64),
                                            pytest.param("tiny-gemma3", None, marks=pytest.mark.full)])
def test_fused_decode_attention_gives_the_same_tokens(name, share_min, tiny_models, emulated_fused):
    """tiny-gemma3: its sliding-window layers hand over a rotating buffer with its own mask."""
    model, tok, _, _ = tiny_models(name)
    ps = _fleet(n=3, prefix=160, seed=3)
    da._ON = False
    ref, ref_caps, _, _ = _serve(model, tok, ps, share_min, max_tokens=8, delays=DELAYS)
    assert emulated_fused["dense"] == emulated_fused["prefix"] == 0
    da._ON = True
    got, caps, _, stats = _serve(model, tok, ps, share_min, max_tokens=8, delays=DELAYS)
    assert got == ref
    assert max(float(np.abs(caps[k] - ref_caps[k]).max()) for k in ref_caps) < 1e-3
    # shared-prefix layers read the prefix as the kernel's chunks; otherwise every masked decode read took it
    assert emulated_fused["prefix" if share_min else "dense"] > 0, (emulated_fused, stats)


@pytest.mark.full
def test_a_dispatch_that_drops_the_mask_fails(tiny_models, emulated_fused):
    model, tok, _, _ = tiny_models("tiny-llama")
    ps = _fleet(n=3, prefix=160, seed=3)
    da._ON = False
    ref, ref_caps, _, _ = _serve(model, tok, ps, None, max_tokens=8, delays=DELAYS)
    da._ON, emulated_fused["drop_mask"] = True, True
    got, caps, _, _ = _serve(model, tok, ps, None, max_tokens=8, delays=DELAYS)
    assert got != ref or max(float(np.abs(caps[k] - ref_caps[k]).max()) for k in ref_caps) > 1e-2


@pytest.mark.full
def test_verify_steps_through_the_kernel_keep_greedy_tokens(tiny_models, emulated_fused):
    """Speculative verify steps (the pending token and its drafts per row, holes for rejected drafts) read through
    the kernel's several-query path: the greedy tokens equal plain decoding's."""
    from tests.tiny.test_spec import SPEC, repetitive_prompts, run, tokens

    model, tok = tiny_models("tiny-llama")[:2]
    prompts = repetitive_prompts()
    arrive, max_tokens = [0, 2, 5, 9], [30, 23, 26, 17]
    da._ON = False
    plain, _ = run(model, tok, prompts, arrive, 4, max_tokens)
    da._ON = True
    spec, eng = run(model, tok, prompts, arrive, 4, max_tokens, spec=SPEC)
    assert [tokens(o) for o in spec] == [tokens(o) for o in plain]
    assert eng.runner.spec_counts["verify_steps"] > 0 and emulated_fused["queries>1"] > 0
