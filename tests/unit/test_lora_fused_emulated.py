"""The fused per-row LoRA kernel (``--lora-path fused``) run on the CPU through the C++ emulation of its CUDA
source (tests/unit/cuda_emulation.py), with the launch geometry ``fused_delta`` uses: every row must equal
mlx-lm's ``LoRALinear`` with that row's adapter (float32; only the order of the sums differs), a row without
an adapter keeps its base output bit for bit, and tiles that do not divide the outputs are covered. A planted
bug (each row reading the next adapter's B) must fail."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tuner.lora import LoRALinear

from mlxb.kernels import lora_fused as lf

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the CUDA emulation")

F32, I32 = np.float32, np.int32


def emulated(source, x, y, a, b, slots, scales):
    from tests.unit.cuda_emulation import EmulatedKernel

    rows, dout = y.shape
    plan = lf.launch_plan(rows, dout, a.shape[2], "float", "float")
    consts = {k: v for k, v in plan["template"]}
    k = EmulatedKernel("mlxb_lora_fused", [("x", F32), ("y", F32), ("a", F32), ("b", F32), ("slot", I32),
                                           ("scale", F32)], [("out", F32)], source, "", consts)
    ins = dict(x=np.asarray(x, F32), y=np.asarray(y, F32), a=np.asarray(a, F32), b=np.asarray(b, F32),
               slot=np.asarray(slots, I32), scale=np.asarray(scales, F32))
    return k(ins, {"out": plan["output_shapes"][0]}, plan["grid"], plan["threadgroup"])["out"], consts["TILE"]


def emulated_split(x, y, a, b, slots, scales, shrink_src=None):
    """The split pair: float32 partial shrinks per chunk of inputs, then the expand kernel sums them."""
    from tests.unit.cuda_emulation import EmulatedKernel

    rows, dout = y.shape
    sp = lf.split_plan(rows, x.shape[1], a.shape[2], "float", "float")
    ks = EmulatedKernel("mlxb_lora_shrink", [("x", F32), ("a", F32), ("slot", I32)], [("part", F32)],
                        shrink_src or lf._SHRINK, "", {k: v for k, v in sp["template"]})
    ins = dict(x=np.asarray(x, F32), a=np.asarray(a, F32), slot=np.asarray(slots, I32))
    part = ks(ins, {"part": sp["output_shapes"][0]}, sp["grid"], sp["threadgroup"])["part"]
    plan = lf.launch_plan(rows, dout, a.shape[2], "float", "float")
    ke = EmulatedKernel("mlxb_lora_expand", [("y", F32), ("part", F32), ("b", F32), ("slot", I32), ("scale", F32)],
                        [("out", F32)], lf._EXPAND, "", {k: v for k, v in plan["template"]})
    ins = dict(y=np.asarray(y, F32), part=part, b=np.asarray(b, F32), slot=np.asarray(slots, I32),
               scale=np.asarray(scales, F32))
    return ke(ins, {"out": plan["output_shapes"][0]}, plan["grid"], plan["threadgroup"])["out"], part.shape[1]


def case(rows, din, dout, rank, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, din)).astype(F32)
    y = rng.standard_normal((rows, dout)).astype(F32)
    a = (0.1 * rng.standard_normal((n, din, rank))).astype(F32)
    b = (0.1 * rng.standard_normal((n, rank, dout))).astype(F32)
    slots = np.array([(i % (n + 1)) - 1 for i in range(rows)], dtype=I32)  # -1 (none), 0, 1, ...
    scales = np.array([20.0, 2.0, 0.5, 8.0][:n], dtype=F32)
    return x, y, a, b, slots, scales


def mlx_lm_rows(x, y, a, b, slots, scales):
    """Each row through mlx-lm's own LoRALinear (its base a Linear whose output is the row's y)."""
    out = []
    for i, s in enumerate(slots):
        if s < 0:
            out.append(y[i])
            continue
        layer = LoRALinear(a.shape[1], y.shape[1], r=a.shape[2], scale=float(scales[s]))
        layer.linear = lambda _x, yi=mx.array(y[i : i + 1]): yi
        layer.lora_a, layer.lora_b = mx.array(a[s]), mx.array(b[s])
        out.append(np.array(layer(mx.array(x[i : i + 1])))[0])
    return np.stack(out)


@pytest.mark.parametrize("rows,din,dout,rank,n", [(3, 200, 300, 8, 2), pytest.param(9, 96, 1100, 16, 3, marks=pytest.mark.full),
                                                  (2, 64, 256, 4, 1)])
def test_emulated_kernel_matches_mlx_lm_lora_linear(rows, din, dout, rank, n):
    x, y, a, b, slots, scales = case(rows, din, dout, rank, n, seed=rows + din)
    got, tile = emulated(lf._SOURCE, x, y, a, b, slots, scales)
    want = mlx_lm_rows(x, y, a, b, slots, scales)
    none = slots < 0
    assert none.any() and (~none).any()
    assert np.array_equal(got[none], y[none])  # no adapter: the base output, untouched
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())
    assert np.abs(got[~none] - y[~none]).max() > 1e-2  # the delta is really there
    if dout > tile:
        assert dout % tile  # a ragged last tile is covered


@pytest.mark.full
@pytest.mark.parametrize("rows,din,dout,rank,n", [(3, 1100, 300, 8, 2), (5, 96, 700, 16, 3)])
def test_emulated_split_pair_matches_mlx_lm_lora_linear(rows, din, dout, rank, n):
    """The two-kernel variant (shrink over chunks of the input, then expand): the same rows as mlx-lm, several
    chunks with a ragged last one; a planted chunk offset fails."""
    x, y, a, b, slots, scales = case(rows, din, dout, rank, n, seed=rows * din)
    got, nch = emulated_split(x, y, a, b, slots, scales)
    want = mlx_lm_rows(x, y, a, b, slots, scales)
    assert np.array_equal(got[slots < 0], y[slots < 0])
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())
    if din > lf.CH:
        assert nch == -(-din // lf.CH) and din % lf.CH
        planted = lf._SHRINK.replace("const int i0 = c * CH,", "const int i0 = c * CH + 1,")
        bad, _ = emulated_split(x, y, a, b, slots, scales, planted)
        assert np.abs(bad - want).max() > 1e-3


def test_reference_delta_is_mlx_lm():
    x, y, a, b, slots, scales = case(5, 64, 96, 8, 2, seed=1)
    got = lf.reference_delta(mx.array(x), mx.array(y), mx.array(a), mx.array(b), mx.array(slots), mx.array(scales))
    assert np.array_equal(np.array(got), mlx_lm_rows(x, y, a, b, slots, scales))


def test_a_shifted_adapter_fails():
    x, y, a, b, slots, scales = case(4, 128, 256, 8, 3, seed=2)
    planted = lf._SOURCE.replace("const F* bs = b + (size_t)s * R * Dout;",
                                 "const F* bs = b + (size_t)((s + 1) % b_shape[0]) * R * Dout;")
    assert planted != lf._SOURCE
    got, _ = emulated(planted, x, y, a, b, slots, scales)
    assert np.abs(got - mlx_lm_rows(x, y, a, b, slots, scales)).max() > 1e-2


def test_tiles_fill_the_gpu_once():
    # B=8 over a 4096-wide projection: 16 tiles of 256 per row, 128 blocks; B=32: 4 tiles of 1024
    assert lf.tile_for(8, 4096) == 256 and lf.tile_for(32, 4096) == 1024
    assert lf.tile_for(1, 1024) == 256 and lf.tile_for(64, 600) == 512
    assert lf.tile_for(1000, 300) == 512  # never wider than the outputs need
    assert lf.supports(16, 8) and not lf.supports(128, 8) and not lf.supports(16, 512) and lf.supports(16, 128)


@pytest.mark.full
def test_engine_rows_take_the_fused_kernel_and_keep_their_adapters(tmp_path, monkeypatch):
    """``--lora-path fused`` in the engine, its default split pair emulated (32 threads a block to keep it quick): rows of two
    adapters and the base in one batch (prefill chunks and decode steps, joins) give the tokens of mlx-lm alone
    with each row's adapter, logprobs within float32 summation-order noise (1.1e-4 measured over the 10 steps, as
    the stacked path's test allows 1e-3); the planted slot shift fails."""
    from mlxb.adapters import lora
    from mlxb.models import load_model
    from mlxb.models.adapters import build_adapter
    from tests.tiny.test_lora import rows_within

    build_adapter(load_model("tiny-llama")[0], tmp_path / "x", rank=8, seed=1)
    build_adapter(load_model("tiny-llama")[0], tmp_path / "y", rank=4, seed=2, num_layers=1)
    paths = {0: str(tmp_path / "x"), 1: str(tmp_path / "y"), -1: None}
    calls = []

    def fused(x, y, a, b, slots, scales):
        rows = y.size // y.shape[-1]
        got, _ = emulated_split(np.array(x).reshape(rows, -1), np.array(y).reshape(rows, -1), np.array(a),
                                np.array(b), np.array(slots), np.array(scales))
        calls.append(rows)
        return mx.array(got).reshape(y.shape)

    monkeypatch.setattr(lf, "NT", 32)
    monkeypatch.setattr(lf, "TARGET_BLOCKS", 1)  # one block a row: fewer emulated threads (tiles are tested above)
    monkeypatch.setattr(lf, "available", lambda: True)
    monkeypatch.setattr(lf, "fused_delta", fused)
    monkeypatch.setattr(lora, "_FUSED_OK", True)  # the device check needs CUDA; the kernel is checked above
    model, tok, *_ = load_model("tiny-llama")
    ctx = lora.install(model, [lora.read_adapter("x", paths[0]), lora.read_adapter("y", paths[1])], lora_path="fused")
    assert ctx.path == "fused"
    rng = np.random.default_rng(4)
    prompts = [rng.integers(5, 8000, size=n).tolist() for n in (17, 11, 25)]
    worst = rows_within(model, tok, prompts, paths)
    assert max(calls) > 3 and min(calls) <= 3  # prefill chunks and decode steps both
    assert worst < 1e-3, worst


def test_fused_path_is_refused_off_cuda_naming_the_other_paths(tmp_path):
    from mlxb.adapters import lora
    from mlxb.errors import ValidationError
    from mlxb.models import load_model
    from mlxb.models.adapters import build_adapter

    build_adapter(load_model("tiny-llama")[0], tmp_path / "x", rank=4, seed=1)
    model, *_ = load_model("tiny-llama")
    with pytest.raises(ValidationError, match="needs MLX's CUDA backend.*exact or stacked"):
        lora.install(model, [lora.read_adapter("x", str(tmp_path / "x"))], lora_path="fused")


def test_fused_delta_builds_each_shapes_launch_plans_once(monkeypatch):
    """The plans are built once per shape (this runs for every adapted projection of every step) and again when
    the geometry changes; the launch itself is recorded, not run (it needs CUDA)."""
    seen = []

    def kernel(which):
        def launch(inputs, output_dtypes, template, grid, threadgroup, output_shapes):
            seen.append((which, template, grid))  # kept alive, so a rebuilt plan has a new id
            return (mx.zeros(output_shapes[0], dtype=output_dtypes[0]),)
        return launch

    monkeypatch.setattr(lf, "_kernel", kernel)
    monkeypatch.setattr(lf, "_PLANS", {})
    x, y = mx.zeros((4, 1, 96)), mx.zeros((4, 1, 300))
    a, b = mx.zeros((2, 96, 8)), mx.zeros((2, 8, 300))
    slots, scales = mx.array([0, 1, -1, 0], dtype=mx.int32), mx.array([1.0, 2.0])
    for _ in range(3):
        assert lf.fused_delta(x, y, a, b, slots, scales, "split").shape == (4, 1, 300)
    assert [w for w, _, _ in seen] == ["shrink", "expand"] * 3 and len({id(t) for _, t, _ in seen}) == 2
    monkeypatch.setattr(lf, "TARGET_BLOCKS", 1)
    lf.fused_delta(x, y, a, b, slots, scales, "one")
    # at 132 target blocks the 300 outputs took two tiles a row; at 1, one tile a row
    assert seen[1][2] == (2 * lf.NT, 4, 1)
    assert len(lf._PLANS) == 2 and seen[-1][0] == "one" and seen[-1][2] == (lf.NT, 4, 1)
