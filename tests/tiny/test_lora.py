"""LoRA adapters per row: rows of two adapters and the base decode in one batch (joins and retirements)
and each row equals mlx-lm alone with that adapter loaded by ``mlx_lm.tuner.utils.load_adapters``:
tokens and every step's logprob vector, bit for bit on this CPU. A row given the wrong adapter differs."""

import mlx.core as mx
import numpy as np
import pytest

from mlxb.engine.engine import Engine
from mlxb.adapters.lora import install, read_adapter
from mlxb.models.adapters import build_adapter
from mlxb.engine.stream import OutputStream
from mlxb.models import load_model
from mlxb.request import Request, SamplingParams

GEN = 10


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    build_adapter(load_model("tiny-llama")[0], d / "x", rank=8, seed=1)
    build_adapter(load_model("tiny-llama")[0], d / "y", rank=4, seed=2, num_layers=1)  # another rank and depth
    return {"x": str(d / "x"), "y": str(d / "y")}


def reference(prompt, path):
    """mlx-lm alone: the base with the adapter loaded, greedy, every step's logprob vector."""
    from mlx_lm.generate import generate_step
    from mlx_lm.tuner.utils import load_adapters

    m, *_ = load_model("tiny-llama")
    if path is not None:
        load_adapters(m, path)
    m.eval()
    out = []
    for tok, lp in generate_step(mx.array(prompt, dtype=mx.uint32), m, max_tokens=GEN):
        out.append((int(tok), np.array(lp.astype(mx.float32))))
    return out


def run_batch(model, tok, rows, faults=frozenset()):
    captured: dict = {}

    def capture(rid, step, token, vec, geo):
        captured.setdefault(rid, []).append((token, np.array(vec)))

    eng = Engine(model, tok, max_batch=3, prefill_chunk=16, capture=capture, faults=faults)
    pending, k = list(enumerate(rows)), 0
    while pending or eng._live:
        for i, (prompt, slot, arrive) in list(pending):
            if arrive == k:
                eng.accept(Request(f"r{i}", prompt, GEN, SamplingParams(), ignore_eos=True, adapter=slot),
                           OutputStream(f"r{i}"))
                pending.remove((i, (prompt, slot, arrive)))
        eng.iterate()
        k += 1
    return [captured[f"r{i}"] for i in range(len(rows))]


def test_rows_of_different_adapters_in_one_batch_equal_mlx_lm_alone(adapters):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 8000, size=n).tolist() for n in (21, 9, 33, 14)]
    model, tok, *_ = load_model("tiny-llama")
    install(model, [read_adapter("x", adapters["x"]), read_adapter("y", adapters["y"])])
    # x, none and y join at different iterations (3 rows at most), a fourth (x) waits for a slot
    rows = [(prompts[0], 0, 0), (prompts[1], -1, 2), (prompts[2], 1, 3), (prompts[3], 0, 4)]
    ours = run_batch(model, tok, rows)
    paths = {0: adapters["x"], 1: adapters["y"], -1: None}
    for (prompt, slot, _), got in zip(rows, ours):
        ref = reference(prompt, paths[slot])
        assert [t for t, _ in got] == [t for t, _ in ref]
        for (_, a), (_, b) in zip(got, ref):
            assert np.array_equal(a.reshape(-1), b.reshape(-1))
    # the adapters change the model, so a row given another adapter than its own differs
    assert [t for t, _ in reference(prompts[0], None)] != [t for t, _ in ours[0]] or not np.array_equal(
        reference(prompts[0], None)[0][1].reshape(-1), ours[0][0][1].reshape(-1))


def test_install_refuses_what_it_cannot_serve(adapters, tmp_path):
    from mlxb.errors import ValidationError

    model, *_ = load_model("tiny-llama")
    with pytest.raises(ValidationError, match="max-lora-rank"):
        install(model, [read_adapter("x", adapters["x"])], max_rank=4)
    with pytest.raises(ValidationError, match="not an mlx-lm adapter folder"):
        read_adapter("nope", tmp_path)


def test_stacked_path_gives_each_row_its_own_adapter(adapters):
    """The stacked path (CUDA's default: every adapter's shrink at once, a per-row mask, addmm) keeps
    each row on its own adapter: tokens equal mlx-lm alone with that adapter, logprobs within float32
    rounding (other summation order, scale folded into B). Rows shifted by one slot (the planted
    fault) no longer do."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(5, 8000, size=n).tolist() for n in (17, 11, 25)]
    model, tok, *_ = load_model("tiny-llama")
    install(model, [read_adapter("x", adapters["x"]), read_adapter("y", adapters["y"])], lora_path="stacked")
    mods = [m for _, m in model.named_modules() if type(m).__name__ == "MultiLoRALinear"]
    assert mods and all(m._stacked for m in mods)
    paths = {0: adapters["x"], 1: adapters["y"], -1: None}
    assert rows_within(model, tok, prompts, paths) < 1e-3


def rows_within(model, tok, prompts, paths) -> float:
    """Rows of adapters x, y and none in one batch: each row's tokens equal mlx-lm alone with its adapter; returns
    the largest logprob difference. The planted fault (every row's slot shifted by one, so rows take their
    neighbour's adapter) must change the first row."""
    rows = [(prompts[0], 0, 0), (prompts[1], 1, 0), (prompts[2], -1, 1)]
    ours = run_batch(model, tok, rows)
    worst = 0.0
    for (prompt, slot, _), got in zip(rows, ours):
        ref = reference(prompt, paths[slot])
        assert [t for t, _ in got] == [t for t, _ in ref]
        worst = max(worst, max(float(np.abs(a.reshape(-1) - b.reshape(-1)).max()) for (_, a), (_, b) in zip(got, ref)))
    shifted = run_batch(model, tok, rows[:2], faults=frozenset({"lora_shift"}))
    ref0 = reference(prompts[0], paths[0])
    assert [t for t, _ in shifted[0]] != [t for t, _ in ref0] or max(
        float(np.abs(a.reshape(-1) - b.reshape(-1)).max()) for (_, a), (_, b) in zip(shifted[0], ref0)) > 1e-2
    return worst


def test_stacked_mask_puts_each_rows_scale_on_its_adapters_block():
    from mlxb.adapters.lora import LoRAContext

    ctx = LoRAContext(["a", "b", "c"])
    ctx.scales, ctx.rank = [2.0, 3.0, 5.0], 2
    ctx.set([2, -1, 0])
    m = np.array(ctx.mask(mx.float32))
    assert m.shape == (3, 1, 6)
    assert m[0, 0].tolist() == [0, 0, 0, 0, 5, 5] and m[1, 0].tolist() == [0] * 6 and m[2, 0].tolist() == [2, 2, 0, 0, 0, 0]


def test_context_keeps_a_steady_batchs_row_arrays_and_rebuilds_masks_each_forward():
    """A forward with the same rows as the last one reuses their slot arrays (no new host copies per step); a
    change of rows makes new ones; masks (lazy arrays) are made again for every forward."""
    from mlxb.adapters.lora import LoRAContext

    ctx = LoRAContext(["a", "b"])
    ctx.scales, ctx.rank = [2.0, 3.0], 2
    ctx.set([1, -1, 0])
    ids, rs, m = ctx.ids, ctx.row_slots(mx.zeros((3, 1, 4))), ctx.mask(mx.float32)
    ctx.set([1, -1, 0])
    assert ctx.ids is ids and ctx.row_slots(mx.zeros((3, 1, 4))) is rs and ctx.mask(mx.float32) is not m
    assert ctx.row_slots(mx.zeros((3, 5, 4))).tolist() == [1] * 5 + [-1] * 5 + [0] * 5  # a verify step's rows
    ctx.set([0, -1, 1])
    assert ctx.ids is not ids and ctx.ids.tolist() == [0, 0, 1] and ctx.row_slots(mx.zeros((3, 1, 4))).tolist() == [0, -1, 1]
    assert np.array(ctx.mask(mx.float32))[0, 0].tolist() == [2, 2, 0, 0]
    ctx.set([-1, -1])
    assert ctx.ids is None and ctx.one is None


def test_lora_path_choice_flag_over_environment(adapters, monkeypatch):
    """``install(lora_path=...)`` (``--lora-path``) wins over MLXB_LORA_PATH; auto is exact off CUDA; an unknown
    path is refused naming the choices; /stats reports the path taken."""
    from mlxb.errors import ValidationError

    monkeypatch.setenv("MLXB_LORA_PATH", "stacked")
    model, *_ = load_model("tiny-llama")
    ctx = install(model, [read_adapter("x", adapters["x"])], lora_path="exact")
    assert ctx.path == "exact" and ctx.stats()["lora_path"] == "exact"
    model, *_ = load_model("tiny-llama")
    assert install(model, [read_adapter("x", adapters["x"])]).path == "stacked"  # from the environment
    monkeypatch.delenv("MLXB_LORA_PATH")
    model, *_ = load_model("tiny-llama")
    on_cuda = mx.cuda.is_available() and mx.default_device() == mx.gpu
    assert install(model, [read_adapter("x", adapters["x"])]).path == ("stacked" if on_cuda else "exact")
    model, *_ = load_model("tiny-llama")
    with pytest.raises(ValidationError, match="exact, stacked"):
        install(model, [read_adapter("x", adapters["x"])], lora_path="fast")


def test_concat_path_gives_each_row_its_own_adapter(adapters):
    """The concatenated path (q/k/v and gate/up as one product each, every adapter's shrink riding on it, one
    ``addmm`` of the masked shrinks) keeps each row on its own adapter: tokens equal mlx-lm alone with that
    adapter, logprobs within float32 rounding; the planted slot shift changes the first row. Adapter y covers
    only the last layer, so groups it does not touch carry zero factors for it."""
    from mlxb.adapters.concat import CatLoRAPart

    rng = np.random.default_rng(5)
    prompts = [rng.integers(5, 8000, size=n).tolist() for n in (19, 8, 27)]
    model, tok, *_ = load_model("tiny-llama")
    ctx = install(model, [read_adapter("x", adapters["x"]), read_adapter("y", adapters["y"])], lora_path="concat")
    assert ctx.path == "concat" and ctx.stats()["lora_path"] == "concat"
    parts = [n for n, m in model.named_modules() if isinstance(m, CatLoRAPart)]
    assert any(n.endswith("self_attn.k_proj") for n in parts) and any(n.endswith("mlp.down_proj") for n in parts)
    assert not [n for n, m in model.named_modules() if type(m).__name__ == "MultiLoRALinear"]
    paths = {0: adapters["x"], 1: adapters["y"], -1: None}
    assert rows_within(model, tok, prompts, paths) < 1e-3


def test_concat_block_mask_selects_each_rows_adapter_block():
    from mlxb.adapters.lora import LoRAContext

    ctx = LoRAContext(["a", "b"])
    ctx.set([1, -1, 0])
    m = np.array(ctx.block_mask(mx.float32, 3))
    assert m.shape == (3, 1, 6)
    assert m[0, 0].tolist() == [0, 0, 0, 1, 1, 1] and m[1, 0].tolist() == [0] * 6 and m[2, 0].tolist() == [1, 1, 1, 0, 0, 0]


def test_concat_path_leaves_quantized_layers_to_the_per_projection_path(adapters):
    """A quantized base cannot take the factors' rows: with concat asked for, its projections keep a
    ``MultiLoRALinear`` (the exact path here) and the adapted model still runs and differs from the base."""
    import mlx.nn as nn

    model, *_ = load_model("tiny-llama")
    nn.quantize(model, group_size=32, bits=4)
    ctx = install(model, [read_adapter("x", adapters["x"])], lora_path="concat")
    kinds = {type(m).__name__ for _, m in model.named_modules()}
    assert "MultiLoRALinear" in kinds and "CatLoRAPart" not in kinds and ctx.path == "exact"
    x = mx.array([[5, 17, 300, 41]], dtype=mx.uint32)
    ctx.set([-1])
    base = model(x)
    ctx.set([0])
    assert not mx.allclose(model(x), base).item()
