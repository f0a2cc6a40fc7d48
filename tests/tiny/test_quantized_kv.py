"""--kv-bits under batching: rows on the batch lane (alone or in a staggered batch) give exactly the
tokens and logprob vectors of mlx-lm's own generate_step with the same kv_bits / group size / start."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlxb.cache.quantized import BatchQuantizedKVCache, KVScheme
from mlxb.cache.quantized_ring import BatchQuantizedRotatingKVCache
from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.request import Request, SamplingParams

GROUP = 32  # the tiny presets' head dimension is 32


def reference(model, prompt, bits, start, n):
    return [(int(t), np.array(lp.astype(mx.float32))) for t, lp in generate_step(
        mx.array(prompt), model, max_tokens=n, kv_bits=bits, kv_group_size=GROUP, quantized_kv_start=start,
        prefill_step_size=16)]


def engine_rows(model, tok, prompts, arrive, bits, start, batch, n):
    recs, seen = {}, {"quantized_batch": False, "rings": False}

    def capture(rid, step, token, vec, geo):
        recs.setdefault(rid, []).append((token, vec))

    eng = Engine(model, tok, max_batch=batch, prefill_chunk=16, capture=capture, kv_scheme=KVScheme(bits, GROUP, start))
    todo = list(enumerate(zip(prompts, arrive)))
    k = 0
    while todo or eng._live or eng._serial:
        for i, (p, a) in list(todo):
            if a == k:
                r = Request(f"r{i}", p, n, SamplingParams(), ignore_eos=True)
                r.mechanism = "continuous" if batch > 1 else "serial"
                eng.accept(r, OutputStream(r.request_id))
                todo.remove((i, (p, a)))
        eng.iterate()
        if eng.runner.merged and any(isinstance(c, BatchQuantizedKVCache) for c in eng.runner.caches):
            seen["quantized_batch"] = True
        if eng.runner.merged and any(isinstance(c, BatchQuantizedRotatingKVCache) for c in eng.runner.caches):
            seen["rings"] = True
        if eng.runner.caches is not None:
            seen["caches"] = list(eng.runner.caches)
        k += 1
    return [recs[f"r{i}"] for i in range(len(prompts))], seen, eng


def same(a, b):
    return [t for t, _ in a] == [t for t, _ in b] and all(np.array_equal(x, y) for (_, x), (_, y) in zip(a, b))


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models("tiny-llama")[:2]


@pytest.mark.parametrize("bits,start", [(8, 0), (4, 0), (4, 20)])
@pytest.mark.parametrize("batch", [4, 1])
def test_a_lone_row_equals_generate_step(llama, bits, start, batch):
    model, tok = llama
    p = np.random.default_rng(1).integers(5, 8000, size=30).tolist()
    (ours,), _, _ = engine_rows(model, tok, [p], [0], bits, start, batch, 10)
    assert same(ours, reference(model, p, bits, start, 10))


@pytest.mark.parametrize("bits", [8, 4])
def test_staggered_batch_rows_equal_generate_step_row_by_row(llama, bits):
    model, tok = llama
    rng = np.random.default_rng(2)
    prompts = [rng.integers(5, 8000, size=n).tolist() for n in (30, 17, 45)]
    ours, seen, eng = engine_rows(model, tok, prompts, [0, 2, 4], bits, 0, 4, 10)
    assert seen["quantized_batch"] and eng.counters["batched_steps"] > 0
    for o, p in zip(ours, prompts):
        assert same(o, reference(model, p, bits, 0, 10))


@pytest.fixture
def whole_buffer(monkeypatch):
    """The read MLX's CUDA backend needs (its quantized matmul refuses strided slices), forced on this CPU."""
    import mlxb.cache.quantized_read as q

    monkeypatch.setattr(q, "_WHOLE", True)


@pytest.mark.parametrize("bits", [8, 4])
def test_whole_buffer_reads_change_no_bit(llama, monkeypatch, bits):
    """Reading the whole packed buffer with the unwritten tail masked adds exact zeros: a staggered batch
    (one row past a 256-token buffer step, joiners padded against it) gives the strided read's tokens and
    logprob vectors bit for bit, and a lone row (batch lane and serial lane) is mlx-lm's generate_step."""
    import mlxb.cache.quantized_read as q

    model, tok = llama
    rng = np.random.default_rng(5)
    prompts = [rng.integers(5, 8000, size=n).tolist() for n in (300, 17, 45)]
    runs = {}
    for whole in (False, True):
        monkeypatch.setattr(q, "_WHOLE", whole)
        runs[whole], seen, eng = engine_rows(model, tok, prompts, [0, 2, 4], bits, 20, 4, 10)
        assert seen["quantized_batch"] and eng.counters["batched_steps"] > 0
    assert all(same(a, b) for a, b in zip(runs[False], runs[True]))
    assert same(runs[True][0], reference(model, prompts[0], bits, 20, 10))  # the first row is never padded
    assert q.whole_buffer_reads()
    (alone,), _, eng = engine_rows(model, tok, prompts[1:2], [0], bits, 0, 1, 10)
    assert eng.counters["serial_requests"] == 1 and same(alone, reference(model, prompts[1], bits, 0, 10))
    c = q.QuantizedRowCache(group_size=GROUP, bits=bits)
    k = mx.ones((1, 2, 5, 32))
    keys, _ = c.update_and_fetch(k, k)
    assert keys[0].shape[2] == 256 and c.make_mask(1).shape == (1, 256)  # the whole buffer, and a mask as wide


def test_whole_buffer_reads_refuse_a_mixed_per_layer_plan(llama, whole_buffer):
    from mlxb.cache.quantized import KVPlan

    model, tok = llama
    n = len(model.layers)
    plan = KVPlan([None] + [KVScheme(4, GROUP, 0)] * (n - 1))
    with pytest.raises(ValueError, match="reads whole KV buffers"):
        Engine(model, tok, max_batch=4, kv_scheme=plan)
    Engine(model, tok, max_batch=4, kv_scheme=KVPlan([KVScheme(4, GROUP, 0)] * n))  # uniform: fine


def test_quantized_rows_cost_their_packed_bytes_at_admission(llama):
    model, tok = llama
    plain = Engine(model, tok, max_batch=64).projection.row_bytes(4096)
    kv4 = Engine(model, tok, max_batch=64, kv_scheme=KVScheme(4, GROUP, 0)).projection.row_bytes(4096)
    kv8 = Engine(model, tok, max_batch=64, kv_scheme=KVScheme(8, GROUP, 0)).projection.row_bytes(4096)
    late = Engine(model, tok, max_batch=64, kv_scheme=KVScheme(4, GROUP, 8192)).projection.row_bytes(4096)
    assert plain / kv4 >= 3.5 and plain / kv8 >= 1.8 and late == plain  # not converted before the start
    budget = 10 * plain
    assert budget // kv4 >= 3.5 * (budget // plain)


def test_bad_kv_flags_are_clear_errors():
    from mlxb.engine.build import build_gateway
    from mlxb.errors import ValidationError

    with pytest.raises(ValidationError, match="head dimension"):
        build_gateway("tiny-llama", kv_bits=4, kv_group_size=64, warmup=False)
    with pytest.raises(ValidationError, match="--kv-bits 7"):
        build_gateway("tiny-llama", kv_bits=7, warmup=False)


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-gemma4"])
@pytest.mark.parametrize("bits", [8, 4])
def test_sliding_window_rings_quantize_and_a_lone_row_is_the_same_on_both_lanes(tiny_models, name, bits):
    """Sliding-window layers quantize too (mlx-lm raises there). A lone row whose ring wraps (90 tokens,
    window 64) gives the same tokens and logprob vectors, bit for bit, on the batch lane (mlxb's
    conversion at chunk ends) and on the serial lane (mlx-lm's generate_step converting through
    ``to_quantized``); Gemma 4's KV-shared source layer stays at full width (its readers have no cache)."""
    from mlxb.cache.quantized_ring import QuantizedRotatingKVCache

    model, tok = tiny_models(name)[:2]
    p = np.random.default_rng(1).integers(5, 8000, size=90).tolist()
    (batch_lane,), seen, eng = engine_rows(model, tok, [p], [0], bits, 0, 4, 12)
    (serial,), _, eng1 = engine_rows(model, tok, [p], [0], bits, 0, 1, 12)
    assert eng1.counters["serial_requests"] == 1 and same(batch_lane, serial)
    kinds = [type(c).__name__ for c in seen["caches"]]
    shared = {"tiny-gemma3": set(), "tiny-gemma4": {2}}[name]
    for i, (k, c) in enumerate(zip(eng.kinds, seen["caches"])):
        if k == "rotating":
            assert isinstance(c, QuantizedRotatingKVCache) != (i in shared), (i, kinds)
    assert (eng.kv_scheme.layers[2] is None) == (name == "tiny-gemma4")


@pytest.mark.parametrize("bits", [8, 4])
def test_staggered_batch_of_quantized_rings(tiny_models, bits):
    """Rows that join a running batch one by one (each prefilled alone) decode in
    ``BatchQuantizedRotatingKVCache`` layers, rings wrapping inside the batch, and give the serial
    lane's tokens. Their logprob vectors match it to padding-level rounding (a padded row's attention
    reduces over a longer masked key axis: the same order of difference as at full width)."""
    model, tok = tiny_models("tiny-gemma3")[:2]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 8000, size=n).tolist() for n in (70, 20, 90)]
    ours, seen, eng = engine_rows(model, tok, prompts, [0, 6, 10], bits, 0, 4, 40)
    assert seen["quantized_batch"] and eng.counters["batched_steps"] > 0
    assert seen["rings"]
    for o, p in zip(ours, prompts):
        (alone,), _, _ = engine_rows(model, tok, [p], [0], bits, 0, 1, 40)
        assert [t for t, _ in o] == [t for t, _ in alone]
        assert max(float(np.abs(x - y).max()) for (_, x), (_, y) in zip(o, alone)) < 1e-3


def test_per_layer_plan_quantizes_only_the_layers_it_names(llama, tmp_path):
    """--kv-config: the first layer at full width, the others KV4; a uniform file equals --kv-bits."""
    import json

    from mlxb.cache.quantized import KVPlan

    model, tok = llama
    n = len(model.layers)
    cfg = tmp_path / "kv.json"
    assert n >= 2
    cfg.write_text(json.dumps({"bits": 4, "group_size": GROUP, "layers": {"0": "none"}}))
    plan = KVPlan.from_file(str(cfg), n)
    assert [s is None for s in plan.layers] == [True] + [False] * (n - 1) and plan.uniform is None
    rng = np.random.default_rng(4)
    prompts = [rng.integers(5, 8000, size=k).tolist() for k in (30, 17, 45)]
    ours, seen, eng = engine_rows_plan(model, tok, prompts, [0, 2, 4], plan, 4, 10)
    kinds = [type(c).__name__ for c in eng.last_caches]
    assert kinds[0] != "BatchQuantizedKVCache" and all(k == "BatchQuantizedKVCache" for k in kinds[1:])
    full = Engine(model, tok, max_batch=4).projection.row_bytes(1024)
    kv4 = Engine(model, tok, max_batch=4, kv_scheme=KVScheme(4, GROUP, 0)).projection.row_bytes(1024)
    mixed = eng.projection.row_bytes(1024)
    assert kv4 < mixed < full
    # a uniform file is --kv-bits: the same tokens and logprobs
    cfg.write_text(json.dumps({"bits": 8, "group_size": GROUP}))
    a, _, _ = engine_rows_plan(model, tok, prompts, [0, 2, 4], KVPlan.from_file(str(cfg), n), 4, 10)
    b, _, _ = engine_rows(model, tok, prompts, [0, 2, 4], 8, 0, 4, 10)
    assert all(same(x, y) for x, y in zip(a, b))


def engine_rows_plan(model, tok, prompts, arrive, plan, batch, n):
    recs = {}

    def capture(rid, step, token, vec, geo):
        recs.setdefault(rid, []).append((token, vec))

    eng = Engine(model, tok, max_batch=batch, prefill_chunk=16, capture=capture, kv_scheme=plan)
    todo = list(enumerate(zip(prompts, arrive)))
    k, eng.last_caches = 0, None
    while todo or eng._live:
        for i, (p, a) in list(todo):
            if a == k:
                r = Request(f"r{i}", p, n, SamplingParams(), ignore_eos=True)
                eng.accept(r, OutputStream(r.request_id))
                todo.remove((i, (p, a)))
        eng.iterate()
        if eng.runner.merged:
            eng.last_caches = list(eng.runner.caches)
        k += 1
    return [recs[f"r{i}"] for i in range(len(prompts))], None, eng


@pytest.mark.parametrize("text,match", [
    ("not json", "cannot read it as JSON"),
    ('{"bits": 4, "layers": {"99": "none"}}', "outside this model"),
    ('{"bits": 4, "layers": {"1": "half"}}', "must be"),
    ('{"bits": 4, "colour": 1}', "unknown key"),
])
def test_bad_kv_config_files_name_the_problem(tmp_path, text, match):
    from mlxb.engine.build import build_gateway
    from mlxb.errors import ValidationError

    f = tmp_path / "kv.json"
    f.write_text(text)
    with pytest.raises(ValidationError, match=match):
        build_gateway("tiny-llama", kv_config=str(f), warmup=False)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_prompt_cache_stores_and_serves_quantized_rows(tiny_models, name, tmp_path):
    """--kv-bits with the prompt cache: a repeat hits len-1 tokens and gives the first run's tokens and
    logprobs; so does a hit restored from the SSD tier; a follow-up turn extends a retired row. Gemma 3's
    quantized rings are stored as mlx-lm classes and come back as rings."""
    from mlxb.cache.prompt_cache import PromptCache

    model, tok = tiny_models(name)[:2]
    recs = {}

    def capture(rid, step, token, vec, geo):
        recs.setdefault(rid, []).append((token, vec))

    eng = Engine(model, tok, max_batch=4, prefill_chunk=16, capture=capture, kv_scheme=KVScheme(4, GROUP, 0))
    pc = PromptCache(model, eng.kinds, max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30,
                     kv_scheme=eng.kv_scheme.name)
    eng.attach_prompt_cache(pc)
    assert "kv=kv4g32s0" in pc.namespace

    def ask(rid, prompt, n=8):
        r = Request(rid, prompt, n, SamplingParams(), ignore_eos=True)
        eng.accept(r, OutputStream(rid))
        while eng._live:
            eng.iterate()
        return r

    p = np.random.default_rng(5).integers(5, 8000, size=40).tolist()
    first = ask("a", p)
    again = ask("b", p)
    assert first.cached_tokens == 0 and again.cached_tokens == len(p) - 1
    assert same(recs["a"], recs["b"])
    pc.spill_all()
    assert pc.disk.flush() and pc.nbytes == 0
    third = ask("c", p)  # from the SSD tier: packed arrays saved and loaded back
    assert third.cached_tokens == len(p) - 1 and same(recs["a"], recs["c"])
    turn2 = p + [t for t, _ in recs["a"]] + [11, 12, 13]
    nxt = ask("d", turn2)
    assert nxt.cached_tokens >= len(p) + 7  # prompt + output of the retired row (its last token is re-fed)
    pc.ram.check_integrity()


def test_kv_config_kind_keys_keep_sliding_window_layers_full(tiny_models, tmp_path):
    """``"sliding": "none"`` keeps every sliding-window layer at full width, an index overrides its kind,
    and the engine then runs plain rings next to quantized full-attention layers."""
    import json

    from mlxb.cache.kv_plan import KVPlan
    from mlxb.cache.protocol import layer_kinds

    model, tok = tiny_models("tiny-gemma3")[:2]
    kinds = layer_kinds(model)
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"bits": 4, "group_size": GROUP, "layers": {"sliding": "none", "0": 8}}))
    plan = KVPlan.from_file(str(cfg), len(kinds), kinds)
    assert kinds == ["rotating", "full", "rotating", "full"]
    assert [None if s is None else s.bits for s in plan.layers] == [8, 4, None, 4]
    rng = np.random.default_rng(6)
    prompts = [rng.integers(5, 8000, size=k).tolist() for k in (70, 20)]
    ours, seen, eng = engine_rows_plan(model, tok, prompts, [0, 6], plan, 4, 8)
    names = [type(c).__name__ for c in eng.last_caches]
    assert names == ["BatchQuantizedRotatingKVCache", "BatchQuantizedKVCache", "BatchRotatingKVCache",
                     "BatchQuantizedKVCache"], names


def test_serial_lane_runs_a_per_layer_plan_layer_by_layer(llama):
    """--batch 1 with a --kv-config: mlx-lm's generate_step converts through each layer's own
    to_quantized, so a layer the plan keeps stays full width; a lone row gives the same tokens and
    logprob vectors on the serial lane and on the batch lane."""
    from mlxb.cache.kv_plan import KVPlan
    from mlxb.cache.quantized import serial_caches
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = llama
    n = len(model.layers)
    plan = KVPlan([None] + [KVScheme(4, GROUP, 0)] * (n - 1))
    p = np.random.default_rng(9).integers(5, 8000, size=40).tolist()
    (serial,), _, e1 = engine_rows_plan_lane(model, tok, p, plan, 1)
    (batch,), _, _ = engine_rows_plan_lane(model, tok, p, plan, 4)
    assert e1.counters["serial_requests"] == 1 and same(serial, batch)
    caches = serial_caches(make_prompt_cache(model), ["full"] * n, plan)
    conv = [c.to_quantized(group_size=64, bits=8) for c in caches]
    assert conv[0] is caches[0] and all(hasattr(c, "bits") and c.bits == 4 for c in conv[1:])


def engine_rows_plan_lane(model, tok, prompt, plan, batch):
    recs = {}

    def capture(rid, step, token, vec, geo):
        recs.setdefault(rid, []).append((token, vec))

    eng = Engine(model, tok, max_batch=batch, prefill_chunk=16, capture=capture, kv_scheme=plan)
    r = Request("r0", prompt, 10, SamplingParams(), ignore_eos=True)
    r.mechanism = "continuous" if batch > 1 else "serial"
    eng.accept(r, OutputStream(r.request_id))
    while eng._live or eng._serial:
        eng.iterate()
    return [recs["r0"]], None, eng
