"""The engine with the prompt cache on every synthetic preset: the same greedy tokens as with the
cache off (batch lane and --batch 1), real cached_tokens, and a budget that evicts cache for rows."""

import numpy as np
import pytest

from mlxb.cache.prompt_cache import PromptCache
from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.request import Request
from tests.conftest import TINY


def waves(n_users=3, seed=0):
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 8000, size=100).tolist()  # past the Gemma window: rings wrap
    users = [system + rng.integers(3, 8000, size=8 + 3 * i).tolist() for i in range(n_users)]
    return [users, users]  # an agent burst sharing a system prompt, then the same prompts again


def serve(model, tok, batch, cache, tmp_path=None, kv_budget=None, max_tokens=10):
    eng = Engine(model, tok, max_batch=batch, prefill_chunk=48, kv_budget=kv_budget)
    if cache:
        eng.attach_prompt_cache(PromptCache(model, eng.kinds, max_bytes=1 << 30, disk_dir=tmp_path,
                                            disk_bytes=(1 << 30) if tmp_path else 0))
    eng.start()
    out = []
    try:
        for w, wave in enumerate(waves()):
            reqs = [Request(f"w{w}r{i}", p, max_tokens) for i, p in enumerate(wave)]
            streams = []
            for r in reqs:
                r.mechanism = "continuous" if batch > 1 else "serial"
                streams.append(OutputStream(r.request_id))
                eng.submit(r, streams[-1])
            for r, st in zip(reqs, streams):
                recs = list(st)
                assert recs[-1].error is None, recs[-1].error
                out.append(([o.token for o in recs if o.token is not None], r.cached_tokens))
    finally:
        eng.shutdown()
    return out, eng


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("batch", [3, 1])
def test_cache_on_gives_the_same_tokens_and_real_cached_counts(name, batch, tiny_models):
    model, tok, _, _ = tiny_models(name)
    off, _ = serve(model, tok, batch, cache=False)
    on, eng = serve(model, tok, batch, cache=True)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert all(c == 0 for _, c in off)
    cached = [c for _, c in on]
    assert cached[0] == 0 and all(c >= 48 for c in cached[1:3])  # the burst shared the system prompt
    lens = [len(p) for p in waves()[1]]
    assert cached[3:] == [n - 1 for n in lens]  # repeats reuse everything but the last token
    st = eng.prompt_cache_stats()
    assert st["hits"] >= 3 and st["ram_entries"] >= 1
    eng.prompt_cache.ram.check_integrity()


def test_a_tight_budget_evicts_cache_entries_never_rows(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    probe = Engine(model, tok, max_batch=3)
    one_row = probe.projection.row_bytes(100 + 14 + 10)
    budget = 3 * one_row + one_row // 2  # three live rows fit; cached entries must give way
    on, eng = serve(model, tok, 3, cache=True, kv_budget=budget)
    off, _ = serve(model, tok, 3, cache=False, kv_budget=budget)
    assert [t for t, _ in on] == [t for t, _ in off]  # nobody was dropped or failed
    st = eng.prompt_cache_stats()
    assert st["evictions"] > 0
    assert eng.prompt_cache.nbytes + eng.scheduler.used_bytes <= budget


@pytest.mark.parametrize("cache", [False, True])
def test_a_row_ending_at_token_zero_keeps_the_engine_alive(cache, tiny_models, tmp_path):
    """Regression: a row that finished at token 0 with the prompt cache off crashed the engine thread
    (it tried to store the prompt in a cache that did not exist)."""
    model, tok, _, _ = tiny_models("tiny-llama")
    eng = Engine(model, tok, max_batch=4)
    if cache:
        eng.attach_prompt_cache(PromptCache(model, eng.kinds, max_bytes=1 << 30))
    eng.start()
    try:
        p = list(range(10, 50))
        for i in range(2):
            r = Request(f"one{i}", p, 1)
            st = OutputStream(r.request_id)
            eng.submit(r, st)
            recs = list(st)
            assert recs[-1].error is None and recs[-1].finish_reason == "length"
            assert r.cached_tokens == (39 if cache and i == 1 else 0)
        assert eng.alive
    finally:
        eng.shutdown()


def test_memory_pressure_and_an_out_of_memory_prefill_give_cache_memory_back(tiny_models):
    from mlxb.engine.prefill import MAX_REQUEUES

    model, tok, _, _ = tiny_models("tiny-llama")
    eng = Engine(model, tok, max_batch=4)
    pc = PromptCache(model, eng.kinds, max_bytes=1 << 30)
    eng.attach_prompt_cache(pc)
    eng.start()

    def ask(rid, prompt):
        r = Request(rid, prompt, 3)
        st = OutputStream(r.request_id)
        eng.submit(r, st)
        recs = list(st)
        return recs[-1], [o.token for o in recs if o.token is not None]

    real = eng.runner.prefill_chunk

    def failing(times, message):
        left = [times]

        def chunk(*a, **k):
            if left[0] > 0:
                left[0] -= 1
                raise RuntimeError(message)
            return real(*a, **k)
        return chunk

    oom = "cudaMallocAsync(&data, size, stream) failed: out of memory"
    try:
        assert ask("a", list(range(10, 80)))[0].error is None and pc.nbytes > 0
        want = ask("ref", list(range(100, 170)))[1]
        pc.evict(pc.nbytes)
        assert ask("a2", list(range(10, 80)))[0].error is None and pc.nbytes > 0
        # a transient out-of-memory prefill: the cache gives its memory back, the row is requeued and
        # then runs from scratch to the same tokens
        eng.runner.prefill_chunk = failing(1, oom)
        last, toks = ask("b", list(range(100, 170)))
        assert last.error is None and toks == want
        assert eng.counters["requeued"] == 1
        assert pc.ram.num_evictions > 0  # the cache gave its memory back
        # out of memory every time: requeued MAX_REQUEUES times, then failed with the allocator's message
        eng.runner.prefill_chunk = failing(MAX_REQUEUES + 1, oom)
        last, _ = ask("c", list(range(200, 270)))
        assert last.error is not None and "out of memory" in str(last.error)
        assert eng.counters["requeued"] == 1 + MAX_REQUEUES
        # any other prefill error fails the row at once, never requeued
        eng.runner.prefill_chunk = failing(1, "some other failure")
        last, _ = ask("d", list(range(300, 370)))
        assert last.error is not None and "some other failure" in str(last.error)
        assert eng.counters["requeued"] == 1 + MAX_REQUEUES
        eng.runner.prefill_chunk = real
        assert ask("e", list(range(400, 470)))[0].error is None and eng.alive
        pc.memory_limit = 0  # any device memory in use is now over the limit: inserts are evicted again
        assert ask("f", list(range(500, 570)))[0].error is None
        assert pc.nbytes == 0 and pc.stats()["memory_pressure_evictions"] > 0
    finally:
        eng.shutdown()


def test_an_out_of_memory_prefill_gives_back_the_least_recently_used_entries_first(tiny_models):
    """A first out-of-memory prefill evicts the oldest entries (a quarter of the tier at least), not every
    conversation the fleet has cached; a repeated one empties the tier. Emptying it at once made a 32-agent
    loop's next turns prefill their whole conversations (H100, stop 59)."""
    model, tok, _, _ = tiny_models("tiny-llama")
    eng = Engine(model, tok, max_batch=4)
    pc = PromptCache(model, eng.kinds, max_bytes=1 << 30)
    eng.attach_prompt_cache(pc)
    eng.start()

    def ask(rid, prompt):
        st = OutputStream(rid)
        eng.submit(Request(rid, prompt, 3), st)
        return list(st)[-1]

    real = eng.runner.prefill_chunk
    left = [0]

    def chunk(*a, **k):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return real(*a, **k)

    try:
        convs = [list(range(1000 * i + 10, 1000 * i + 90)) for i in range(1, 9)]
        for i, c in enumerate(convs):
            assert ask(f"c{i}", c).error is None
        first = lambda: {int(e.tokens[0]) for e in pc.ram.entries()}  # noqa: E731 (a conversation's first token)
        assert len(pc.ram.entries()) == 8 and first() == {c[0] for c in convs}
        eng.runner.prefill_chunk = chunk
        left[0] = 1  # one transient failure: the row is requeued and runs
        assert ask("x", list(range(20000, 20080))).error is None
        assert {c[0] for c in convs[-5:]} <= first()  # the newest conversations stay
        assert convs[0][0] not in first()  # the oldest gave its memory back
        left[0] = 2  # failing again on its retry: the whole tier goes, then the row runs
        assert ask("y", list(range(30000, 30080))).error is None
        assert not {c[0] for c in convs} & first()
        assert eng.counters["requeued"] == 3
    finally:
        eng.runner.prefill_chunk = real
        eng.shutdown()


def test_a_burst_whose_leader_runs_out_of_memory_is_requeued_whole(tiny_models):
    """The shared leader's chunk fails for memory: its followers (seeded from the leader's snapshot in
    the same iteration) go back to the queue too, and every row ends with its undisturbed tokens."""
    model, tok, _, _ = tiny_models("tiny-llama")
    users = waves(4)[0]

    def run(fail):
        eng = Engine(model, tok, max_batch=4, prefill_chunk=48)
        eng.attach_prompt_cache(PromptCache(model, eng.kinds, max_bytes=1 << 30))
        real, left = eng.runner.prefill_chunk, [1 if fail else 0]

        def chunk(*a, **k):
            if left[0] and eng.scheduler.num_shared:  # the burst's split leader
                left[0] = 0
                raise RuntimeError("[metal::malloc] Resource limit exceeded: out of memory")
            return real(*a, **k)
        eng.runner.prefill_chunk = chunk
        streams = []
        for i, p in enumerate(users):
            r = Request(f"u{i}", p, 6)
            streams.append(OutputStream(r.request_id))
            eng.accept(r, streams[-1])
        while eng._live:
            eng.iterate()
        recs = [list(st) for st in streams]
        assert all(rs[-1].error is None for rs in recs), [rs[-1].error for rs in recs]
        return [[o.token for o in rs if o.token is not None] for rs in recs], eng

    want, _ = run(False)
    got, eng = run(True)
    assert got == want
    assert eng.counters["requeued"] >= 2  # the leader and at least one follower went back


def test_seeded_sampling_and_logprobs_are_the_same_with_the_cache(tiny_models):
    """A cached prefix gives the same logits as a fresh prefill, so seeded sampling draws the same
    tokens and reports the same logprobs (and penalties see the whole prompt as their context)."""
    from mlxb.request import SamplingParams

    model, tok, _, _ = tiny_models("tiny-llama")

    def go(cache):
        eng = Engine(model, tok, max_batch=3, prefill_chunk=48)
        if cache:
            eng.attach_prompt_cache(PromptCache(model, eng.kinds, max_bytes=1 << 30))
        eng.start()
        got = []
        try:
            for w, wave in enumerate(waves()):
                reqs = [Request(f"s{w}{i}", p, 8, SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i,
                                                                  repetition_penalty=1.2, logprobs=True,
                                                                  top_logprobs=3))
                        for i, p in enumerate(wave)]
                streams = []
                for r in reqs:
                    r.mechanism = "continuous"
                    streams.append(OutputStream(r.request_id))
                    eng.submit(r, streams[-1])
                for r, st in zip(reqs, streams):
                    recs = [o for o in st if o.token is not None]
                    got.append(([o.token for o in recs], [o.logprob.top for o in recs], r.cached_tokens))
        finally:
            eng.shutdown()
        return got

    off, on = go(False), go(True)
    assert [t for t, _, _ in on] == [t for t, _, _ in off]
    assert [lp for _, lp, _ in on] == [lp for _, lp, _ in off]
    assert sum(c for _, _, c in on) > 0 and sum(c for _, _, c in off) == 0


@pytest.mark.parametrize("name,batch", [("tiny-llama", 4), ("tiny-gemma3", 3), ("tiny-qwen3.5", 3), ("tiny-llama", 1)])
def test_warm_up_runs_the_cache_paths_then_serves_with_an_empty_cache(name, batch, tiny_models):
    from mlxb.engine.warmup import PREFIX, SCRIPT, SERIAL, SERIAL_PREFIX, warm_up

    model, tok, _, _ = tiny_models(name)
    eng = Engine(model, tok, max_batch=batch)
    pc = PromptCache(model, eng.kinds, max_bytes=1 << 30)
    eng.attach_prompt_cache(pc)
    stats = warm_up(eng)
    want = SCRIPT + PREFIX if batch > 1 else SERIAL + SERIAL_PREFIX
    assert stats["finished"] == ["length"] * len(want)
    assert stats["cached_tokens"] >= 40  # borrowed prefixes were really used
    if batch > 1:
        assert eng.scheduler.num_shared > 0  # the split leader ran
    assert pc.ram.num_entries == 0 and pc.nbytes == 0 and all(v == 0 for v in pc.counters.values())
    assert not eng._live and eng.scheduler.is_idle
    plain = Engine(model, tok, max_batch=batch)  # no cache, no warm-up: the reference
    assert ask_in_turn(eng, batch) == ask_in_turn(plain, batch)


def ask_in_turn(eng, batch):
    eng.start()
    got = []
    try:
        for i, p in enumerate(waves()[0]):
            r = Request(f"after{i}", p, 10)
            r.mechanism = "continuous" if batch > 1 else "serial"
            st = OutputStream(r.request_id)
            eng.submit(r, st)
            got.append([o.token for o in st if o.token is not None])
    finally:
        eng.shutdown()
    return got


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-gemma3"])
@pytest.mark.parametrize("batch", [3, 1])
def test_exact_snapshot_models_snapshot_where_prompts_part(name, batch, tiny_models):
    """Agents that share a system prompt but arrive one after another, on a model whose cache keeps exact
    snapshots only (recurrent / sliding-window layers) and a chunk longer than the prompts: the second
    prompt's prefill ends a chunk where it leaves the first (a snapshot mark), so the third starts from
    there. Tokens equal the cache-off run; with the marks ignored (planted) the third finds nothing."""
    model, tok, _, _ = tiny_models(name)
    rng = np.random.default_rng(7)
    system = rng.integers(3, 8000, size=100).tolist()
    prompts = [system + [11 + i] + rng.integers(3, 8000, size=9).tolist() for i in range(3)]

    def run(cache, marks=True):
        eng = Engine(model, tok, max_batch=batch, prefill_chunk=256)
        if cache:
            eng.attach_prompt_cache(PromptCache(model, eng.kinds, max_bytes=1 << 30))
            if not marks:
                eng.reuse.mark_shared = lambda req, hit: None
        eng.start()
        out = []
        try:
            for i, p in enumerate(prompts):  # one at a time: no burst shares a prefill
                r = Request(f"a{i}", p, 8)
                r.mechanism = "continuous" if batch > 1 else "serial"
                st = OutputStream(r.request_id)
                eng.submit(r, st)
                recs = list(st)
                assert recs[-1].error is None, recs[-1].error
                out.append(([o.token for o in recs if o.token is not None], r.cached_tokens, list(r.snapshot_at)))
            if cache:
                out.append(eng.prompt_cache_stats()["mark_snapshots"])
        finally:
            eng.shutdown()
        return out

    off, on, unmarked = run(False), run(True), run(True, marks=False)
    assert on.pop() == 1 and unmarked.pop() == 0  # /stats counts the snapshot the mark took
    assert not eng_trimmable(model)
    assert [t for t, _, _ in on] == [t for t, _, _ in off]
    assert on[1][2] == [100] and on[1][1] == 0  # the second marks where it leaves the first
    assert on[2][1] == 100  # the third starts from that snapshot
    assert [c for _, c, _ in unmarked] == [0, 0, 0]


def eng_trimmable(model) -> bool:
    from mlxb.cache.protocol import layer_kinds

    return all(k in ("full", "latent") for k in layer_kinds(model))


def test_memory_pressure_keeps_mlx_buffer_pool_while_the_arrays_in_use_fit(tiny_models, monkeypatch):
    """Past ``memory_limit`` only with MLX's free-buffer pool counted, an insert leaves the pool alone (up
    to the allocator's slack) and evicts nothing; the arrays in use past it clear the pool and evict.
    Clearing the pool on every insert past the limit made an H100 agent loop's retirements 300-400 ms."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxb.cache import allocator
    from mlxb.cache.protocol import layer_kinds

    model, _, _, _ = tiny_models("tiny-llama")
    pc = PromptCache(model, layer_kinds(model), max_bytes=1 << 30, memory_limit=100 << 20)
    layers = make_prompt_cache(model)
    model(mx.array([[5, 6, 7]]), cache=layers)
    assert pc.put([5, 6, 7], layers) is not None and pc.nbytes > 0
    mem = {"active": 90 << 20, "pool": 50 << 20}
    clears = []
    monkeypatch.setattr(mx, "get_active_memory", lambda: mem["active"])
    monkeypatch.setattr(mx, "get_cache_memory", lambda: mem["pool"])
    monkeypatch.setattr(mx, "clear_cache", lambda: clears.append(1))
    monkeypatch.setattr(allocator, "_SLACK", [1 << 30])
    assert pc.relieve_pressure() == 0 and clears == [] and pc.nbytes > 0  # arrays fit: the pool stays
    mem["pool"] = 2 << 30  # the pool past the slack: returned, still nothing evicted
    assert pc.relieve_pressure() == 0 and clears == [1] and pc.nbytes > 0
    assert pc.stats()["memory_pressure_pool_trims"] == 1
    mem["active"], mem["pool"] = 150 << 20, 0  # the arrays in use past the limit: clear and evict
    assert pc.relieve_pressure() > 0 and len(clears) == 2 and pc.nbytes == 0
    assert pc.stats()["memory_pressure_evictions"] == 1

