"""The engine on every synthetic preset: serial == mlx-lm, staggered batches, seeds, containment."""

import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlxb.engine.engine import Engine
from mlxb.engine.gateway import Gateway, GenerationInput
from mlxb.engine.stream import OutputStream
from mlxb.request import Request, SamplingParams
from tests.conftest import TINY

# Presets whose batched logits equal the solo run bit-for-bit here (full/latent/SSM layers).
# Sliding-window layers differ by ~1e-5 (mlx-lm's own batch mode does too).
EXACT = {"tiny-llama", "tiny-qwen3.5", "tiny-minicpm", "tiny-glm-mla"}
LENGTHS = [90, 30, 12, 50]  # 90 > the Gemma window (64): rings wrap


def prompts(n=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 8000, size=L).tolist() for L in LENGTHS[:n]]


def run(model, tok, reqs, batch, delays=None, capture=None, **kw):
    """Submit ``reqs``; with ``delays``, the second joins while the first is decoding (after the first's token 0
    and under the device lock, so a fast machine cannot finish the first row before it arrives), and the
    rest after their delays."""
    eng = Engine(model, tok, max_batch=batch, capture=capture, **kw).start()
    outs = [[] for _ in reqs]
    readers = []
    try:
        for i, r in enumerate(reqs):
            r.mechanism = "continuous" if batch > 1 else "serial"
            st = OutputStream(r.request_id)
            if delays and i == 1:
                t0 = time.monotonic()
                while not outs[0] and readers[0].is_alive() and time.monotonic() - t0 < 60:
                    time.sleep(0.0005)
                with eng.device_lock:
                    eng.submit(r, st)
            else:
                if delays:
                    time.sleep(delays[i])
                eng.submit(r, st)
            readers.append(threading.Thread(target=lambda st=st, out=outs[i]: out.extend(st), daemon=True))
            readers[-1].start()
        for t in readers:
            t.join()
    finally:
        eng.shutdown()
    return outs, eng


def toks(outs):
    return [[o.token for o in out if o.token is not None] for out in outs]


@pytest.mark.parametrize("name", TINY)
def test_batch1_equals_generate_step_and_batched_rows_finish(name, tiny_models):
    model, tok, _, _ = tiny_models(name)
    ps = prompts()
    ref = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=16)] for p in ps]
    cap1, cap4 = {}, {}
    o1, _ = run(model, tok, [Request(f"r{i}", p, 16) for i, p in enumerate(ps)], 1,
                capture=lambda rid, s, t, v, g: cap1.__setitem__((rid, s), v.copy()))
    assert toks(o1) == ref
    o4, eng = run(model, tok, [Request(f"r{i}", p, 16) for i, p in enumerate(ps)], 4, delays=[0, 0.03, 0.03, 0.03],
                  capture=lambda rid, s, t, v, g: cap4.__setitem__((rid, s), v.copy()))
    assert eng.counters["batched_steps"] > 0, "rows never decoded together"
    assert [out[-1].finish_reason for out in o4] == ["length"] * 4
    assert toks(o4) == ref  # greedy tokens survive batching on every preset
    r0 = [k for k in cap4 if k[0] == "r0"]
    assert len(r0) == 16
    if name in EXACT:
        assert all(np.array_equal(cap1[k], cap4[k]) for k in cap4)
    else:
        assert max(np.abs(cap1[k] - cap4[k]).max() for k in cap4) < 1e-4


def test_extend_and_merge_joins_agree(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    ps = prompts()
    a, _ = run(model, tok, [Request(f"r{i}", p, 12) for i, p in enumerate(ps)], 4, delays=[0, 0.02, 0.02, 0.02])
    b, _ = run(model, tok, [Request(f"r{i}", p, 12) for i, p in enumerate(ps)], 4, delays=[0, 0.02, 0.02, 0.02],
               join_full="merge")
    assert toks(a) == toks(b)


def sampled(seed, temp=1.0, **kw):
    return SamplingParams(temperature=temp, seed=seed, top_p=0.95, **kw)


def test_seed_same_text_at_b1_and_b2(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    ps = prompts(2)
    solo, _ = run(model, tok, [Request("a", ps[0], 20, sampled(7))], 1)
    pair, _ = run(model, tok, [Request("a", ps[0], 20, sampled(7)), Request("b", ps[1], 20, sampled(8))], 2)
    assert toks(solo)[0] == toks(pair)[0]
    again, _ = run(model, tok, [Request("b", ps[1], 20, sampled(8)), Request("a", ps[0], 20, sampled(7))], 2)
    assert toks(again)[1] == toks(pair)[0]  # arrival order does not matter


def test_different_seeds_differ_same_seed_repeats(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    p = prompts(1)[0]
    outs, _ = run(model, tok, [Request("a", p, 24, sampled(1)), Request("b", p, 24, sampled(2)),
                               Request("c", p, 24, sampled(1))], 3)
    t = toks(outs)
    assert t[0] != t[1] and t[0] == t[2]


def test_penalties_logprobs_and_bias_on_batch(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    ps = prompts(2)
    sp = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, logprobs=True,
                        top_logprobs=5, logit_bias={42: 100.0})
    outs, _ = run(model, tok, [Request("a", ps[0], 6, sp), Request("b", ps[1], 6, SamplingParams())], 2)
    a = [o for o in outs[0] if o.token is not None]
    assert a[0].token == 42  # the bias wins
    assert all(o.logprob is not None and len(o.logprob.top) == 5 for o in a)
    assert all(o.logprob.top[0][1] >= o.logprob.top[-1][1] for o in a)
    assert all(o.logprob is None for o in outs[1] if o.token is not None)


def test_stop_string_and_eos_do_not_leak(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    p = prompts(1)[0]
    full, _ = run(model, tok, [Request("a", p, 20)], 1)
    text = "".join(o.text for o in full[0])
    stop = text[5:9]
    cut, _ = run(model, tok, [Request("a", p, 20, stop=[stop])], 2)
    got = "".join(o.text for o in cut[0])
    assert cut[0][-1].finish_reason == "stop" and got == text[: text.find(stop)]
    eos, _ = run(model, tok, [Request("e", p, 20, SamplingParams(logit_bias={2: 100.0}))], 2)
    assert eos[0][-1].finish_reason == "stop" and all(o.token is None for o in eos[0])
    assert eos[0][-1].usage["completion_tokens"] == 0


def test_consumer_that_raises_evicts_only_its_row(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    ps = prompts(2)

    def boom(out):
        if out.token is not None:
            raise RuntimeError("consumer bug")

    bad = Request("bad", ps[0], 30)
    bad.on_output = boom
    outs, eng = run(model, tok, [bad, Request("good", ps[1], 30)], 2)
    assert outs[0][-1].finish_reason == "cancelled"
    assert outs[1][-1].finish_reason == "length" and len(toks(outs)[1]) == 30
    assert eng.fatal is None


def test_forward_error_fails_batch_engine_keeps_serving(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    eng = Engine(model, tok, max_batch=4).start()
    real = eng.runner.decode_step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fault")
        return real()

    eng.runner.decode_step = flaky
    try:
        sts = []
        for i, p in enumerate(prompts(2)):
            st = OutputStream(f"r{i}")
            eng.submit(Request(f"r{i}", p, 20), st)
            sts.append(st)
        outs = [list(s) for s in sts]
        assert any(o[-1].finish_reason == "error" for o in outs)
        st = OutputStream("after")
        eng.submit(Request("after", prompts(1)[0], 5), st)
        assert list(st)[-1].finish_reason == "length"
        assert eng.alive and eng.stats()["active_rows"] == 0
    finally:
        eng.shutdown()


def test_cancel_running_row(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    eng = Engine(model, tok, max_batch=4).start()
    try:
        st = OutputStream("long")
        eng.submit(Request("long", prompts(1)[0], 5000), st)
        it = iter(st)
        next(it)
        eng.cancel("long")
        rest = list(it)
        assert rest[-1].finish_reason == "cancelled"
        assert eng.stats()["active_rows"] == 0
    finally:
        eng.shutdown()


def test_serial_waiter_drains_batch_and_nobody_starves(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    eng = Engine(model, tok, max_batch=4).start()
    order = []
    try:
        ps = prompts(3)
        sts = []
        for i, (p, mech) in enumerate(zip(ps, ["continuous", "serial", "continuous"])):
            r = Request(f"r{i}", p, 15)
            r.mechanism = mech
            r.on_output = lambda o, i=i: order.append(i) if o.finish_reason else None
            st = OutputStream(r.request_id)
            eng.submit(r, st)
            sts.append(st)
            time.sleep(0.02)
        outs = [list(s) for s in sts]
        assert all(o[-1].finish_reason == "length" for o in outs)
        assert order.index(0) < order.index(1) < order.index(2)  # batch drains, serial runs, admission resumes
    finally:
        eng.shutdown()


def test_gateway_places_by_capability(tiny_models):
    model, tok, _, _ = tiny_models("tiny-qwen3.5")
    for batch, want in ((1, "serial"), (4, "continuous")):
        eng = Engine(model, tok, max_batch=batch)
        gw = Gateway(eng, tok, model_name="x")
        req = gw.build(GenerationInput(prompt="hi", max_tokens=3, sampling=SamplingParams(seed=3, temperature=0.5)))
        assert req.mechanism == want


def test_kv_budget_rejects_alone_and_reports_bytes(tiny_models):
    from mlxb.errors import KVBudgetError

    model, tok, _, _ = tiny_models("tiny-gemma3")
    eng = Engine(model, tok, max_batch=4, kv_budget=100_000)
    # window-capped: sliding layers stop growing at 64 tokens
    proj = eng.projection
    assert proj.row_bytes(1000) - proj.row_bytes(500) < proj.row_bytes(500) - proj.row_bytes(0)
    with pytest.raises(KVBudgetError, match="raise --kv-budget"):
        eng.check_admissible(Request("x", list(range(3, 400)), 400))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-qwen3.5", "tiny-glm-mla"])
def test_aligned_flag_matches_left_padding(name, tiny_models):
    """The host-side ``aligned`` flag (no mask for a one-token step) must equal 'no row is
    left-padded' after every join and filter, without reading the padding from the device."""
    from mlxb.cache.protocol import AlignedBatchKVCache

    model, tok, _, _ = tiny_models(name)
    eng = Engine(model, tok, max_batch=4, prefill_chunk=32)
    rng = np.random.default_rng(3)
    # equal lengths arriving together (aligned), then a longer joiner (padded), then rows leaving
    plan = [(0, 20, 6), (0, 20, 9), (3, 40, 12), (5, 20, 20)]  # (arrival iteration, prompt len, max_tokens)
    seen, it = set(), 0
    while it < 60:
        for k, (at, n, mt) in enumerate(plan):
            if at == it:
                eng.accept(Request(f"a{k}", rng.integers(3, 8000, size=n).tolist(), mt, ignore_eos=True),
                           OutputStream(f"a{k}"))
        eng.iterate()
        it += 1
        full = [c for c in eng.runner.caches or [] if isinstance(c, AlignedBatchKVCache)]
        for c in full:
            padded = max(c.left_padding.tolist()) > 0
            assert c.aligned == (not padded), (it, c.left_padding.tolist())
            seen.add(c.aligned)
        if not eng.scheduler.has_work() and it > 6:
            break
    assert seen == {True, False}, seen  # both states were exercised


@pytest.mark.parametrize("rule", [True, False])
def test_a_fleets_next_turns_join_in_one_cohort_and_keep_their_tokens(tiny_models, monkeypatch, rule):
    """Issue 46: six turns that arrive while one row decodes are prefilled in one iteration (one cohort), not one
    chunk's worth per iteration, and every row gives the tokens it gives alone. With the turn-boundary rule off
    (the planted control) the same arrivals take one iteration each, so the count below tells them apart."""
    import mlxb.engine.scheduler as S

    if not rule:
        monkeypatch.setattr(S, "MIN_TURN_QUEUE", 10**9)
    model, tok, _, _ = tiny_models("tiny-llama")
    rng = np.random.default_rng(7)
    turns = [rng.integers(3, 8000, size=12).tolist() for _ in range(6)]
    alone = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=6)] for p in turns]
    eng = Engine(model, tok, max_batch=8, prefill_chunk=16)
    first = OutputStream("run")
    eng.accept(Request("run", rng.integers(3, 8000, size=8).tolist(), 40, ignore_eos=True), first)
    eng.iterate()  # the running row's prefill (an idle iteration)
    eng.iterate()
    streams = {f"t{i}": OutputStream(f"t{i}") for i in range(6)}
    for i, p in enumerate(turns):
        eng.accept(Request(f"t{i}", p, 6, ignore_eos=True), streams[f"t{i}"])
    admitted = []
    while any(k in eng._live for k in streams):
        out = eng.iterate()
        admitted.append(len(out.admitted))
    got = [[o.token for o in streams[f"t{i}"] if o.token is not None] for i in range(6)]
    assert got == alone
    assert (admitted[0] == 6) is rule, admitted  # rule on: all six in the first iteration
    assert rule or sum(1 for a in admitted if a) >= 3  # one chunk (16 tokens) per iteration: 2 turns at most



class _RecordingLoop:
    """Stands in for the server's event loop: records what each cross-thread hand-off carries, in order with
    the engine's own steps (``events``)."""

    def __init__(self, events: list):
        self.events = events

    def call_soon_threadsafe(self, fn, items):
        self.events.append(("flush", [(it.request_id, it.finish_reason) for _, it in items if hasattr(it, "request_id")]))


def test_outputs_leave_before_the_slow_parts_of_their_iteration(tiny_models):
    """Joiners' first tokens reach their consumers before the iteration's decode step, and finished rows' last
    outputs before their caches are stored in the prompt cache (both waited for the end of the iteration)."""
    import asyncio

    from mlxb.cache.prompt_cache import PromptCache

    model, tok, _, _ = tiny_models("tiny-llama")
    eng = Engine(model, tok, max_batch=4)
    eng.attach_prompt_cache(PromptCache(model, eng.kinds, max_bytes=1 << 30))
    events: list = []
    loop = _RecordingLoop(events)
    decode, store = eng.runner.decode_step, eng.reuse.put_finished_many
    eng.runner.decode_step = lambda: (events.append(("decode", None)), decode())[1]
    eng.reuse.put_finished_many = lambda rows: (events.append(("store", len(rows))), store(rows))[1]
    for i, (p, n) in enumerate(zip(prompts(2, seed=3), (3, 6))):
        req = Request(f"r{i}", p, n)
        req.mechanism = "continuous"
        st = OutputStream(req.request_id)
        st._loop, st._aq = loop, asyncio.Queue()  # as if made with loop=
        eng.accept(req, st)
    for _ in range(50):
        if not eng._live:
            break
        eng.iterate()
    assert not eng._live

    def first(kind, pred=lambda x: True):
        return next(i for i, (k, x) in enumerate(events) if k == kind and pred(x))

    token0 = first("flush", lambda xs: any(rid == "r0" for rid, _ in xs))
    assert token0 < first("decode"), events[:6]
    r0_done = first("flush", lambda xs: ("r0", "length") in xs)
    assert r0_done < first("store"), events
    assert events[first("store") - 1][0] == "flush", events  # nothing between the last outputs and the store
