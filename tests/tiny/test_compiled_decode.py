"""--compile-decode: a lone row's decode steps as one compiled graph, bit for bit the plain engine's."""

import numpy as np
import pytest

from mlxb.cache.protocol import layer_kinds
from mlxb.engine.build import check_compile_decode
from mlxb.engine.compiled import self_check, why_not
from mlxb.errors import ValidationError
from mlxb.request import Request, SamplingParams
from tests.tiny.test_engine import prompts, run, toks

ELIGIBLE = ["tiny-llama", "tiny-minicpm"]


def captured(model, tok, reqs, batch, delays=None, **kw):
    cap = {}
    outs, eng = run(model, tok, reqs, batch, delays=delays,
                    capture=lambda rid, s, t, v, g: cap.__setitem__((rid, s), v.copy()), **kw)
    return outs, cap, eng


@pytest.mark.parametrize("name", ELIGIBLE)
def test_lone_row_equals_the_plain_step_bit_for_bit_across_buffer_growth(name, tiny_models):
    model, tok, _, _ = tiny_models(name)
    p = prompts(1)[0]  # 90 tokens; 300 more cross the buffer's growth at 256 and at 512
    plain, cap_p, _ = captured(model, tok, [Request("r0", p, 300, ignore_eos=True)], 4)
    comp, cap_c, eng = captured(model, tok, [Request("r0", p, 300, ignore_eos=True)], 4, compile_decode=True)
    st = eng.stats()["compiled_decode"]
    assert st["steps"] >= 295 and st["traced_shapes"] >= 2, st  # it ran, and the buffer grew under it
    assert toks(comp) == toks(plain)
    assert cap_c.keys() == cap_p.keys() and all(np.array_equal(cap_c[k], cap_p[k]) for k in cap_p)


@pytest.mark.parametrize("scope", ["lone", "all"])
def test_rows_that_join_a_compiled_lone_row_batch_as_before(scope, tiny_models):
    """The lone row decodes compiled, then rows join (the batch lane takes over, compiled too with
    --compile-batch) and leave again."""
    model, tok, _, _ = tiny_models("tiny-llama")
    ps = prompts()
    mk = lambda: [Request(f"r{i}", p, 24 if i else 60, ignore_eos=True) for i, p in enumerate(ps)]  # noqa: E731
    ref, cap_ref, _ = captured(model, tok, mk(), 1)  # the strict serial lane: each row alone
    outs, cap, eng = captured(model, tok, mk(), 4, delays=[0, 0.05, 0.01, 0.01], compile_decode=scope)
    st = eng.stats()["compiled_decode"]
    assert st["steps"] > 0 and (st["batch_steps"] > 0) == (scope == "all") and eng.counters["batched_steps"] > 0
    assert toks(outs) == toks(ref)
    assert all(np.array_equal(cap[k], cap_ref[k]) for k in cap_ref)  # tiny-llama: batched rows are exact here


def test_sampled_and_logprob_rows_keep_their_draws(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    p = prompts(1, seed=3)[0]

    def req():
        return Request("r0", p, 40, SamplingParams(temperature=0.9, top_p=0.9, seed=11, logprobs=True, top_logprobs=3,
                                                    repetition_penalty=1.1), ignore_eos=True)

    a, _ = run(model, tok, [req()], 4)
    b, eng = run(model, tok, [req()], 4, compile_decode=True)
    assert eng.stats()["compiled_decode"]["steps"] > 0
    assert toks(a) == toks(b)
    lp = lambda out: [(o.logprob.logprob, o.logprob.top) for o in out if o.logprob is not None]  # noqa: E731
    assert lp(a[0]) == lp(b[0]) and lp(a[0])


def test_speculation_still_gives_plain_greedy_text(tiny_models):
    from mlxb.spec.verify import SpecConfig

    model, tok, _, _ = tiny_models("tiny-llama")
    block = list(range(500, 532))
    reqs = lambda: [Request("r0", block * 4, 64, ignore_eos=True)]  # noqa: E731
    plain, _ = run(model, tok, reqs(), 4)
    spec, eng = run(model, tok, reqs(), 4, compile_decode=True, spec=SpecConfig("lookup", 4, 3, adaptive=False))
    assert toks(spec) == toks(plain)
    assert eng.stats()["compiled_decode"]["steps"] + eng.stats()["speculation"]["verify_steps"] > 0


def test_a_planted_mask_fault_is_caught_by_the_self_check_and_differs(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    assert self_check(model) is None
    p = prompts(1)[0]
    plain, _ = run(model, tok, [Request("r0", p, 20, ignore_eos=True)], 4)
    bad, _ = run(model, tok, [Request("r0", p, 20, ignore_eos=True)], 4, compile_decode=True,
                 faults=frozenset({"compiled_mask_late"}))
    assert toks(bad) != toks(plain)  # the row no longer sees its newest key

    import mlxb.engine.compiled as c

    orig = c.CompiledDecode.__init__
    try:  # the start-up check sees the same fault
        c.CompiledDecode.__init__ = lambda self, m, fault=False: orig(self, m, fault=True)
        why = self_check(model)
    finally:
        c.CompiledDecode.__init__ = orig
    assert why is not None and "differs from the plain one" in why


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3.5", "tiny-glm-mla"])
def test_models_it_cannot_serve_are_refused_with_the_reason(name, tiny_models):
    model, _, _, _ = tiny_models(name)
    why = why_not(model, layer_kinds(model))
    assert why is not None and "full attention" in why
    with pytest.raises(ValidationError, match="full attention"):
        check_compile_decode(model, batch=8)


def test_batch_1_adapters_and_tp_are_refused(tiny_models):
    model, _, _, _ = tiny_models("tiny-llama")
    with pytest.raises(ValidationError, match="--batch 2"):
        check_compile_decode(model, batch=1)
    with pytest.raises(ValidationError, match="--adapters"):
        check_compile_decode(model, batch=8, lora={"a": "x"})
    with pytest.raises(ValidationError, match="--tp"):
        check_compile_decode(model, batch=8, tp=True)
    check_compile_decode(model, batch=8)  # accepted here (CPU, full attention)


def test_prompt_cache_entries_from_compiled_rows_serve_later_requests_alike(tiny_models, tmp_path):
    """Requests one after another (each a lone, compiled row): what they leave in the prompt cache, taken
    from buffers the compiled step wrote, serves the next ones with the plain engine's tokens."""
    from mlxb.cache.prompt_cache import PromptCache
    from mlxb.engine.engine import Engine
    from mlxb.engine.stream import OutputStream

    model, tok, _, _ = tiny_models("tiny-llama")
    rng = np.random.default_rng(5)
    system = rng.integers(3, 8000, size=120).tolist()
    asks = [system + rng.integers(3, 8000, size=9).tolist() for _ in range(2)]
    asks.append(asks[0] + [7, 8, 9])  # a follow-up that extends the first conversation's prompt

    def serve(compile_decode):
        eng = Engine(model, tok, max_batch=4, compile_decode=compile_decode)
        eng.attach_prompt_cache(PromptCache(model, eng.kinds, max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=0))
        eng.start()
        out = []
        try:
            for i, p in enumerate(asks):
                r = Request(f"q{i}", p, 30, ignore_eos=True)
                r.mechanism = "continuous"
                st = OutputStream(r.request_id)
                eng.submit(r, st)
                out.append(([o.token for o in st if o.token is not None], r.cached_tokens))
        finally:
            eng.shutdown()
        return out, eng

    plain, _ = serve(False)
    comp, eng = serve(True)
    assert [t for t, _ in comp] == [t for t, _ in plain]
    assert [c for _, c in comp] == [c for _, c in plain] and comp[1][1] >= 100 and comp[2][1] >= 120
    assert eng.stats()["compiled_decode"]["steps"] >= 3 * 28


EXIT_SCRIPT = """
from mlxb.models import load_model
from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.request import Request
m, tok, _, _ = load_model("tiny-llama")
eng = Engine(m, tok, max_batch=4, compile_decode="all").start()
for i in range(2):
    r = Request(f"r{i}", list(range(100, 140 + i)), 12, ignore_eos=True)
    r.mechanism = "continuous"
    st = OutputStream(r.request_id)
    eng.submit(r, st)
    assert len([o for o in st if o.token is not None]) == 12
eng.shutdown()
print("ok")
"""


@pytest.mark.full
def test_a_process_that_ran_compiled_steps_exits_cleanly():
    """MLX keeps compiled traces per thread: left to the engine thread's exit they were destroyed while
    the interpreter finalized, and the process aborted (exit 134) after printing its result."""
    import subprocess
    import sys

    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


@pytest.mark.full
def test_a_process_that_never_shuts_its_engine_down_exits_cleanly():
    """mlx-lm's own compiled helpers fill the engine thread's compile cache too; an engine left running
    at exit is stopped by an atexit hook, which waits until the thread has really ended (it aborted
    every time before the hook, about half the time with a plain join)."""
    import subprocess
    import sys

    script = EXIT_SCRIPT.replace('compile_decode="all"', "compile_decode=False").replace("eng.shutdown()\n", "")
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])
