"""Shared-prefix KV in the engine: rows that open with one prompt prefix read one copy of it, decode the same
tokens as with copies (logits to the last bits), hold fewer bytes, and admission charges the prefix once."""

import time

import numpy as np
import pytest

from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.request import Request, SamplingParams


def _fleet(n=5, prefix=300, seed=0):
    rng = np.random.default_rng(seed)
    pre = rng.integers(3, 8000, size=prefix).tolist()
    ps = [pre + rng.integers(3, 8000, size=int(k)).tolist() for k in rng.integers(3, 40, size=n)]
    return ps + [rng.integers(3, 8000, size=50).tolist()]  # and one unrelated row


def _serve(model, tok, prompts, share_min, max_tokens=20, delays=None, **kw):
    caps, peak = {}, {"kv": 0, "rows": 0}
    holder = {}

    def capture(rid, step, token, vec, geo):
        caps[(rid, step)] = vec.copy()
        r = holder["eng"].runner
        peak["kv"] = max(peak["kv"], r.kv_bytes)
        peak["rows"] = max(peak["rows"], len(r.rows))

    eng = holder["eng"] = Engine(model, tok, max_batch=8, capture=capture, share_min=share_min, **kw).start()
    try:
        streams = []
        for i, p in enumerate(prompts):
            time.sleep((delays or [0.03] * len(prompts))[i])
            req = Request(f"r{i}", p, max_tokens)
            req.mechanism = "continuous"
            st = OutputStream(req.request_id)
            eng.submit(req, st)
            streams.append(st)
        toks = [[o.token for o in st if o.token is not None] for st in streams]
        stats = {**eng.stats()["shared_prefix"], "verify_steps": eng.runner.spec_counts["verify_steps"]}
    finally:
        eng.shutdown()
    return toks, caps, peak, stats


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-qwen3.5"])
def test_rows_sharing_a_prefix_decode_as_with_copies_and_hold_fewer_bytes(name, tiny_models):
    model, tok, _, _ = tiny_models(name)
    ps = _fleet()
    ref, ref_caps, ref_peak, off = _serve(model, tok, ps, None)
    got, caps, peak, on = _serve(model, tok, ps, 64)
    assert off["active"] is False and on["active"] is True
    assert on["prefixes"] >= 1 and on["rows_shared"] >= 4
    assert got == ref
    diff = max(float(np.abs(caps[k] - ref_caps[k]).max()) for k in ref_caps)
    assert diff < 1e-3  # float32 presets: the order of one sum differs
    assert peak["kv"] < ref_peak["kv"]


def test_a_saving_below_the_gpu_floor_is_shared_only_while_admission_waits_for_memory(tiny_models, monkeypatch):
    """On GPU backends a new prefix must save ``GPU_MIN_SAVED`` row-tokens (the cascade's cost there). Under a
    ``--kv-budget`` that holds only a few whole rows no plan could ever reach it, and the fleet would stay at the
    copies' rows: while requests wait for memory, any saving counts. Without a budget the floor still holds."""
    model, tok, _, _ = tiny_models("tiny-llama")
    monkeypatch.setenv("MLXB_SHARE_MIN_SAVED", str(10 ** 9))  # the floor no fleet here can reach
    ps = _fleet(n=7, prefix=600)[:-1]
    one = Engine(model, tok, max_batch=8).projection.row_bytes(620 + 16)
    _, _, free, free_stats = _serve(model, tok, ps, 64, max_tokens=16, delays=[0] * len(ps))
    assert free_stats["prefixes"] == 0 and free_stats["memory_bound"] is False  # no pressure: the floor holds
    _, _, on, stats = _serve(model, tok, ps, 64, max_tokens=16, kv_budget=int(3.5 * one), delays=[0] * len(ps))
    assert stats["prefixes"] >= 1 and stats["min_saved_row_tokens"] == 10 ** 9
    assert on["rows"] >= 5, (on, stats)


def test_admission_fits_more_rows_under_one_budget_once_a_prefix_is_shared(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    ps = _fleet(n=7, prefix=600)[:-1]
    probe = Engine(model, tok, max_batch=8)
    one = probe.projection.row_bytes(620 + 16)
    budget = int(3.5 * one)  # three whole rows fit
    _, _, off, _ = _serve(model, tok, ps, None, max_tokens=16, kv_budget=budget, delays=[0] * len(ps))
    _, _, on, stats = _serve(model, tok, ps, 64, max_tokens=16, kv_budget=budget, delays=[0] * len(ps))
    assert off["rows"] <= 3
    # readers of the prefix are charged their own tokens at the width of the buffer they share (256-token steps)
    assert on["rows"] >= 5, (on, stats)
    assert on["kv"] <= budget, (on, budget)  # what the rows held stayed within the budget


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_a_cohort_prefills_over_one_prefix_with_the_prompt_cache(name, tiny_models):
    """Bursts that share a 400-token prefix, prompt cache on: followers start from the leader's snapshot, and the
    cohort that prefills their suffixes reads the prefix once (``Sharing.cohort_caches``) instead of merging
    copies; tokens as with copies, logits to the last bits."""
    from mlxb.cache.prompt_cache import PromptCache

    model, tok, _, _ = tiny_models(name)
    rng = np.random.default_rng(1)
    pre = rng.integers(3, 8000, size=400).tolist()
    waves = [[pre + rng.integers(3, 8000, size=int(n)).tolist() for n in rng.integers(5, 40, size=5)]
             for _ in range(2)]
    res = {}
    for share_min in (None, 64):
        caps = {}
        eng = Engine(model, tok, max_batch=8, share_min=share_min,
                     capture=lambda rid, s, t, v, g: caps.__setitem__((rid, s), v.copy()))
        eng.attach_prompt_cache(PromptCache(model, eng.kinds, max_bytes=1 << 30))
        eng.start()
        try:
            toks = []
            for w, ps in enumerate(waves):
                streams = []
                for i, p in enumerate(ps):
                    req = Request(f"w{w}r{i}", p, 12)
                    req.mechanism = "continuous"
                    st = OutputStream(req.request_id)
                    eng.submit(req, st)
                    streams.append(st)
                toks += [[o.token for o in st if o.token is not None] for st in streams]
            counts = dict(eng.runner.sharing.counts) if eng.runner.sharing else None
        finally:
            eng.shutdown()
        res[share_min] = (toks, caps, counts)
    assert res[64][2]["cohorts"] >= 1 and res[64][2]["rows_shared"] >= 8
    assert res[64][0] == res[None][0]
    assert max(float(np.abs(res[64][1][k] - res[None][1][k]).max()) for k in res[None][1]) < 1e-3


def test_speculative_verify_steps_read_the_shared_prefix(tiny_models):
    """Prompt lookup with fixed drafts over rows that share a prefix: verify steps (several queries per row, causal
    over the own keys, rejected entries as holes) through the cascade give the tokens of the same run with copies."""
    from mlxb.spec.verify import SpecConfig

    model, tok, _, _ = tiny_models("tiny-llama")
    rng = np.random.default_rng(5)
    pre = rng.integers(3, 8000, size=300).tolist()
    ps = []
    for _ in range(5):
        seg = rng.integers(3, 8000, size=5).tolist()
        ps.append(pre + seg * 4 + rng.integers(3, 8000, size=3).tolist())  # repeats: lookup drafts from the start
    res = {}
    for share_min in (None, 64):
        spec = SpecConfig("lookup", 4, 3, max_batch=8, adaptive=False)
        toks, caps, _, stats = _serve(model, tok, ps, share_min, max_tokens=24, spec=spec)
        res[share_min] = (toks, caps, stats)
    assert res[64][2]["rows_shared"] >= 4 and res[64][2]["verify_steps"] > 0
    assert res[64][0] == res[None][0]
    # which row-steps a verify step captures depends on how the rows met in the batch (thread timing): compare
    # the logits of the row-steps both runs captured, every row among them
    common = res[None][1].keys() & res[64][1].keys()
    assert {k[0] for k in common} == {f"r{i}" for i in range(len(ps))} and len(common) >= len(res[None][1]) // 2
    assert max(float(np.abs(res[64][1][k] - res[None][1][k]).max()) for k in common) < 1e-3


def test_rows_of_different_adapters_never_read_one_prefix(tmp_path):
    """LoRA: rows of adapters x, x, none, y, x over one prompt prefix. Only rows of one adapter may share (the
    prefix's KV depends on the adapter); tokens and logits as with copies."""
    from mlxb.adapters.lora import install, read_adapter
    from mlxb.models import load_model
    from mlxb.models.adapters import build_adapter

    build_adapter(load_model("tiny-llama")[0], tmp_path / "x", rank=8, seed=1)
    build_adapter(load_model("tiny-llama")[0], tmp_path / "y", rank=4, seed=2)
    rng = np.random.default_rng(9)
    pre = rng.integers(5, 8000, size=300).tolist()
    slots = [0, 0, -1, 1, 0]
    prompts = [pre + rng.integers(5, 8000, size=int(n)).tolist() for n in (7, 12, 5, 9, 20)]
    res = {}
    for share_min in (None, 64):
        model, tok, *_ = load_model("tiny-llama")
        install(model, [read_adapter("x", str(tmp_path / "x")), read_adapter("y", str(tmp_path / "y"))])
        caps, most = {}, {"rows_sharing": 0}
        eng = Engine(model, tok, max_batch=8, share_min=share_min,
                     capture=lambda rid, s, t, v, g: caps.__setitem__((rid, s), v.copy()))
        for i, (p, slot) in enumerate(zip(prompts, slots)):
            eng.accept(Request(f"r{i}", p, 10, SamplingParams(), ignore_eos=True, adapter=slot), OutputStream(f"r{i}"))
        while eng._live:
            eng.iterate()
            sh = eng.stats()["shared_prefix"]
            if sh.get("rows_sharing", 0) > most["rows_sharing"]:
                most = dict(sh, adapters=sorted({r.req.adapter for r in eng.runner.rows if r.shared}))
        res[share_min] = (caps, most)
    assert res[64][1]["rows_sharing"] >= 2 and len(res[64][1]["adapters"]) == 1  # one adapter's rows only
    assert res[64][1]["rows_sharing"] <= slots.count(0)
    caps, ref = res[64][0], res[None][0]
    assert {k: int(np.argmax(v)) for k, v in caps.items()} == {k: int(np.argmax(v)) for k, v in ref.items()}
    assert max(float(np.abs(caps[k] - ref[k]).max()) for k in ref) < 1e-3


def test_grammar_rows_read_the_shared_prefix_and_keep_their_masks(tiny_models):
    """Rows 0 and 2 constrained by a regex (llguidance), the others free, all over one prompt prefix: every
    constrained row's text matches its pattern and every row's tokens are those of the run with copies."""
    import re

    from mlxb.constrain.grammar import Grammars
    from mlxb.engine.gateway import _vocab_size
    from mlxb.parity.protocol import GRAMMAR_REGEX

    model, tok, _, _ = tiny_models("tiny-llama")
    grammars = Grammars(tok, _vocab_size(model, tok), sorted(getattr(tok, "eos_token_ids", []) or []))
    ps = _fleet(n=4, prefix=300, seed=4)[:-1]
    res = {}
    for share_min in (None, 64):
        caps, most = {}, 0
        eng = Engine(model, tok, max_batch=8, share_min=share_min,
                     capture=lambda rid, s, t, v, g: caps.__setitem__((rid, s), v.copy()))
        streams = []
        for i, p in enumerate(ps):
            req = Request(f"r{i}", p, 16, SamplingParams(), ignore_eos=True)
            if i in (0, 2):
                req.constraint = grammars.constraint(grammars.from_regex(GRAMMAR_REGEX, "regex"), "regex")
            st = OutputStream(req.request_id)
            eng.accept(req, st)
            streams.append(st)
        while eng._live:
            eng.iterate()
            most = max(most, eng.stats()["shared_prefix"].get("rows_sharing", 0))
        toks = [[o.token for o in st if o.token is not None] for st in streams]
        res[share_min] = (toks, caps, most)
    assert res[64][2] >= 3
    assert res[64][0] == res[None][0]
    for i in (0, 2):
        text = tok.decode(res[64][0][i])
        assert re.fullmatch(r"((ab |cd )*)(a|ab|c|cd)?", text), text  # a prefix of (ab |cd ){60,}


def _live_joiners(model, tok, cache: bool, fault: frozenset = frozenset()):
    """Three rows decode over a 320-token prefix; then one joins alone and a burst of three (a cohort) joins, all
    opening with it. Per arm (sharing off: None, on: 64): tokens, logit vectors, sharing counts, cached tokens."""
    from mlxb.cache.prompt_cache import PromptCache

    rng = np.random.default_rng(7)
    pre = rng.integers(3, 8000, size=320).tolist()
    first = [pre + rng.integers(3, 8000, size=int(n)).tolist() for n in (9, 17, 30)]
    later = [pre + rng.integers(3, 8000, size=int(n)).tolist() for n in (12, 5, 21, 8)]
    if cache:  # a later row repeats a first-wave prompt and extends it: its prompt-cache hit runs past the prefix
        later[1] = first[0] + later[1][320:]
    res = {}
    for share_min in (None, 64):
        caps = {}
        eng = Engine(model, tok, max_batch=8, share_min=share_min, faults=fault,
                     capture=lambda rid, s, t, v, g: caps.__setitem__((rid, s), v.copy()))
        if cache:
            eng.attach_prompt_cache(PromptCache(model, eng.kinds, max_bytes=1 << 30))
        streams, reqs = [], []

        def submit(i: int, p: list) -> None:
            req = Request(f"r{i}", p, 40 if i < 3 else 12)
            req.mechanism = "continuous"
            st = OutputStream(req.request_id)
            eng.accept(req, st)  # an engine driven here, iteration by iteration: no timing decides who joins how
            streams.append(st)
            reqs.append(req)

        for i, p in enumerate(first):
            submit(i, p)
        for _ in range(20):  # the first wave prefills and decodes over its shared prefix
            if len(eng.runner.rows) == 3:
                break
            eng.iterate()
        assert len(eng.runner.rows) == 3
        submit(3, later[0])
        eng.iterate()  # one joiner alone
        for i, p in enumerate(later[1:], start=4):
            submit(i, p)  # then a burst, admitted together: a cohort
        for _ in range(200):
            if not eng._live:
                break
            eng.iterate()
        assert not eng._live
        toks = [[o.token for o in st if o.token is not None] for st in streams]
        counts = dict(eng.runner.sharing.counts) if eng.runner.sharing else None
        cached = [r.cached_tokens for r in reqs]
        res[share_min] = (toks, caps, counts, cached)
    return res


@pytest.mark.parametrize("cache", [False, True])
def test_joiners_start_at_the_live_prefix_without_a_copy(cache, tiny_models):
    """Rows arriving while a prefix is live (one alone, then a burst that prefills as a cohort) start their prefill
    at it: they neither compute nor copy the prefix (``live_seeds``; with the prompt cache their hit past it is lent),
    report those tokens as cached, and decode the tokens of the same run with copies, logits to the last bits."""
    model, tok, _, _ = tiny_models("tiny-llama")
    res = _live_joiners(model, tok, cache)
    toks, caps, counts, cached = res[64]
    assert counts["live_seeds"] >= 2 and counts["cohorts"] >= 1, counts
    assert sum(c >= 320 for c in cached[3:]) >= 2, cached  # read, not prefilled
    assert toks == res[None][0]
    assert max(float(np.abs(caps[k] - res[None][1][k]).max()) for k in res[None][1]) < 1e-3


def test_live_joiners_with_a_planted_position_bug_differ_from_copies(tiny_models):
    """The negative control of the test above: a live-seeded joiner whose positions lack the prefix is caught."""
    model, tok, _, _ = tiny_models("tiny-llama")
    res = _live_joiners(model, tok, False, frozenset({"live_seed_position"}))
    toks, caps, counts, _ = res[64]
    assert counts["live_seeds"] >= 2
    worst = max(float(np.abs(caps[k] - res[None][1][k]).max()) for k in res[None][1] if k in caps)
    assert toks != res[None][0] or worst >= 1e-3


def test_a_live_seeded_joiner_outlives_the_prefix_it_started_at(tiny_models):
    """A joiner starts its chunked prefill at the live prefix; every row that read it retires before the joiner's
    last chunk, so the batch frees its prefix. The joiner still holds its reference, joins an empty batch (made
    whole there) and decodes what it decodes with copies."""
    model, tok, _, _ = tiny_models("tiny-llama")
    rng = np.random.default_rng(11)
    pre = rng.integers(3, 8000, size=200).tolist()
    firsts = [pre + rng.integers(3, 8000, size=int(n)).tolist() for n in (7, 12)]
    late = pre + rng.integers(3, 8000, size=1100).tolist()
    res = {}
    for share_min in (None, 64):
        caps = {}
        eng = Engine(model, tok, max_batch=8, share_min=share_min, prefill_chunk=256,
                     capture=lambda rid, s, t, v, g: caps.__setitem__((rid, s), v.copy()))
        streams, reqs = [], []

        def submit(i, p, n):
            req = Request(f"r{i}", p, n)
            req.mechanism = "continuous"
            st = OutputStream(req.request_id)
            eng.accept(req, st)
            streams.append(st)
            reqs.append(req)

        for i, p in enumerate(firsts):
            submit(i, p, 4)
        eng.iterate()  # an idle engine prefills both as one cohort; they join together
        assert len(eng.runner.rows) == 2
        submit(2, late, 6)
        freed_before_join = False
        for _ in range(100):
            if not eng._live:
                break
            eng.iterate()
            sh = eng.runner.sharing
            if sh is not None and not sh.live and reqs[2].status.name == "PREFILLING":
                freed_before_join = True
        assert not eng._live
        counts = dict(eng.runner.sharing.counts) if eng.runner.sharing else None
        res[share_min] = ([[o.token for o in st if o.token is not None] for st in streams], caps, counts,
                          reqs[2].cached_tokens, freed_before_join)
    toks, caps, counts, cached, freed = res[64]
    assert counts["live_seeds"] == 1 and cached == 200 and freed, (counts, cached, freed)
    assert toks == res[None][0]
    assert max(float(np.abs(caps[k] - res[None][1][k]).max()) for k in res[None][1]) < 1e-3


def test_a_cohort_split_by_length_reads_one_shared_prefix(tiny_models):
    """Issue 46: turns over a 400-token cached prefix with bodies of two lengths, admitted together, prefill as two
    groups (``cohort_split_min``) with shared-prefix KV on: the first group's prefix goes live and the second reads
    it; tokens as with one cohort of copies, logits to the last bits."""
    from mlxb.cache.prompt_cache import PromptCache

    model, tok, _, _ = tiny_models("tiny-llama")
    rng = np.random.default_rng(5)
    pre = rng.integers(3, 8000, size=400).tolist()
    first = [pre + rng.integers(3, 8000, size=6).tolist() for _ in range(4)]
    turns = [pre + rng.integers(3, 8000, size=n).tolist() for n in (12, 140, 10, 138, 11, 139)]
    res = {}
    for share_min, split in ((None, 0), (64, 100)):
        caps = {}
        eng = Engine(model, tok, max_batch=8, share_min=share_min, prefill_chunk=2048, cohort_split_min=split,
                     capture=lambda rid, s, t, v, g: caps.__setitem__((rid, s), v.copy()))
        eng.attach_prompt_cache(PromptCache(model, eng.kinds, max_bytes=1 << 30))
        toks, reqs = [], []
        for w, ps in enumerate((first, turns)):
            streams = {f"w{w}r{i}": OutputStream(f"w{w}r{i}") for i in range(len(ps))}
            reqs = [Request(f"w{w}r{i}", p, 8) for i, p in enumerate(ps)]
            for r in reqs:
                eng.accept(r, streams[r.request_id])
            while any(k in eng._live for k in streams):
                eng.iterate()
            toks += [[o.token for o in st if o.token is not None] for st in streams.values()]
        counts = dict(eng.runner.sharing.counts) if eng.runner.sharing else None
        res[split] = (toks, caps, counts, eng.counters["cohort_splits"], [r.cached_tokens for r in reqs])
    assert min(res[100][4]) >= 400 and min(res[0][4]) >= 400  # the turns started from their cached prefix
    assert res[0][3] == 0 and res[100][3] >= 1
    assert res[100][2]["rows_shared"] >= 4, res[100][2]
    assert res[100][0] == res[0][0]
    assert max(float(np.abs(res[100][1][k] - res[0][1][k]).max()) for k in res[0][1]) < 1e-3
