"""CPU quantized reads split across streams (``mlxb/kernels/split_read.py``) are mlx-lm's read bit for
bit: along KV heads, along rows (one KV head), with boolean, additive, per-head and causal masks, decode
and prefill shapes; engine rows keep their tokens and logprobs with and without the split. A planted
overlap of the pieces fails the same comparison."""

import mlx.core as mx
import mlx_lm.models.base as base
import pytest

from mlxb.kernels import quantized_attention as qa
from mlxb.kernels import quantized_paths as qp
from mlxb.kernels import split_read as sr


def mlx_lm_read(q, k, v, scale, mask, group_size, bits):
    original = base.quantized_scaled_dot_product_attention
    original = getattr(original, "_mlxb_original", original)
    return original(mx.array(q), k, v, scale=scale, mask=mask, group_size=group_size, bits=bits)


CASES = [  # B, hq, hkv, L, keys, bits, group, mask
    (2, 8, 2, 1, 96, 8, 64, "bool"),
    (3, 16, 4, 5, 70, 4, 32, "bool"),
    (2, 8, 2, 7, 50, 4, 64, "causal"),
    (4, 4, 1, 1, 40, 8, 64, "bool"),      # one KV head: split along rows
    (3, 4, 1, 3, 33, 8, 32, "additive"),
    (2, 6, 6, 2, 64, 8, 64, "per-head"),  # a mask with one plane per head (no grouped query)
    (1, 4, 4, 1, 40, 8, 64, None),
]


def inputs(B, hq, hkv, L, n, bits, group, mask, seed=0):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((B, hq, L, 64), key=k1)
    qk = mx.quantize(mx.random.normal((B, hkv, n, 64), key=k2), group_size=group, bits=bits)
    qv = mx.quantize(mx.random.normal((B, hkv, n, 64), key=k3), group_size=group, bits=bits)
    u = mx.random.uniform(shape=(B, hq if mask == "per-head" else 1, L, n), key=k4)
    m = {"bool": u > 0.3, "per-head": u > 0.3, "additive": mx.log(u), "causal": "causal", None: None}[mask]
    return q, qk, qv, m


@pytest.mark.parametrize("parts", [2, 3])
def test_split_read_is_mlx_lm_read(monkeypatch, parts):
    monkeypatch.setattr(sr, "MIN_WORK", 0)
    for case in CASES:
        q, qk, qv, m = inputs(*case)
        want = mlx_lm_read(q, qk, qv, 0.125, m, case[6], case[5])
        got = sr.split_attention(mlx_lm_read, q, qk, qv, 0.125, m, case[6], case[5], parts=parts)
        assert got.shape == want.shape and mx.array_equal(got, want).item(), (parts, case)
        folded = sr.split_attention(qp.folded_attention, q, qk, qv, 0.125, m, case[6], case[5], parts=parts)
        assert mx.array_equal(folded, want).item(), ("folded", parts, case)


def test_pieces_run_on_their_own_streams(monkeypatch):
    monkeypatch.setattr(sr, "MIN_WORK", 0)
    seen = []

    def read(q, k, v, scale, mask, group_size, bits):
        seen.append((mx.default_stream(mx.cpu), q.shape[1]))
        return mlx_lm_read(q, k, v, scale, mask, group_size, bits)

    q, qk, qv, m = inputs(2, 8, 2, 1, 96, 8, 64, "bool")
    mx.eval(sr.split_attention(read, q, qk, qv, 0.125, m, 64, 8, parts=2))
    assert [h for _, h in seen] == [4, 4]
    assert seen[0][0] != seen[1][0]


def test_small_reads_stay_whole():
    calls = []

    def read(*a):
        calls.append(a[0].shape)
        return mlx_lm_read(*a)

    q, qk, qv, m = inputs(1, 4, 2, 1, 40, 8, 64, "bool")  # 160 units of work, under MIN_WORK
    sr.split_attention(read, q, qk, qv, 0.125, m, 64, 8, parts=2)
    assert calls == [q.shape]


def test_planted_overlap_fails(monkeypatch):
    monkeypatch.setattr(sr, "MIN_WORK", 0)
    monkeypatch.setattr(sr, "_cuts", lambda n, parts: [(0, n // 2 + 1), (n // 2, n)][:parts] if n > 2 else
                        [(0, 1), (0, n - 1)])
    q, qk, qv, m = inputs(2, 8, 2, 1, 96, 8, 64, "bool")
    want = mlx_lm_read(q, qk, qv, 0.125, m, 64, 8)
    got = sr.split_attention(mlx_lm_read, q, qk, qv, 0.125, m, 64, 8, parts=2)
    assert got.shape != want.shape or not mx.array_equal(got, want).item()


def test_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("MLXB_KV_SPLIT", "many")
    sr.reset()
    try:
        with pytest.raises(ValueError, match="MLXB_KV_SPLIT"):
            sr.split_parts()
        monkeypatch.setenv("MLXB_KV_SPLIT", "3")
        sr.reset()
        assert sr.split_parts() == 3
    finally:
        sr.reset()


def one_stream_then_split(monkeypatch, go):
    """``go()`` with every quantized read on one stream, then split in two (MIN_WORK 0): [(result, pieces handed
    to a second stream)]."""
    monkeypatch.setattr(sr, "MIN_WORK", 0)
    real, calls, runs = sr._stream, [], []

    def counting(i):
        calls.append(i)
        return real(i)

    monkeypatch.setattr(sr, "_stream", counting)
    try:
        for how in ("1", "2"):
            monkeypatch.setenv("MLXB_KV_SPLIT", how)
            qa.set_kv_attention("mlx-lm")
            calls.clear()
            runs.append((go(), len(calls)))
    finally:
        monkeypatch.delenv("MLXB_KV_SPLIT")
        qa.set_kv_attention("mlx-lm")
    return runs


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_engine_rows_are_the_same_split_or_not(tiny_models, monkeypatch, preset):
    """Staggered rows with KV8 (tiny-gemma3: quantized rings too), every quantized read split across two
    streams, against the same rows read on one stream."""
    from tests.tiny.test_quantized_kv import engine_rows, same

    model, tok = tiny_models(preset)[:2]
    prompts = [list(range(5, 35)), list(range(40, 57)), list(range(60, 140))]

    def go():
        rows, seen, _ = engine_rows(model, tok, prompts, [0, 2, 3], 8, 0, 4, 12)
        assert seen["quantized_batch"]
        return rows

    runs = one_stream_then_split(monkeypatch, go)
    (one, n_one), (two, n_two) = runs
    assert n_one == 0 and n_two > 0
    assert all(same(a, b) for a, b in zip(one, two))


def test_split_reads_work_from_any_thread(monkeypatch):
    """MLX streams belong to the thread that made them; the engine thread, a warm-up on the main thread and
    a second engine each get their own."""
    import threading

    monkeypatch.setattr(sr, "MIN_WORK", 0)
    q, qk, qv, m = inputs(2, 8, 2, 1, 96, 8, 64, "bool")
    want = mlx_lm_read(q, qk, qv, 0.125, m, 64, 8)
    mx.eval(sr.split_attention(mlx_lm_read, q, qk, qv, 0.125, m, 64, 8, parts=2))  # streams made here first
    got, errors = [], []

    def other():
        try:
            out = sr.split_attention(mlx_lm_read, q, qk, qv, 0.125, m, 64, 8, parts=2)
            mx.eval(out)
            got.append(out)
        except Exception as e:  # noqa: BLE001 - the failure is what the test reports
            errors.append(e)

    for _ in range(2):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert not errors, errors
    assert len(got) == 2 and all(mx.array_equal(g, want).item() for g in got)


@pytest.mark.parametrize("batch", [4, 1])
def test_engine_thread_rows_split_equal_one_stream(tiny_models, monkeypatch, batch):
    """The engine on its own thread (as served), KV8, every quantized read split: every row finishes (the
    streams are the engine thread's own), and a lone row keeps the one-stream run's tokens and logprobs.
    Staggered batches are compared bit for bit off-thread above, where the schedule is fixed."""
    from mlxb.cache.kv_plan import KVScheme
    from mlxb.request import Request
    from tests.tiny.test_engine import run

    model, tok = tiny_models("tiny-llama")[:2]
    prompts = [list(range(5, 35)), list(range(40, 57)), list(range(60, 140))]

    def go():
        cap = {}
        outs, _ = run(model, tok, [Request(f"r{i}", p, 10, ignore_eos=True) for i, p in enumerate(prompts)],
                      batch, delays=[0, 0.02, 0.02], kv_scheme=KVScheme(8, 32, 0),
                      capture=lambda rid, s, t, v, g: cap.__setitem__((rid, s), v.copy()))
        assert all(o[-1].finish_reason == "length" for o in outs), [o[-1] for o in outs]
        return [[o.token for o in out if o.token is not None] for out in outs], cap

    ((t1, c1), n1), ((t2, c2), n2) = one_stream_then_split(monkeypatch, go)
    assert n1 == 0 and n2 > 0
    assert all(len(t) == 10 for t in t1 + t2)
    if batch == 1:  # one schedule on the serial lane; batched rows may join at other steps in the two runs
        assert t1 == t2
        assert c1 and c1.keys() == c2.keys() and all((c1[k] == c2[k]).all() for k in c1)


def test_tensor_parallel_ranks_share_the_cores(monkeypatch):
    monkeypatch.delenv("MLXB_KV_SPLIT", raising=False)
    monkeypatch.setattr(sr, "_cores", lambda: 8)
    try:
        sr.share_cores(1)
        assert sr.split_parts() == (8 if mx.default_device() == mx.cpu else 1)
        sr.share_cores(2)
        assert sr.split_parts() == (4 if mx.default_device() == mx.cpu else 1)
        sr.share_cores(16)
        assert sr.split_parts() == 1
    finally:
        sr.share_cores(1)
