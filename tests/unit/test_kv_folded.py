"""Where mlx-lm's grouped-query quantized read is wrong on a backend (MLX's CUDA backend: its broadcast
query-head axis), the probe says so and the engine's quantized layers read through ``folded_attention``
(the same arithmetic with the query heads folded into the matmul rows). Here a planted mlx-lm path with
the same kind of fault stands in for that backend: the probe catches it, the folded route gives the
clean run's tokens and logprobs bit for bit, and without the route the fault reaches the rows."""

import mlx.core as mx
import mlx_lm.models.base as base
import numpy as np
import pytest

from mlxb.kernels import quantized_attention as qa
from mlxb.kernels import quantized_paths as qp


def gqa_fault(original):
    def broken(queries, q_keys, q_values, scale, mask, group_size=64, bits=8):
        hkv = q_keys[0].shape[-3]
        if queries.shape[1] == hkv:
            return original(queries, q_keys, q_values, scale=scale, mask=mask, group_size=group_size, bits=bits)
        first = tuple(mx.repeat(x[:, :1], hkv, axis=1) for x in q_keys)  # every group scored on KV head 0
        return original(queries, first, q_values, scale=scale, mask=mask, group_size=group_size, bits=bits)
    return broken


@pytest.fixture
def planted(monkeypatch):
    from mlxb.cache import quantized_read

    monkeypatch.setattr(quantized_read, "_WHOLE", True)
    original = base.quantized_scaled_dot_product_attention
    original = getattr(original, "_mlxb_original", original)
    saved = base.quantized_scaled_dot_product_attention
    base.quantized_scaled_dot_product_attention = original
    try:
        yield original
    finally:
        base.quantized_scaled_dot_product_attention = saved
        qa._MODE, qa._ROUTE, qp._EXACT, qp._FOLD = "mlx-lm", None, None, None


def test_folded_read_is_mlx_lm_arithmetic():
    for B, hq, hkv, L, n, bits, group, mask in ((2, 8, 2, 1, 96, 8, 64, "bool"), (3, 16, 2, 5, 70, 4, 32, "bool"),
                                                (2, 8, 2, 7, 50, 4, 64, "causal"), (1, 4, 4, 1, 40, 8, 64, None)):
        q = mx.random.normal((B, hq, L, 64))
        qk, qv = (mx.quantize(mx.random.normal((B, hkv, n, 64)), group_size=group, bits=bits) for _ in range(2))
        m = (mx.random.uniform(shape=(B, 1, L, n)) > 0.3) if mask == "bool" else mask
        want = base.quantized_scaled_dot_product_attention(mx.array(q), qk, qv, scale=0.125, mask=m,
                                                           group_size=group, bits=bits)
        got = qp.folded_attention(q, qk, qv, 0.125, m, group, bits)
        assert mx.array_equal(got, want).item(), (B, hq, hkv, L, mask)


def test_probe_catches_a_wrong_grouped_query_read(planted):
    assert qp.probe()
    base.quantized_scaled_dot_product_attention = gqa_fault(planted)
    assert not qp.probe()


def test_engine_rows_route_around_a_wrong_read(tiny_models, planted, monkeypatch):
    from tests.tiny.test_quantized_kv import engine_rows, same

    model, tok = tiny_models("tiny-llama")[:2]  # 4 query heads over 2 KV heads
    prompts = [list(range(5, 35)), list(range(40, 57)), list(range(60, 110))]
    clean, seen, _ = engine_rows(model, tok, prompts, [0, 2, 3], 8, 0, 4, 12)
    assert seen["quantized_batch"]
    base.quantized_scaled_dot_product_attention = gqa_fault(planted)
    # a backend that trusts the read (and, unlike this CPU, keeps it): the fault reaches the rows
    monkeypatch.setenv("MLXB_KV_READ", "mlx-lm")
    qa._ROUTE, qp._EXACT, qp._FOLD = None, True, None
    hurt, _, _ = engine_rows(model, tok, prompts, [0, 2, 3], 8, 0, 4, 12)
    monkeypatch.delenv("MLXB_KV_READ")
    assert not all(same(a, b) for a, b in zip(clean, hurt))
    qa._ROUTE, qp._EXACT, qp._FOLD = None, qp.probe(), None  # what broadcast_exact() decides off the CPU
    assert qp._EXACT is False
    routed, _, _ = engine_rows(model, tok, prompts, [0, 2, 3], 8, 0, 4, 12)
    assert all(same(a, b) for a, b in zip(clean, routed))
    assert all(np.isfinite(v).all() for r in routed for _, v in r)
