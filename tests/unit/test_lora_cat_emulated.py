"""The concat LoRA path's one-launch expand (``mlxb.kernels.lora_cat``) run on the CPU through the C++ emulation of
its CUDA source (tests/unit/cuda_emulation.py), with the launch geometry ``expand`` uses: every row must equal
the concat path's own MLX ops (mask the product's shrinks, ``addmm`` the expand factors, slice the outputs), a
row without an adapter keeps its base outputs bit for bit, outputs of an untouched part get no delta, and a
ragged last block is covered. A planted bug (each row reading the next adapter's shrinks) must fail. Then the
engine, with the kernel emulated, gives each row mlx-lm's tokens with its adapter."""

import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlxb.kernels import lora_cat

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the CUDA emulation")

F32, I32 = np.float32, np.int32


def emulated(p, bp, zoff, slots, width, source=lora_cat.SOURCE):
    from tests.unit.cuda_emulation import EmulatedKernel

    plan = lora_cat.launch_plan(p.shape[:-1], zoff.shape[0], bp.shape[1], width, p.shape[-1], "float")
    k = EmulatedKernel("mlxb_lora_cat_expand", [("p", F32), ("bp", F32), ("zoff", I32), ("slot", I32)],
                       [("out", F32)], source, "", {k: v for k, v in plan["template"]})
    ins = dict(p=np.asarray(p, F32), bp=np.asarray(bp, F32), zoff=np.asarray(zoff, I32), slot=np.asarray(slots, I32))
    return k(ins, {"out": plan["output_shapes"][0]}, plan["grid"], plan["threadgroup"])["out"]


def case(rows, parts, touched, rank, n, seed):
    """A group's product ``[y | z]`` and its factors, built the way the concat group builds them."""
    rng = np.random.default_rng(seed)
    O = parts[-1][1]
    width = len(touched) * rank
    b_parts = [mx.array((0.1 * rng.standard_normal((n, rank, e - s))).astype(F32)) if j in touched else None
               for j, (s, e) in enumerate(parts)]
    scales = [20.0, 2.0, 0.5, 8.0][:n]
    bp, zoff = lora_cat.factors(b_parts, parts, scales, O, mx.float32)
    p = rng.standard_normal((rows, O + n * width)).astype(F32)
    slots = np.array([(i % (n + 1)) - 1 for i in range(rows)], dtype=I32)  # -1 (none), 0, 1, ...
    return p, b_parts, scales, np.array(bp), np.array(zoff), slots, width


def addmm_rows(p, b_parts, parts, scales, slots, rank, width):
    """The concat path's MLX formula in numpy: the row mask over the shrinks, the expand factors with the scales
    folded in and zero columns over the shrinks, added onto the product, the outputs sliced back out."""
    n, O = len(scales), parts[-1][1]
    mask = np.zeros((len(slots), n * width), F32)
    for i, s in enumerate(slots):
        if s >= 0:
            mask[i, s * width : (s + 1) * width] = 1
    rows = []
    for i in range(n):
        k = 0
        for b, (s, e) in zip(b_parts, parts):
            if b is None:
                continue
            block = np.zeros((rank, O + n * width), F32)
            block[:, s:e] = scales[i] * np.array(b[i])
            rows.append(block)
            k += 1
    b_ext = np.concatenate(rows)
    return (p + (p[:, O:] * mask) @ b_ext)[:, :O]


@pytest.mark.parametrize("rows,parts,touched,rank,n", [
    (5, [(0, 300), (300, 364), (364, 428)], [0, 1, 2], 8, 3),  # q/k/v, every part adapted, ragged last block
    (4, [(0, 200), (200, 450)], [1], 4, 2),  # gate/up with only up adapted
    (3, [(0, 96)], [0], 16, 1),  # a single projection (o or down), one block
])
def test_emulated_expand_equals_the_addmm_formula(rows, parts, touched, rank, n):
    p, b_parts, scales, bp, zoff, slots, width = case(rows, parts, touched, rank, n, seed=rows * 7 + rank)
    got = emulated(p, bp, zoff, slots, width)
    want = addmm_rows(p, b_parts, parts, scales, slots, rank, width)
    O = parts[-1][1]
    none = slots < 0
    assert none.any() and (~none).any()
    assert np.array_equal(got[none], p[none, :O])  # no adapter: the base outputs, untouched
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())
    assert np.abs(got[~none] - p[~none, :O]).max() > 1e-2  # the delta is really there
    for j, (s, e) in enumerate(parts):
        if j not in touched:  # an untouched part: base outputs for every row
            assert np.array_equal(got[:, s:e], p[:, s:e])
    assert (O % lora_cat.NT) or O < lora_cat.NT or rows < 4  # the cases cover a ragged last block


def test_a_shifted_adapter_fails():
    parts = [(0, 128), (128, 256)]
    p, b_parts, scales, bp, zoff, slots, width = case(4, parts, [0, 1], 8, 3, seed=2)
    planted = lora_cat.SOURCE.replace("const T* z = p + pr + O + (size_t)s * W + zo;",
                                      "const T* z = p + pr + O + (size_t)((s + 1) % bp_shape[0]) * W + zo;")
    assert planted != lora_cat.SOURCE
    got = emulated(p, bp, zoff, slots, width, planted)
    assert np.abs(got - addmm_rows(p, b_parts, parts, scales, slots, 8, width)).max() > 1e-2


def test_reference_is_the_addmm_formula():
    """``reference`` (what the device self-check compares the kernel with) computes the same rows."""
    parts = [(0, 70), (70, 100), (100, 160)]
    p, b_parts, scales, bp, zoff, slots, width = case(5, parts, [0, 2], 8, 3, seed=3)
    got = lora_cat.reference(mx.array(p), mx.array(bp), mx.array(zoff), mx.array(slots), width)
    want = addmm_rows(p, b_parts, parts, scales, slots, 8, width)
    assert np.abs(np.array(got) - want).max() < 1e-5 * max(1.0, np.abs(want).max())


def test_expand_builds_each_shapes_plan_once(monkeypatch):
    """The plan is built once per shape (this runs for every adapted group of every step); the launch itself is
    recorded, not run (it needs CUDA)."""
    seen = []

    def launch(inputs, output_dtypes, template, grid, threadgroup, output_shapes):
        seen.append((inputs[0].shape, template, grid))
        return (mx.zeros(output_shapes[0], dtype=output_dtypes[0]),)

    monkeypatch.setattr(lora_cat, "_kernel", lambda: launch)
    monkeypatch.setattr(lora_cat, "_PLANS", {})
    p, bp, zoff = mx.zeros((4, 1, 300 + 2 * 16)), mx.zeros((2, 8, 300)), mx.zeros((300,), dtype=mx.int32)
    slots = mx.array([0, 1, -1, 0], dtype=mx.int32)
    for _ in range(3):
        assert lora_cat.expand(p, bp, zoff, slots, 16).shape == (4, 1, 300)
    assert len({id(t) for _, t, _ in seen}) == 1 and seen[0][0] == (4, 1, 332)  # the product as it is: no reshape
    assert seen[0][2] == (2 * lora_cat.NT, 4, 1)  # 300 outputs: two blocks a row
    assert ("P", 332) in seen[0][1]
    assert lora_cat.expand(mx.zeros((2, 3, 332)), bp, zoff, mx.zeros((6,), dtype=mx.int32), 16).shape == (2, 3, 300)
    assert len(lora_cat._PLANS) == 2 and seen[-1][2] == (2 * lora_cat.NT, 6, 1)


def install_emulated(tmp_path, monkeypatch, max_rows):
    """tiny-llama with adapters x (rank 8) and y (rank 4, last layer only) on the concat path, the kernel emulated
    (32 threads a block) for forwards of up to ``max_rows`` rows. Returns model, tokenizer, adapter folders by
    slot, and the row count of every emulated launch."""
    from mlxb.adapters import lora
    from mlxb.models import load_model
    from mlxb.models.adapters import build_adapter

    build_adapter(load_model("tiny-llama")[0], tmp_path / "x", rank=8, seed=1)
    build_adapter(load_model("tiny-llama")[0], tmp_path / "y", rank=4, seed=2, num_layers=1)
    paths = {0: str(tmp_path / "x"), 1: str(tmp_path / "y"), -1: None}
    calls = []

    def expand(p, bp, zoff, slots, width):
        got = emulated(np.array(p.astype(mx.float32)), np.array(bp.astype(mx.float32)), np.array(zoff),
                       np.array(slots), width)
        calls.append(p.shape[:-1])
        return mx.array(got).astype(p.dtype)

    monkeypatch.setattr(lora_cat, "NT", 32)
    monkeypatch.setattr(lora_cat, "MAX_ROWS", max_rows)
    monkeypatch.setattr(lora_cat, "expand", expand)
    monkeypatch.setattr(lora, "_cat_kernel", lambda cuda: (True, None))  # the device check needs CUDA
    model, tok, *_ = load_model("tiny-llama")
    ctx = lora.install(model, [lora.read_adapter("x", paths[0]), lora.read_adapter("y", paths[1])],
                       lora_path="concat")
    assert ctx.path == "concat" and ctx.stats()["concat_kernel"] is True
    return model, tok, paths, calls


@pytest.mark.full
def test_engine_rows_take_the_kernel_and_keep_their_adapters(tmp_path, monkeypatch):
    """``--lora-path concat`` in the engine with the kernel emulated: rows of two adapters and the base in one
    batch give the tokens of mlx-lm alone with each row's adapter; decode steps take the kernel, prefill chunks
    above ``MAX_ROWS`` keep the ``addmm``; the planted slot shift fails."""
    from tests.tiny.test_lora import rows_within

    model, tok, paths, calls = install_emulated(tmp_path, monkeypatch, max_rows=8)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(5, 8000, size=n).tolist() for n in (17, 11, 25)]
    worst = rows_within(model, tok, prompts, paths)
    rows = [int(np.prod(c)) for c in calls]
    assert rows and max(rows) <= 8  # decode steps took it; the longer prefill chunks did not
    assert worst < 1e-3, worst


def test_off_cuda_the_concat_path_takes_no_kernel(tmp_path):
    from mlxb.adapters import lora
    from mlxb.models import load_model
    from mlxb.models.adapters import build_adapter

    build_adapter(load_model("tiny-llama")[0], tmp_path / "x", rank=4, seed=1)
    model, *_ = load_model("tiny-llama")
    ctx = lora.install(model, [lora.read_adapter("x", str(tmp_path / "x"))], lora_path="concat")
    assert ctx.stats()["concat_kernel"] is False and ctx.stats()["concat_kernel_off"] is None
    assert not lora_cat.available()


def test_speculating_rows_of_two_adapters_take_the_kernel_and_keep_plain_tokens(tmp_path, monkeypatch):
    """Lookup speculation with the kernel emulated: verify steps of [B, K+1] rows (each row's slot repeated over
    its positions) give the same greedy tokens as plain decoding, rows of two adapters and the base together."""
    from mlxb.engine.engine import Engine
    from mlxb.engine.stream import OutputStream
    from mlxb.request import Request, SamplingParams
    from tests.tiny.test_spec import SPEC, repetitive_prompts

    model, tok, _, shapes = install_emulated(tmp_path, monkeypatch, max_rows=16)
    prompts, slots = repetitive_prompts()[:3], [0, 1, -1]

    def run(spec):
        eng = Engine(model, tok, max_batch=3, prefill_chunk=16, spec=spec)
        streams = {}
        for i, (p, s) in enumerate(zip(prompts, slots)):
            streams[i] = OutputStream(f"r{i}")
            eng.accept(Request(f"r{i}", p, 10, SamplingParams(), ignore_eos=True, adapter=s), streams[i])
        while eng._live:
            eng.iterate()
        outs = []
        for i in range(len(prompts)):
            items = []
            while not streams[i]._q.empty():
                x = streams[i]._q.get()
                if hasattr(x, "request_id") and x.token is not None:
                    items.append(x.token)
            outs.append(items)
        return outs, eng

    plain, _ = run(None)
    shapes.clear()
    spec, eng = run(SPEC)
    assert spec == plain and all(len(t) == 10 for t in spec)
    assert eng.spec_stats()["verify_steps"] > 0
    assert any(len(s) == 2 and s[1] > 1 for s in shapes)  # verify steps' [B, K+1] rows went through the kernel
