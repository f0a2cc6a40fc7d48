"""The fused quantized-KV decode kernel (``--kv-attention fused``) run on the CPU through a C++ emulation
of its CUDA source (tests/unit/cuda_emulation.py), with the launch geometry ``fused_decode`` uses: it must
agree with mlx-lm's quantized attention (float32, masked rows with left padding and an unwritten tail,
grouped-query ratios 1/4/8, 8 and 4 bits, several group sizes, chunked and single-chunk key ranges).
A planted bug in the kernel (the value pass reading the wrong group's scale) must fail the comparison."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention as mlx_lm_path

from mlxb.kernels import dense_attention
from mlxb.kernels import quantized_attention as qa

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the CUDA emulation")

F32, U32, BOOL = np.float32, np.uint32, np.bool_


def emulated(part_src, queries, qk, qv, scale, mask, group, bits):
    from tests.unit.cuda_emulation import EmulatedKernel

    B, hq, _, D = queries.shape
    hkv, n = qk[0].shape[1], qk[0].shape[2]
    part, join = qa.launch_plan(B, hq, hkv, n, D, bits, group, mask is not None, scale, "float")
    consts = {k: v for k, v in part["template"]}
    kp = EmulatedKernel("mlxb_qattn_part", [("q", F32), ("kw", U32), ("ks", F32), ("kb", F32), ("vw", U32),
                                            ("vs", F32), ("vb", F32), ("mask", BOOL)],
                        [("o_part", F32), ("m_part", F32), ("l_part", F32)], part_src, qa._HEADER, consts)
    kj = EmulatedKernel("mlxb_qattn_join", [("o_part", F32), ("m_part", F32), ("l_part", F32)], [("out", F32)],
                        qa._JOIN, qa._HEADER, {"T": "float"})
    np_ = lambda a: np.array(a)  # noqa: E731
    m2 = np.ones((1,), BOOL) if mask is None else np.broadcast_to(np_(mask), (B, 1, 1, n)).reshape(B, n)
    ins = dict(q=np_(queries), kw=np_(qk[0]), ks=np_(qk[1]), kb=np_(qk[2]), vw=np_(qv[0]), vs=np_(qv[1]),
               vb=np_(qv[2]), mask=m2)
    names = ("o_part", "m_part", "l_part")
    parts = kp(ins, dict(zip(names, part["output_shapes"])), part["grid"], part["threadgroup"])
    return kj(parts, {"out": join["output_shapes"][0]}, join["grid"], join["threadgroup"])["out"], consts["C"]


def case(B, hq, hkv, D, n, width, bits, group, seed):
    mx.random.seed(seed)
    q = mx.random.normal((B, hq, 1, D))
    k, v = mx.random.normal((B, hkv, width, D)), mx.random.normal((B, hkv, width, D))
    qk, qv = mx.quantize(k, group_size=group, bits=bits), mx.quantize(v, group_size=group, bits=bits)
    left = mx.array([(i * 37) % max(1, n // 2) for i in range(B)])
    pos = mx.arange(width)
    mask = ((pos[None] >= left[:, None]) & (pos[None] < n)).reshape(B, 1, 1, width)
    assert qa.supports(q, qk, qv, mask, group, bits)
    want = np.array(mlx_lm_path(mx.array(q), qk, qv, scale=D ** -0.5, mask=mask, group_size=group, bits=bits))
    return q, qk, qv, mask, want


CASES = [  # B, Hq, Hkv, D, keys, buffer width, bits, group
    (2, 4, 4, 64, 50, 64, 8, 64),
    (3, 8, 2, 128, 300, 512, 8, 64),
    (2, 16, 2, 64, 700, 768, 4, 32),
    (1, 8, 8, 128, 90, 256, 4, 128),
]


@pytest.mark.parametrize("B,hq,hkv,D,n,width,bits,group", CASES)
def test_emulated_kernel_matches_mlx_lm(B, hq, hkv, D, n, width, bits, group):
    q, qk, qv, mask, want = case(B, hq, hkv, D, n, width, bits, group, seed=n)
    got, C = emulated(qa._PART, q, qk, qv, D ** -0.5, mask, group, bits)
    err = np.abs(got - want).max()
    # float32 on both sides; only the order of the sums differs
    assert err < 1e-5, (err, C)


def test_a_wrong_value_scale_fails():
    B, hq, hkv, D, n, width, bits, group = CASES[1]
    q, qk, qv, mask, want = case(B, hq, hkv, D, n, width, bits, group, seed=5)
    planted = qa._PART.replace("const int g = (wv * E) / G;", "const int g = ((wv * E) / G + 1) % NG;")
    assert planted != qa._PART
    got, _ = emulated(planted, q, qk, qv, D ** -0.5, mask, group, bits)
    assert np.abs(got - want).max() > 1e-2


def test_a_chunked_range_with_fully_masked_chunks():
    """More chunks than one and rows whose padding covers whole chunks (their max is -inf)."""
    B, hq, hkv, D, n, width, bits, group = 2, 4, 1, 64, 600, 640, 8, 64
    mx.random.seed(3)
    q = mx.random.normal((B, hq, 1, D))
    k, v = mx.random.normal((B, hkv, width, D)), mx.random.normal((B, hkv, width, D))
    qk, qv = mx.quantize(k, group_size=group, bits=bits), mx.quantize(v, group_size=group, bits=bits)
    pos = mx.arange(width)
    left = mx.array([0, 450])
    mask = ((pos[None] >= left[:, None]) & (pos[None] < n)).reshape(B, 1, 1, width)
    want = np.array(mlx_lm_path(mx.array(q), qk, qv, scale=D ** -0.5, mask=mask, group_size=group, bits=bits))
    got, C = emulated(qa._PART, q, qk, qv, D ** -0.5, mask, group, bits)
    assert width // C >= 3
    assert np.abs(got - want).max() < 1e-5


@pytest.mark.full
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_engine_rows_take_the_fused_read_and_keep_their_tokens(tiny_models, monkeypatch, preset):
    """The engine's quantized batch layers reach the kernel (whole-buffer reads as on CUDA, the kernel
    emulated): a staggered batch of three rows calls it on every decode step and gives the tokens of
    mlx-lm's quantized path, with logprobs within float32 summation-order noise. On tiny-gemma3 the
    sliding-window layers' quantized rings (window 64, wrapped by the 90-token row) take it too."""
    import mlx_lm.models.base as base

    from mlxb.cache import quantized_read
    from tests.tiny.test_quantized_kv import GROUP, engine_rows

    model, tok = tiny_models(preset)[:2]
    prompts = [list(range(5, 35)), list(range(40, 57)), list(range(60, 150))]
    monkeypatch.setattr(quantized_read, "_WHOLE", True)
    original = base.quantized_scaled_dot_product_attention
    calls = []

    def fused(queries, q_keys, q_values, scale, mask, group_size, bits):
        out, _ = emulated(qa._PART, queries, q_keys, q_values, scale, mask, group_size, bits)
        want = original(mx.array(queries), tuple(q_keys), tuple(q_values), scale=scale, mask=mask,
                        group_size=group_size, bits=bits)
        calls.append((queries.shape[0], q_keys[0].shape[2], float(np.abs(out - np.array(want)).max())))
        return mx.array(out)

    try:
        qa.set_kv_attention("mlx-lm")
        plain, _, _ = engine_rows(model, tok, prompts, [0, 2, 3], 8, 0, 4, 16)
        monkeypatch.setattr(qa, "fused_available", lambda: True)
        monkeypatch.setattr(qa, "fused_decode", fused)
        monkeypatch.setattr(dense_attention, "set_enabled", lambda on: None)  # quantized layers only here
        qa.set_kv_attention("fused")
        got, _, _ = engine_rows(model, tok, prompts, [0, 2, 3], 8, 0, 4, 16)
    finally:
        qa._MODE, qa._ROUTE, qa.quantized_paths._FOLD = "mlx-lm", None, None
        base.quantized_scaled_dot_product_attention = original
    assert GROUP == 32 and len(calls) >= 8 and max(b for b, _, _ in calls) == 3
    # every call agrees with mlx-lm's quantized attention on the same inputs (float32 sum order only)
    assert max(d for _, _, d in calls) < 1e-4
    if preset == "tiny-gemma3":  # ring reads (the window's 64 slots) and full-attention reads both
        assert {w for _, w, _ in calls if w == 64} and {w for _, w, _ in calls if w != 64}
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in plain]
    if preset == "tiny-llama":
        # measured 6e-6. Not bounded on tiny-gemma3: its random weights grow the per-call 1e-5 differences
        # to about 2.5e-3 in logprobs over 16 steps (measured), while every token stays equal
        worst = max(float(np.abs(a - b).max()) for r, s in zip(got, plain) for (_, a), (_, b) in zip(r, s))
        assert worst < 1e-4, worst


def test_the_start_up_self_check_passes_the_kernel_and_refuses_a_broken_one(monkeypatch):
    """``--kv-attention fused`` runs the kernel once against float32 attention before serving: the emulated
    kernel passes; a planted wrong value scale, or a kernel that fails to build, refuses the flag."""
    planted = qa._PART.replace("const int g = (wv * E) / G;", "const int g = ((wv * E) / G + 1) % NG;")

    def with_source(src):
        def run(queries, q_keys, q_values, scale, mask, group_size, bits):
            return mx.array(emulated(src, queries, q_keys, q_values, scale, mask, group_size, bits)[0])
        return run

    def broken(*a):
        raise RuntimeError("nvrtc: error: identifier undefined")

    monkeypatch.setattr(qa, "fused_available", lambda: True)
    monkeypatch.setattr(qa, "_install", lambda: None)
    dense = []  # the full-precision kernel's switch (its own self-check: test_dense_attention_emulated.py)
    monkeypatch.setattr(dense_attention, "set_enabled", dense.append)
    try:
        monkeypatch.setattr(qa, "fused_decode", with_source(qa._PART))
        qa.set_kv_attention("fused")
        assert qa.kv_attention() == "fused" and dense == [True]
        monkeypatch.setattr(qa, "fused_decode", with_source(planted))
        with pytest.raises(ValueError, match="disagrees"):
            qa.set_kv_attention("fused")
        monkeypatch.setattr(qa, "fused_decode", broken)
        with pytest.raises(ValueError, match="failed on this device.*--kv-attention mlx-lm"):
            qa.set_kv_attention("fused")
    finally:
        qa._MODE, qa._ROUTE, qa.quantized_paths._FOLD = "mlx-lm", None, None


def test_auto_takes_the_kernels_only_where_they_pass_and_says_why_not(monkeypatch):
    """The CLI's default ``--kv-attention auto``: MLX's read off CUDA; on CUDA the fused kernels when both
    self-checks pass; a kernel refused on the device (planted) leaves MLX's read on, with the reason kept for
    the start-up line, instead of refusing to start."""
    planted = qa._PART.replace("const int g = (wv * E) / G;", "const int g = ((wv * E) / G + 1) % NG;")

    def with_source(src):
        def run(queries, q_keys, q_values, scale, mask, group_size, bits):
            return mx.array(emulated(src, queries, q_keys, q_values, scale, mask, group_size, bits)[0])
        return run

    dense = []
    monkeypatch.setattr(dense_attention, "set_enabled", dense.append)
    monkeypatch.setattr(qa, "_install", lambda: None)
    try:
        monkeypatch.setattr(qa, "fused_available", lambda: False)
        assert qa.set_kv_attention("auto") == "mlx-lm" == qa.kv_attention()
        assert "not a CUDA device" in qa.AUTO_NOTE and dense == [False]
        monkeypatch.setattr(qa, "fused_available", lambda: True)
        monkeypatch.setattr(qa, "fused_decode", with_source(qa._PART))
        dense.clear()
        assert qa.set_kv_attention("auto") == "fused" == qa.kv_attention()
        assert dense == [True] and "self-checks passed" in qa.AUTO_NOTE
        monkeypatch.setattr(qa, "fused_decode", with_source(planted))  # the quantized kernel disagrees
        dense.clear()
        assert qa.set_kv_attention("auto") == "mlx-lm" == qa.kv_attention()
        assert dense == [False] and "refused" in qa.AUTO_NOTE and "disagrees" in qa.AUTO_NOTE

        def dense_refuses(on):  # the full-precision kernel's own check fails after the quantized one passed
            if on:
                raise ValueError("--kv-attention fused: the kernel disagrees with float32 attention")
            dense.append(on)
        monkeypatch.setattr(qa, "fused_decode", with_source(qa._PART))
        monkeypatch.setattr(dense_attention, "set_enabled", dense_refuses)
        dense.clear()
        assert qa.set_kv_attention("auto") == "mlx-lm" and dense == [False] and "refused" in qa.AUTO_NOTE
        assert qa.set_kv_attention("mlx-lm") == "mlx-lm" and qa.AUTO_NOTE is None
    finally:
        qa._MODE, qa._ROUTE, qa.quantized_paths._FOLD, qa.AUTO_NOTE = "mlx-lm", None, None, None
