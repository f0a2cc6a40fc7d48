"""``mlxb.kernels.causal_split``: a short causal attention cut into chunks of at most 3 queries, each over the
keys it can see, must equal MLX's unsplit causal call and each query's own one-query call (here on the CPU,
where both take MLX's fallback; on CUDA the chunks take the vector kernel). A planted off-by-one in the keys a
chunk sees must fail. ``install`` changes nothing off CUDA unless forced, and uninstall restores MLX's call."""

import mlx.core as mx
import pytest

from mlxb.kernels import causal_split as cs


def qkv(B, H, G, qL, kL, D=64, seed=0):
    ks = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((B, H * G, qL, D), key=ks[0]), mx.random.normal((B, H, kL, D), key=ks[1]),
            mx.random.normal((B, H, kL, D), key=ks[2]))


@pytest.mark.parametrize("B,H,G,qL,kL", [(1, 2, 4, 5, 40), (2, 2, 1, 9, 300), (1, 1, 2, 4, 4), (1, 2, 2, 33, 70)])
def test_split_equals_the_unsplit_call_and_each_query_alone(B, H, G, qL, kL):
    q, k, v = qkv(B, H, G, qL, kL, seed=qL + kL)
    got = cs.split_causal(q, k, v, scale=0.125)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert mx.allclose(got, want, atol=1e-6).item()
    alone = mx.concatenate([mx.fast.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :kL - qL + i + 1],
                                                                 v[:, :, :kL - qL + i + 1], scale=0.125)
                            for i in range(qL)], axis=2)
    assert mx.allclose(got, alone, atol=1e-6).item()


def test_a_chunk_seeing_one_key_too_many_fails():
    q, k, v = qkv(1, 2, 2, 5, 40)

    def leaky(q, k, v, *, scale, mask):  # each chunk also sees the key after its last query's
        n = k.shape[2]
        return mx.fast.scaled_dot_product_attention(q, k_all[:, :, :n + 1], v_all[:, :, :n + 1], scale=scale, mask=mask)

    k_all, v_all = mx.concatenate([k, k[:, :, :1]], axis=2), mx.concatenate([v, v[:, :, :1]], axis=2)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert not mx.allclose(cs.split_causal(q, k, v, scale=0.125, sdpa=leaky), want, atol=1e-4).item()


def test_applies_to_short_causal_calls_only():
    q, k, _ = qkv(1, 2, 1, 5, 40)
    assert cs.applies(q, k, "causal", None)
    assert not cs.applies(q, k, None, None) and not cs.applies(q, k, mx.ones((5, 40), dtype=mx.bool_), None)
    assert not cs.applies(q[:, :, :3], k, "causal", None)  # the vector kernel takes up to 3 as it is
    q_long, k_long, _ = qkv(1, 2, 1, cs.MAX_QUERIES + 1, 100)
    assert not cs.applies(q_long, k_long, "causal", None)  # a prefill chunk
    assert not cs.applies(q, k, "causal", mx.zeros((2,)))  # sinks


def test_install_is_cuda_only_unless_forced_and_uninstall_restores():
    original = mx.fast.scaled_dot_product_attention
    if not cs.available():
        assert cs.install() is None and mx.fast.scaled_dot_product_attention is original
    try:
        assert cs.install(force=True) is not None
        assert mx.fast.scaled_dot_product_attention is not original
        q, k, v = qkv(1, 2, 2, 6, 30)
        got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
        assert mx.allclose(got, original(q, k, v, scale=0.125, mask="causal"), atol=1e-6).item()
    finally:
        cs.uninstall()
    assert mx.fast.scaled_dot_product_attention is original
