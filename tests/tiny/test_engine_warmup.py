"""The engine's warm-up (every batching path once before serving, within a small --kv-budget, the fused kernel's
variants only where it is on) and MLX's buffer pool (trimmed after an iteration's tokens are delivered, and by an
idle engine only after a poll). Split from test_engine.py."""

import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.request import Request
from mlxb.spec.config import SpecConfig
from tests.tiny.test_engine import prompts, toks

@pytest.mark.parametrize("name,batch", [("tiny-llama", 4), ("tiny-gemma3", 2), ("tiny-qwen3.5", 4), ("tiny-llama", 1)])
def test_warm_up_runs_the_batching_paths_and_leaves_the_engine_clean(name, batch, tiny_models):
    from mlxb.engine.warmup import SCRIPT, SERIAL, warm_up

    model, tok, _, _ = tiny_models(name)
    eng = Engine(model, tok, max_batch=batch)
    stats = warm_up(eng)
    want = SCRIPT if batch > 1 else SERIAL
    assert stats["finished"] == ["length"] * len(want)
    assert (stats["batched_steps"] > 0) == (batch > 1)
    assert all(v == 0 for v in eng.counters.values()) and not eng._live and not eng.runner.rows
    assert eng.scheduler.is_idle and eng.scheduler.num_submitted == 0
    # the warmed engine still serves: greedy output equals mlx-lm's generate_step
    p = prompts(1, seed=5)[0]
    ref = [t for t, _ in generate_step(mx.array(p), model, max_tokens=10)]
    eng.start()
    try:
        r = Request("after", p, 10)
        r.mechanism = "continuous" if batch > 1 else "serial"
        st = OutputStream(r.request_id)
        eng.submit(r, st)
        assert toks([list(st)]) == [ref]
    finally:
        eng.shutdown()


def test_warm_up_respects_a_small_kv_budget(tiny_models):
    from mlxb.engine.warmup import SCRIPT, warm_up

    model, tok, _, _ = tiny_models("tiny-llama")
    one = Engine(model, tok, max_batch=4).projection.row_bytes
    # room for one 14-token row at a time: the 20-token row is never admissible, the rest queue
    eng = Engine(model, tok, max_batch=4, kv_budget=one(14 + 3) + one(1) // 2)
    stats = warm_up(eng)
    assert stats["skipped"] >= 1 and stats["requests"] == len(SCRIPT) - stats["skipped"]
    assert stats["finished"] == ["length"] * stats["requests"]
    assert not eng._live and eng.scheduler.is_idle and eng.scheduler.used_bytes == 0
    none = Engine(model, tok, max_batch=4, kv_budget=1)
    assert warm_up(none)["requests"] == 0


def test_warm_up_leaves_the_ssd_tier_alone(tiny_models, tmp_path):
    """With a RAM tier smaller than the warm-up's entries, the warm-up's evictions are not written to the SSD
    folder (every start wrote them, and the next start restored them), and the tier is attached again after."""
    from mlxb.cache.prompt_cache import PromptCache
    from mlxb.engine.warmup import warm_up

    model, tok, _, _ = tiny_models("tiny-llama")
    eng = Engine(model, tok, max_batch=4)
    pc = PromptCache(model, eng.kinds, max_bytes=200_000, disk_dir=tmp_path, disk_bytes=1 << 30)
    eng.attach_prompt_cache(pc)
    disk = pc.disk
    stats = warm_up(eng)
    assert stats["cached_tokens"] > 0  # the cache paths ran
    assert disk.flush(10) and disk.num_entries == 0 and not list(tmp_path.rglob("*.safetensors"))
    assert disk.counters["spills"] == 0 and disk.counters["restores"] == 0
    assert pc.disk is disk  # attached again for traffic
    pc.close()


def test_warm_up_compiles_the_fused_attention_variants_only_where_the_kernel_is_on(tiny_models, monkeypatch):
    """With --kv-attention fused on (CUDA), the warm-up ends by compiling every query count's kernel for the shapes
    its forwards sent (with a shared prefix too where sharing is on); off (Metal, CPU, mlx-lm), it does not."""
    from mlxb.engine.warmup import warm_up
    from mlxb.kernels import dense_attention as da

    model, tok, _, _ = tiny_models("tiny-llama")
    asked = []
    monkeypatch.setattr(da, "warm_variants", lambda prefix=False, queries=8: asked.append((prefix, queries)) or 8)
    assert "attention_variants" not in warm_up(Engine(model, tok, max_batch=4)) and asked == []
    monkeypatch.setattr(da, "enabled", lambda: True)
    stats = warm_up(Engine(model, tok, max_batch=4))
    assert stats["attention_variants"] == 8 and asked == [(False, 1)]  # no speculation: decode's one query
    warm_up(Engine(model, tok, max_batch=4, share_min=16, spec=SpecConfig("lookup", 3, max_batch=4)))
    assert asked == [(False, 1), (True, 4)]  # a verify step: the pending token and up to 3 drafts


def test_the_buffer_pool_is_trimmed_after_the_iterations_tokens_are_delivered(tiny_models, monkeypatch):
    """A cohort's prefill (and a chunk's, and every 256th decode step) asks for MLX's buffer pool to be trimmed; the
    engine does it once the iteration's tokens went out (a clear took 17-114 ms in an H100 agent loop, which the
    cohort's first tokens waited for), keeping at least the live KV's bytes cached."""
    import mlxb.engine.engine as engine_mod

    model, tok, _, _ = tiny_models("tiny-llama")
    eng = Engine(model, tok, max_batch=4)
    events = []
    monkeypatch.setattr(engine_mod, "trim_allocator_cache", lambda keep=0: events.append(("trim", keep)))
    flush = eng.delivery.flush
    monkeypatch.setattr(eng.delivery, "flush", lambda: events.append(("flush",)) or flush())
    rng = np.random.default_rng(3)
    streams = [OutputStream(f"c{i}") for i in range(3)]
    for i, st in enumerate(streams):
        eng.accept(Request(f"c{i}", rng.integers(3, 8000, size=20 + i).tolist(), 3, ignore_eos=True), st)
    eng.iterate()  # the three prompts: one cohort
    names = [e[0] for e in events]  # (their first tokens leave before the decode step: a flush of its own)
    assert names[0] == "flush" and names[-2:] == ["flush", "trim"] and names.count("trim") == 1, names
    assert events[-1][1] == eng.scheduler.used_bytes > 0
    while eng._live:
        eng.iterate()
    assert all(len([o for o in st if o.token is not None]) == 3 for st in streams)


def test_idle_engine_gives_cached_buffers_back_after_a_poll_not_before_the_last_answer(tiny_models, monkeypatch):
    """Going idle clears MLX's buffer cache once, after the inbox stayed empty for a poll: never while
    the batch runs, and a request that arrives within the poll finds the buffers still cached."""
    import mlxb.engine.engine as engine_mod

    model, tok, _, _ = tiny_models("tiny-llama")
    events = []

    real = engine_mod.clear_pool

    def clear_pool():  # the engine's pool return (a counted mx.clear_cache), recorded
        events.append("clear")
        real()

    monkeypatch.setattr(engine_mod, "clear_pool", clear_pool)
    eng = Engine(model, tok, max_batch=2)
    eng.idle_poll_s = 1.0  # the second request surely arrives within the first poll
    eng.start()
    try:
        for k in range(2):
            r = Request(f"c{k}", prompts(1, seed=k)[0], 6, ignore_eos=True)
            st = OutputStream(r.request_id)
            eng.submit(r, st)
            assert len([o for o in st if o.token is not None]) == 6
            events.append("answered")
            if k == 0:  # the next request arrives at once: no clear in between
                continue
            deadline = time.monotonic() + 10
            while events[-1] != "clear" and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(0.2)
    finally:
        eng.shutdown()
    assert events.count("clear") == 1 and events[-1] == "clear", events
    assert events.index("clear") > events.index("answered"), events
