"""--kv-attention: the fused quantized-KV kernel is CUDA only and selected per call by the cache's return
type; on any other backend it is refused with a message naming the fix, and mlx-lm's own quantized
reads (the parity oracle's) never take it. The kernel itself runs only on a CUDA GPU
(scripts/kv_fused_check.py measures it there)."""

import mlx.core as mx
import mlx_lm.models.base as base
import pytest
from typer.testing import CliRunner

from mlxb.commands.main import app
from mlxb.kernels import quantized_attention as qa

needs_no_cuda = pytest.mark.skipif(qa.fused_available(), reason="this backend has the fused kernel")


@needs_no_cuda
def test_fused_is_refused_off_cuda_with_the_fix(monkeypatch):
    with pytest.raises(ValueError, match="--kv-attention mlx-lm"):
        qa.set_kv_attention("fused")
    with pytest.raises(ValueError, match="choose one of"):
        qa.set_kv_attention("turbo")
    t = (mx.zeros(1),)
    try:  # with mlx-lm's read on one stream nothing is routed: the cache's reads stay plain tuples
        monkeypatch.setenv("MLXB_KV_READ", "mlx-lm")
        monkeypatch.setenv("MLXB_KV_SPLIT", "1")
        qa.set_kv_attention("mlx-lm")
        assert type(qa.mark(t)) is tuple
    finally:
        monkeypatch.delenv("MLXB_KV_READ")
        monkeypatch.delenv("MLXB_KV_SPLIT")
        qa.set_kv_attention("mlx-lm")
    if mx.default_device() == mx.cpu:  # the CPU folds (and splits) the engine's reads by default
        assert type(qa.mark(t)) is qa.Packed


@needs_no_cuda
def test_cli_refuses_fused_off_cuda():
    r = CliRunner().invoke(app, ["bench", "kv", "--kv-attention", "fused"])
    assert r.exit_code == 2
    assert "CUDA" in r.output


def _packed(B, hkv, n, D, bits=8, group=64):
    k = mx.random.normal((B, hkv, n, D))
    return mx.quantize(k, group_size=group, bits=bits)


def test_supports_only_single_token_whole_buffer_reads():
    mx.random.seed(0)
    qk = _packed(2, 2, 64, 128)
    q = mx.zeros((2, 8, 1, 128))
    mask = mx.ones((2, 1, 1, 64), dtype=mx.bool_)
    assert qa.supports(q, qk, qk, mask, 64, 8)
    assert not qa.supports(mx.zeros((2, 8, 3, 128)), qk, qk, mask, 64, 8)  # several query tokens
    assert not qa.supports(mx.zeros((2, 32, 1, 128)), qk, qk, mask, 64, 8)  # 16 query heads per KV head
    assert not qa.supports(q, qk, qk, mx.ones((2, 1, 1, 63), dtype=mx.bool_), 64, 8)  # mask narrower than the buffer
    assert not qa.supports(q, qk, qk, mx.zeros((2, 1, 1, 64)), 64, 8)  # additive mask
    assert not qa.supports(q, qk, qk, "causal", 64, 8)
    assert not qa.supports(q, qk, qk, mask, 64, 3)


def test_dispatch_leaves_unmarked_reads_on_mlx_lms_path():
    """(mlx-lm scales its queries in place, hence the copies.) With the dispatcher installed, a plain tuple (mlx-lm's QuantizedKVCache) gives mlx-lm's result
    bit for bit, and a marked one is routed to the fused kernel only when it is selected."""
    mx.random.seed(1)
    installed = base.quantized_scaled_dot_product_attention  # the dispatcher, once any engine layer marked a read
    original = getattr(installed, "_mlxb_original", installed)
    base.quantized_scaled_dot_product_attention = original
    qk, qv = _packed(2, 2, 64, 64), _packed(2, 2, 64, 64)
    q = mx.random.normal((2, 4, 1, 64))
    mask = mx.ones((2, 1, 1, 64), dtype=mx.bool_)
    want = original(mx.array(q), qk, qv, scale=0.125, mask=mask, group_size=64, bits=8)
    calls = []
    real = qa.fused_decode
    try:
        qa._install()
        assert base.quantized_scaled_dot_product_attention is not original
        qa.fused_decode = lambda *a: calls.append(a) or mx.zeros_like(q)
        got = base.quantized_scaled_dot_product_attention(mx.array(q), qk, qv, scale=0.125, mask=mask, group_size=64, bits=8)
        assert mx.array_equal(got, want) and not calls
        qa._MODE = "mlx-lm"  # marked only because the backend's grouped-query read is wrong: not the kernel
        got = base.quantized_scaled_dot_product_attention(mx.array(q), qa.Packed(qk), qa.Packed(qv), scale=0.125,
                                                          mask=mask, group_size=64, bits=8)
        assert mx.array_equal(got, want) and not calls
        qa._MODE = "fused"
        base.quantized_scaled_dot_product_attention(q, qa.Packed(qk), qa.Packed(qv), scale=0.125, mask=mask,
                                                    group_size=64, bits=8)
        assert len(calls) == 1
    finally:
        qa.fused_decode = real
        qa._MODE, qa._ROUTE, qa.quantized_paths._FOLD = "mlx-lm", None, None
        base.quantized_scaled_dot_product_attention = installed
