"""The skinny matmul kernel (``--skinny-matmul``) run on the CPU through the C++ emulation of its CUDA source
(tests/unit/cuda_emulation.py), with the launch geometry ``skinny_matmul`` uses. Every output must equal, bit
for bit, the sum a one-row gemv forms in MLX's order (each lane's columns 4 at a time in steps of 128, then
the warp's butterfly), so a batch's rows come out as lone rows would; weight rows that do not fill the last
warp or block are covered. Planted bugs (input rows read in reverse; a lane's step of 132 columns) must fail."""

import shutil

import numpy as np
import pytest

from mlxb.kernels import skinny

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the CUDA emulation")

F32 = np.float32


def emulated(x, w, rw, source=None, unroll=1):
    from tests.unit.cuda_emulation import EmulatedKernel

    rows, n = x.shape[0], w.shape[0]
    plan = skinny.launch_plan(rows, n, "float", rw, unroll)
    consts = {k: v for k, v in plan["template"]}
    k = EmulatedKernel("mlxb_skinny", [("x", F32), ("w", F32)], [("out", F32)], source or skinny.SOURCE,
                       skinny.HEADER_XOR, consts)
    return k(dict(x=x, w=w), {"out": plan["output_shapes"][0]}, plan["grid"], plan["threadgroup"])["out"]


def gemv_order(x_row, w):
    """One row as MLX's gemv sums it, in float32: lane l takes columns 4l..4l+3 of every 128, in order; then
    lanes combine by the xor butterfly and lane 0's value is the output."""
    n, k = w.shape
    out = np.zeros(n, F32)
    for i in range(n):
        lanes = np.zeros(32, F32)
        for col0 in range(0, k, 128):
            for j in range(4):
                c = col0 + 4 * np.arange(32) + j
                lanes = (lanes + (w[i, c] * x_row[c]).astype(F32)).astype(F32)
        for o in (16, 8, 4, 2, 1):
            lanes = (lanes + lanes[np.arange(32) ^ o]).astype(F32)
        out[i] = lanes[0]
    return out


def case(rows, k, n, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, k)).astype(F32), (0.1 * rng.standard_normal((n, k))).astype(F32)


@pytest.mark.parametrize("rows,k,n,rw,unroll", [(2, 256, 20, 1, 1), (5, 384, 37, 2, 1), (16, 128, 9, 1, 1),
                                                (1, 640, 19, 1, 4), (3, 384, 21, 2, 2), (1, 1024, 11, 1, 8)])
def test_every_row_equals_the_one_row_gemv_bit_for_bit(rows, k, n, rw, unroll):
    """``unroll`` > 1 issues several steps' loads at once and must not change a sum: 640 and 384 columns leave
    steps over for the tail loop (5 steps at 4 per trip, 3 at 2), 1024 at 8 fills whole trips."""
    x, w = case(rows, k, n, rows * 100 + n)
    got = emulated(x, w, rw, unroll=unroll)
    assert got.shape == (rows, n)
    for m in range(rows):
        assert np.array_equal(got[m], gemv_order(x[m], w)), f"row {m} differs from its one-row gemv sum"
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(got - exact).max() < 1e-4 * max(1.0, np.abs(exact).max())


def test_planted_bugs_fail():
    x, w = case(5, 256, 20, 7)
    reversed_rows = skinny.SOURCE.replace("x + (size_t)m * K", "x + (size_t)(M - 1 - m) * K")
    wrong_step = skinny.SOURCE.replace("col += U * 128", "col += U * 132")
    wrong_tail = skinny.SOURCE.replace("col += 128", "col += 132")  # only the steps left over from the trips
    late_load = skinny.SOURCE.replace("col + u * 128);\n#pragma unroll\n    for (int u", "col);\n#pragma unroll\n    for (int u")
    assert len({skinny.SOURCE, reversed_rows, wrong_step, wrong_tail, late_load}) == 5
    want = np.stack([gemv_order(x[m], w) for m in range(5)])
    for src, unroll in ((reversed_rows, 1), (wrong_step, 1), (wrong_tail, 3), (late_load, 2)):
        assert not np.array_equal(emulated(x, w, 1, src, unroll), want)


def test_applies_only_where_the_kernel_is_exact_and_pays():
    import mlx.core as mx

    bf = mx.bfloat16
    assert skinny.applies(8, 4096, bf, bf) and skinny.applies(2, 128, mx.float16, mx.float16)
    assert not skinny.applies(1, 4096, bf, bf)  # one row: MLX's gemv already
    assert not skinny.applies(skinny.MAX_ROWS + 1, 4096, bf, bf)  # prefill chunks: cuBLAS
    assert not skinny.applies(8, 4000, bf, bf)  # columns not in whole steps of 128
    assert not skinny.applies(8, 4096, mx.float32, bf)  # mixed dtypes promote
    assert not skinny.applies(8, 4096, mx.float32, mx.float32)
    assert skinny.applies(4, 4096, bf, bf, n=4096) and not skinny.applies(4, 4096, bf, bf, n=14336)  # MLP: cuBLAS


def test_skinny_linear_sends_only_skinny_products_to_the_kernel(monkeypatch):
    """install() swaps plain Linear layers only; their products of 2..MAX_ROWS bf16 rows reach the kernel (here
    a recording stand-in, the CPU has no CUDA), everything else runs mlx's own Linear; uninstall() restores."""
    import mlx.core as mx
    import mlx.nn as nn

    calls = []

    def fake(x, w, reduce=None, rw=None):
        calls.append(x.size // x.shape[-1])
        return x @ w.T

    monkeypatch.setattr(skinny, "skinny_matmul", fake)
    model = nn.Sequential(nn.Linear(128, 64, bias=False), nn.Linear(64, 128, bias=True),
                          nn.QuantizedLinear(128, 128, bias=False))
    model.set_dtype(mx.bfloat16)
    assert skinny.install(model) == 2
    lin, biased = model.layers[0], model.layers[1]
    assert type(lin) is skinny.SkinnyLinear and type(model.layers[2]) is nn.QuantizedLinear
    x = mx.ones((4, 1, 128), dtype=mx.bfloat16)
    assert lin(x).shape == (4, 1, 64) and calls == [4]
    lin(mx.ones((1, 1, 128), dtype=mx.bfloat16))  # one row: MLX's gemv
    lin(mx.ones((1, skinny.MAX_ROWS + 1, 128), dtype=mx.bfloat16))  # a prefill chunk: cuBLAS
    biased(mx.ones((4, 64), dtype=mx.bfloat16))  # a bias: mlx's addmm
    assert calls == [4]
    skinny.uninstall(model)
    assert type(lin) is nn.Linear and type(biased) is nn.Linear


def test_the_flag_is_refused_off_cuda_with_a_message_naming_the_fix():
    import mlx.nn as nn

    from mlxb.engine.build import use_skinny_matmul
    from mlxb.errors import ValidationError

    if skinny.available():
        pytest.skip("a CUDA device: the flag is allowed here")
    with pytest.raises(ValidationError, match="leave it off"):
        use_skinny_matmul(nn.Linear(128, 128))
