"""The fused full-precision decode kernel (``--kv-attention fused``, mlxb/kernels/dense_attention.py) run on the
CPU through the C++ emulation of its CUDA source (tests/unit/cuda_emulation.py), with the launch geometry
``fused_decode`` uses. It must agree with MLX's attention in float32 on: keys and values read through the strides
of a view of a wider buffer (as the batch caches hand them over), left padding and other masked keys, grouped-query
ratios 1/2/3/4/8, head sizes 32/64/96/128/256, one and several chunks, and a shared prefix read by the rows whose flag is
set (against ``cascade_attention``, the shared-prefix layers' MLX path). Planted bugs in the kernel must fail."""

import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlxb.cache.shared import cascade_attention
from mlxb.kernels import dense_attention as da
from mlxb.kernels.split_key import JOIN as _JOIN

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the CUDA emulation")

F32, BOOL = np.float32, np.bool_


def emulated(part_src, q, k, v, scale, mask, prefix=None):
    """q, k, v, mask: numpy (k and v may be strided views); prefix: (keys, values, flags or None) numpy."""
    from tests.unit.cuda_emulation import EmulatedKernel

    B, hq, L, D = q.shape
    hkv, n = k.shape[1], k.shape[2]
    p = 0 if prefix is None else prefix[0].shape[2]
    flags = prefix is not None and prefix[2] is not None
    causal = isinstance(mask, str) and L > 1
    mask = mask if isinstance(mask, np.ndarray) else None
    part, join = da.launch_plan(B, hq, hkv, L, n, p, D, mask is not None, causal, flags, scale, "float")
    consts = {name: val for name, val in part["template"]}
    kp = EmulatedKernel("mlxb_dattn_part", list(zip(da.INPUTS, [F32, F32, F32, BOOL, F32, F32, BOOL, BOOL])),
                        [("o_part", F32), ("m_part", F32), ("l_part", F32)], part_src, da._HEADER, consts,
                        ensure_row_contiguous=False)  # as _kernels() builds it
    kj = EmulatedKernel("mlxb_dattn_join", [("o_part", F32), ("m_part", F32), ("l_part", F32)], [("out", F32)],
                        _JOIN, da._HEADER, {"T": "float"})
    dummy = np.zeros((1, 1, 1, D), F32)
    ins = dict(q=q, keys=k, values=v,
               mask=np.ones((1,), BOOL) if mask is None else np.ascontiguousarray(np.broadcast_to(mask, (B, 1, L, n)).reshape(B, L, n)),
               pkeys=dummy if prefix is None else prefix[0], pvalues=dummy if prefix is None else prefix[1],
               share=np.asarray(prefix[2]) if flags else np.ones((1,), BOOL),
               plan=np.zeros(part["plan"], BOOL))  # the chunk and the flags, read from its shape
    names = ("o_part", "m_part", "l_part")
    parts = kp(ins, dict(zip(names, part["output_shapes"])), part["grid"], part["threadgroup"])
    return kj(parts, {"out": join["output_shapes"][0]}, join["grid"], join["threadgroup"])["out"], part["plan"][0]


def case(B, hq, hkv, D, n, width, seed, masked=True):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, hq, 1, D), dtype=F32)
    kbuf = rng.standard_normal((B, hkv, width, D), dtype=F32)
    vbuf = rng.standard_normal((B, hkv, width, D), dtype=F32)
    k, v = kbuf[:, :, :n], vbuf[:, :, :n]  # views: row strides of the wider buffer
    assert not k.flags["C_CONTIGUOUS"] or width == n
    mask = None
    if masked:
        left = np.array([(i * 37) % max(1, n // 2) for i in range(B)])
        mask = (np.arange(n)[None] >= left[:, None]).reshape(B, 1, 1, n)
        if n > 8:
            mask[0, 0, 0, n // 3] = False  # a masked key inside the row (a speculative hole)
    return q, k, v, mask


def mlx_attention(q, k, v, scale, mask):
    m = mask if mask is None or isinstance(mask, str) else mx.array(mask)
    return np.array(mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(np.ascontiguousarray(k)),
                                                         mx.array(np.ascontiguousarray(v)), scale=scale, mask=m))


F = pytest.mark.full  # the wider matrix: the default tier keeps one case per head size family
CASES = [  # B, Hq, Hkv, D, keys, buffer width
    pytest.param(2, 4, 4, 64, 50, 64, marks=F),
    (3, 8, 2, 128, 300, 512),
    pytest.param(2, 16, 2, 64, 700, 768, marks=F),
    pytest.param(1, 8, 8, 128, 90, 90, marks=F),
    (2, 4, 1, 256, 130, 200),
    pytest.param(2, 6, 2, 96, 150, 160, marks=F),
    (3, 4, 2, 32, 40, 64),
]


@pytest.mark.parametrize("B,hq,hkv,D,n,width", CASES)
def test_emulated_kernel_matches_mlx_attention(B, hq, hkv, D, n, width):
    q, k, v, mask = case(B, hq, hkv, D, n, width, seed=n)
    want = mlx_attention(q, k, v, D ** -0.5, mask)
    got, C = emulated(da._PART, q, k, v, D ** -0.5, mask)
    assert np.abs(got - want).max() < 1e-5, C  # float32 on both sides; only the order of the sums differs


def verify_case(B, hq, hkv, D, n, width, L, seed):
    """A verify step's queries: L per row at the end of each row's keys, left padding, and a hole (a rejected
    draft kept in place) that every later query must skip."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, L, hq, D), dtype=F32).transpose(0, 2, 1, 3)  # as the model hands it: a strided view
    kbuf = rng.standard_normal((B, hkv, width, D), dtype=F32)
    vbuf = rng.standard_normal((B, hkv, width, D), dtype=F32)
    k, v = kbuf[:, :, :n], vbuf[:, :, :n]
    left = np.array([(i * 29) % max(1, n // 3) for i in range(B)])
    pos = np.arange(n)
    causal = pos[None, :] <= (n - L + np.arange(L))[:, None]  # [L, n]
    mask = (pos[None, None, :] >= left[:, None, None]) & causal[None]
    mask[:, :, n - L - 3] = False  # a hole every query skips
    return q, k, v, mask.reshape(B, 1, L, n)


@pytest.mark.parametrize("B,hq,hkv,D,n,width,L", [(2, 8, 2, 128, 200, 256, 5), pytest.param(3, 4, 4, 64, 70, 96, 2, marks=F),
                                                  pytest.param(1, 8, 1, 64, 150, 150, 4, marks=F),
                                                  pytest.param(2, 8, 2, 32, 300, 320, 8, marks=F)])
def test_several_queries_per_row_match_mlx_attention(B, hq, hkv, D, n, width, L):
    q, k, v, mask = verify_case(B, hq, hkv, D, n, width, L, seed=n + L)
    got, _ = emulated(da._PART, q, k, v, D ** -0.5, mask)
    assert np.abs(got - mlx_attention(q, k, v, D ** -0.5, mask)).max() < 1e-5
    # MLX's "causal" string (a lone row's verify): the queries are the last L keys
    got, _ = emulated(da._PART, q[:1], k[:1], v[:1], D ** -0.5, "causal")
    assert np.abs(got - mlx_attention(q[:1], k[:1], v[:1], D ** -0.5, "causal")).max() < 1e-5


def test_several_queries_over_a_shared_prefix_match_cascade_attention():
    B, hq, hkv, D, n, width, L, P = 3, 8, 2, 64, 60, 64, 4, 150
    q, k, v, mask = verify_case(B, hq, hkv, D, n, width, L, seed=9)
    rng = np.random.default_rng(10)
    pk, pv = rng.standard_normal((1, hkv, P, D), dtype=F32), rng.standard_normal((1, hkv, P, D), dtype=F32)
    share = np.array([True, False, True])
    want = np.array(cascade_attention(mx.array(q), (mx.array(np.ascontiguousarray(k)), mx.array(pk), mx.array(share)),
                                      (mx.array(np.ascontiguousarray(v)), mx.array(pv)), D ** -0.5, mx.array(mask)))
    got, _ = emulated(da._PART, q, k, v, D ** -0.5, mask, (pk, pv, share))
    assert np.abs(got - want).max() < 1e-5


def test_a_query_that_sees_later_keys_fails():
    """Planted: the causal bound one key late (each query also sees the next draft)."""
    q, k, v, _ = verify_case(1, 8, 2, 64, 120, 128, 5, seed=4)
    planted = da._PART.replace("see[i] = k <= N - L + i;", "see[i] = k <= N - L + i + 1;")
    assert planted != da._PART
    want = mlx_attention(q, k, v, 64 ** -0.5, "causal")
    wrong, _ = emulated(planted, q, k, v, 64 ** -0.5, "causal")
    assert np.abs(wrong - want).max() > 1e-2


def test_without_a_mask_every_key_is_read():
    q, k, v, _ = case(2, 8, 2, 128, 140, 256, seed=3, masked=False)
    got, _ = emulated(da._PART, q, k, v, 128 ** -0.5, None)
    assert np.abs(got - mlx_attention(q, k, v, 128 ** -0.5, None)).max() < 1e-5


@pytest.mark.parametrize("flags", [None, [True, False, True]])
def test_a_shared_prefix_matches_cascade_attention(flags):
    B, hq, hkv, D, n, width, P = 3, 8, 2, 64, 75, 96, 210
    q, k, v, mask = case(B, hq, hkv, D, n, width, seed=21)
    rng = np.random.default_rng(22)
    pk, pv = rng.standard_normal((1, hkv, P, D), dtype=F32), rng.standard_normal((1, hkv, P, D), dtype=F32)
    share = None if flags is None else np.array(flags)
    ks = mx.array(np.ascontiguousarray(k))
    want = np.array(cascade_attention(mx.array(q), (ks, mx.array(pk), None if share is None else mx.array(share)),
                                      (mx.array(np.ascontiguousarray(v)), mx.array(pv)), D ** -0.5, mx.array(mask)))
    got, C = emulated(da._PART, q, k, v, D ** -0.5, mask, (pk, pv, share))
    assert P > C  # the prefix spans several chunks
    assert np.abs(got - want).max() < 1e-5
    # and the MLX reference the device self-check uses agrees with cascade_attention
    ref = da.reference(mx.array(q), mx.array(np.ascontiguousarray(k)), mx.array(np.ascontiguousarray(v)), D ** -0.5,
                       mx.array(mask), (mx.array(pk), mx.array(pv), None if share is None else mx.array(share)))
    assert np.abs(np.array(ref) - want).max() < 1e-5


@pytest.mark.parametrize("bug,old,new", [
    ("the keys' head stride taken as N * D (a contiguous [B, H, N, D] assumed, not a view of a wider buffer)",
     "(int64_t)h * keys_strides[1]", "(int64_t)h * N * D"),
    ("the mask ignored", "if (see[i] && !pre && HAS_MASK) see[i] = mask[((size_t)b * L + i) * N + k];", ""),
    ("a row that does not share reads the prefix anyway", "if (pre && SHARE_FLAGS && !share[b])", "if (false)"),
])
def test_planted_bugs_fail(bug, old, new):
    planted = da._PART.replace(old, new)
    assert planted != da._PART, bug
    B, hq, hkv, D, n, width, P = 3, 8, 2, 64, 75, 96, 130
    q, k, v, mask = case(B, hq, hkv, D, n, width, seed=5)
    rng = np.random.default_rng(6)
    prefix = (rng.standard_normal((1, hkv, P, D), dtype=F32), rng.standard_normal((1, hkv, P, D), dtype=F32),
              np.array([True, False, True]))
    right, _ = emulated(da._PART, q, k, v, D ** -0.5, mask, prefix)
    wrong, _ = emulated(planted, q, k, v, D ** -0.5, mask, prefix)
    assert np.abs(wrong - right).max() > 1e-2, bug


def test_supports_decode_shapes_only():
    q = mx.zeros((2, 8, 1, 128))
    k = mx.zeros((2, 2, 40, 128))
    mask = mx.ones((2, 1, 1, 40), dtype=mx.bool_)
    assert da.supports(q, k, k, mask) and da.supports(q, k, k, None) and da.supports(q, k, k, "causal")
    assert da.supports(mx.zeros((2, 8, 5, 128)), k, k, "causal")  # a verify step
    assert da.supports(mx.zeros((2, 8, 5, 128)), k, k, mx.ones((2, 1, 5, 40), dtype=mx.bool_))
    assert not da.supports(mx.zeros((2, 8, 9, 128)), k, k, "causal")  # more queries than a verify step: MLX's path
    assert not da.supports(mx.zeros((2, 8, 5, 128)), k, k, mx.ones((2, 1, 4, 40), dtype=mx.bool_))
    assert not da.supports(mx.zeros((2, 16, 5, 128)), k, k, "causal")  # 8 heads x 5 queries: 40 rows a block
    k256 = mx.zeros((2, 2, 40, 256))  # 32 rows of 256 dims: more than a block's 48 KB of shared memory
    assert not da.supports(mx.zeros((2, 16, 4, 256)), k256, k256, "causal")
    assert da.supports(mx.zeros((2, 8, 4, 256)), k256, k256, "causal")
    part, _ = da.launch_plan(64, 8, 2, 4, 8000, 0, 256, False, True, False, 1.0, mx.bfloat16)
    assert part["plan"][0] <= dict(part["template"])["CMAX"] and da.smem_floats(16, 256, dict(part["template"])["CMAX"]) <= da.SMEM_FLOATS
    assert not da.supports(q, k, k, mx.zeros((2, 1, 1, 40)))  # an additive mask
    assert not da.supports(mx.zeros((2, 8, 1, 80)), mx.zeros((2, 2, 40, 80)), mx.zeros((2, 2, 40, 80)), None)
    assert not da.supports(mx.zeros((2, 24, 1, 128)), k, k, None)  # 12 query heads per KV head


def test_the_mode_is_refused_off_cuda():
    if da.cuda_gpu():
        pytest.skip("this machine has MLX's CUDA backend")
    with pytest.raises(ValueError, match="--kv-attention mlx-lm"):
        da.set_enabled(True)
    assert not da.active()


def test_only_the_engines_forwards_take_the_kernel(monkeypatch):
    """With the mode on, a call outside ``ours()`` (mlx-lm's own model in the same process: the peer arm of bench
    engine, a parity oracle) keeps MLX's attention; inside, a decode call takes the kernel."""
    taken = []
    monkeypatch.setattr(da, "_ORIGINAL", lambda q, k, v, **kw: "mlx")
    monkeypatch.setattr(da, "fused_decode", lambda *a, **kw: taken.append(1) or "fused")
    monkeypatch.setattr(da, "_ON", True)
    q, k = mx.zeros((2, 4, 1, 64)), mx.zeros((2, 2, 10, 64))
    m = mx.ones((2, 1, 1, 10), dtype=mx.bool_)
    assert da._dispatch(q, k, k, scale=0.1, mask=m) == "mlx"
    with da.ours():
        assert da._dispatch(q, k, k, scale=0.1, mask=m) == "fused"
        assert da._dispatch(mx.zeros((2, 4, 5, 64)), k, k, scale=0.1, mask="causal") == "fused"  # a verify step
        assert da._dispatch(mx.zeros((2, 4, 3, 64)), k, k, scale=0.1, mask="causal") == "mlx"  # MLX's vector kernel
        assert da._dispatch(q, k, k, scale=0.1, mask=None) == "mlx"  # MLX's vector kernel reads unmasked in one pass
        assert da._dispatch(mx.zeros((2, 4, 40, 64)), k, k, scale=0.1, mask="causal") == "mlx"  # a prefill chunk
    assert da._dispatch(q, k, k, scale=0.1, mask=m) == "mlx" and taken == [1, 1]
    monkeypatch.setattr(da, "_ON", False)
    with da.ours():
        assert da._dispatch(q, k, k, scale=0.1, mask=m) == "mlx"


def test_the_start_up_self_check_passes_the_kernel_and_refuses_a_broken_one(monkeypatch):
    """``set_enabled(True)`` runs the kernel on the self-check's cases against float32 attention first: the emulated
    kernel passes; one that ignores the mask, or one that fails to build, refuses the flag with the fix named."""
    def with_source(src):
        def run(q, k, v, scale, mask=None, prefix=None):
            f = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
            pre = None if prefix is None else (f(prefix[0]), f(prefix[1]), None if prefix[2] is None else np.array(prefix[2]))
            return mx.array(emulated(src, f(q), f(k), f(v), scale, None if mask is None else np.array(mask), pre)[0])
        return run

    def broken(*a, **kw):
        raise RuntimeError("nvrtc: error: identifier undefined")

    monkeypatch.setattr(da, "cuda_gpu", lambda: True)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", mx.fast.scaled_dot_product_attention)  # restored after
    monkeypatch.setattr(da, "_ORIGINAL", None)
    monkeypatch.setattr(da, "_ON", False)
    monkeypatch.setattr(da, "fused_decode", with_source(da._PART))
    da.set_enabled(True)
    assert da._ON and mx.fast.scaled_dot_product_attention is da._dispatch
    monkeypatch.setattr(da, "fused_decode", with_source(da._PART.replace(
        "if (see[i] && !pre && HAS_MASK) see[i] = mask[((size_t)b * L + i) * N + k];", "")))
    with pytest.raises(ValueError, match="disagrees.*--kv-attention mlx-lm"):
        da.set_enabled(True)
    assert not da._ON
    monkeypatch.setattr(da, "fused_decode", broken)
    with pytest.raises(ValueError, match="failed on this device.*--kv-attention mlx-lm"):
        da.set_enabled(True)


def test_queries_read_as_contiguous_fail():
    """Planted: the queries indexed as a contiguous [B, Hq, L, D] array, while the model hands a transposed view."""
    old = """    qs[i] = static_cast<float>(q[(int64_t)b * q_strides[0] + (int64_t)(h * G + g) * q_strides[1]
                                 + (int64_t)j * q_strides[2] + (int64_t)d * q_strides[3]]) """
    planted = da._PART.replace(old, "    qs[i] = static_cast<float>(q[(((int64_t)b * Hkv + h) * G * L + g * L + j) * D + d]) ")
    assert planted != da._PART
    q, k, v, mask = verify_case(2, 8, 2, 64, 90, 96, 4, seed=8)
    assert not q.flags["C_CONTIGUOUS"]
    right, _ = emulated(da._PART, q, k, v, 64 ** -0.5, mask)
    assert np.abs(right - mlx_attention(q, k, v, 64 ** -0.5, mask)).max() < 1e-5
    wrong, _ = emulated(planted, q, k, v, 64 ** -0.5, mask)
    assert np.abs(wrong - right).max() > 1e-2


def test_a_compiled_variant_depends_on_the_query_count_alone():
    """MLX compiles a kernel per template (1.5-2.2 s each on an H100, paid by the request that first needs it): the
    chunk, the mask kind and the prefix travel in the plan input's shape, so the warm-up's one small call per query
    count compiles what every batch size, key count, mask kind and prefix later runs; and every float input's dtype
    is in the template, since MLX names a compiled kernel by its template alone (the float32 self-check's kernel must
    not serve bfloat16 inputs)."""
    scale = 128 ** -0.5
    for L in range(1, da.MAX_QUERIES + 1):
        warm, _ = da.launch_plan(1, 32, 8, L, L, 0, 128, True, False, False, scale, mx.bfloat16,
                                 (mx.bfloat16, mx.bfloat16, mx.float32, mx.float32))
        for B, n, p, masked, flags in ((1, 40, 0, True, False), (32, 2000, 0, True, False), (64, 8000, 0, L > 3, False),
                                       (7, 300, 0, True, False)):
            causal = not masked
            part, _ = da.launch_plan(B, 32, 8, L, n, p, 128, masked, causal, flags, scale, mx.bfloat16,
                                     (mx.bfloat16, mx.bfloat16, mx.float32, mx.float32))
            assert part["template"] == warm["template"], (L, B, n)
            assert part["plan"][0] <= dict(part["template"])["CMAX"]
        shared, _ = da.launch_plan(16, 32, 8, L, 900, 1500, 128, True, False, True, scale, mx.bfloat16)
        warm_shared, _ = da.launch_plan(1, 32, 8, L, L, L, 128, True, False, True, scale, mx.bfloat16)
        assert shared["template"] == warm_shared["template"]
    a, _ = da.launch_plan(2, 8, 2, 1, 300, 0, 128, True, False, False, scale, mx.float32)
    b, _ = da.launch_plan(2, 8, 2, 1, 300, 0, 128, True, False, False, scale, mx.bfloat16)
    assert a["template"] != b["template"]
    plans = {da.launch_plan(B, 32, 8, 1, n, 0, 128, True, False, False, scale, mx.bfloat16)[0]["plan"]
             for B, n in ((1, 100), (64, 8000))}
    assert plans == {(64, 2), (256, 2)}  # the chunk still follows the batch and the keys


def test_the_warm_up_runs_every_query_count_for_each_shape_seen(monkeypatch):
    calls = []
    monkeypatch.setattr(da, "fused_decode", lambda q, k, v, scale, mask=None, prefix=None:
                        calls.append((q.shape[2], q.dtype, prefix is not None)) or mx.zeros((1,)))
    monkeypatch.setattr(da, "_SEEN", {(32, 8, 128, mx.bfloat16, mx.bfloat16, mx.bfloat16, 0.088)})
    assert da.warm_variants() == da.MAX_QUERIES
    assert sorted(c[0] for c in calls) == list(range(1, da.MAX_QUERIES + 1))
    calls.clear()
    assert da.warm_variants(prefix=True) == 2 * da.MAX_QUERIES and sum(c[2] for c in calls) == da.MAX_QUERIES
    monkeypatch.setattr(da, "_SEEN", {(64, 8, 128, mx.bfloat16, mx.bfloat16, mx.bfloat16, 0.088)})
    calls.clear()  # 8 query heads a KV head x 5+ queries: more rows than a block takes, MLX's path then
    da.warm_variants()
    assert sorted(c[0] for c in calls) == [1, 2, 3, 4]
