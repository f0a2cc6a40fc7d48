"""Shared-prefix KV: cascade attention, the shared layer's row operations and ownership, the sharing plan,
admission accounting and the start-up probe."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlxb.cache.dense import AlignedBatchKVCache
from mlxb.cache.projection import KVProjection, LayerBytes
from mlxb.cache.shared import SharedBatchKVCache, SharedKV, cascade_attention, prefix_of
from mlxb.engine.scheduler import Scheduler
from mlxb.engine.sharing import plan, probe
from mlxb.request import Request


def _rand(shape, seed, dt=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dt)


def _copies(q, kp, vp, ks, vs, share, N):
    """Attention with every sharing row holding its own copy of the prefix (MLX's kernel, the reference)."""
    B, H, T, D = ks.shape
    P = kp.shape[2]
    K = mx.concatenate([mx.broadcast_to(kp, (B, H, P, D)), ks], axis=2)
    V = mx.concatenate([mx.broadcast_to(vp, (B, H, P, D)), vs], axis=2)
    pos = mx.arange(P + T)
    visible = (pos[None] >= P) | share[:, None]
    causal = (mx.arange(T - N, T)[:, None] + P) >= pos[None]
    return mx.fast.scaled_dot_product_attention(q, K, V, scale=D ** -0.5,
                                                mask=visible[:, None, None, :] & causal[None, None])


@pytest.mark.parametrize("dt,tol", [(mx.float32, 1e-6), (mx.bfloat16, 8e-3)])
@pytest.mark.parametrize("B,Hq,H,N,P,T,D", [(4, 8, 2, 1, 300, 40, 64), (3, 4, 4, 5, 100, 20, 32), (2, 8, 8, 1, 64, 3, 128)])
def test_cascade_equals_attention_over_copies_and_a_dropped_shift_fails(dt, tol, B, Hq, H, N, P, T, D):
    q, kp, vp = _rand((B, Hq, N, D), 1, dt), _rand((1, H, P, D), 2, dt), _rand((1, H, P, D), 3, dt)
    ks, vs = _rand((B, H, T, D), 4, dt), _rand((B, H, T, D), 5, dt)
    share = mx.array([i % 2 == 0 for i in range(B)])
    want = _copies(q, kp, vp, ks, vs, share, N).astype(mx.float32)
    own = mx.broadcast_to((mx.arange(T - N, T)[:, None] >= mx.arange(T)[None])[None, None], (B, 1, N, T))
    args = (q, SharedKV((ks, kp, share)), SharedKV((vs, vp, share)), D ** -0.5, own)
    got = cascade_attention(*args).astype(mx.float32)
    assert mx.abs(got - want).max().item() <= tol
    bad = cascade_attention(*args, merge_fault=True).astype(mx.float32)  # planted: blocks normalised apart
    assert mx.abs(bad - want).max().item() > 0.1


def _layer(lengths, H=2, D=8, seed=0):
    """A batch layer whose row i holds ``lengths[i]`` tokens (its own keys/values as single-row caches)."""
    solos = []
    for i, n in enumerate(lengths):
        c = KVCache()
        c.update_and_fetch(_rand((1, H, n, D), seed + 2 * i), _rand((1, H, n, D), seed + 2 * i + 1))
        solos.append(c)
    return AlignedBatchKVCache.merge(solos), solos


def test_a_shared_layer_holds_one_copy_and_gives_rows_back_whole():
    P = 40
    c, solos = _layer([50, 47, 45])
    for s in solos[1:]:  # rows 1 and 2 open with row 0's first P tokens
        s.keys[..., :P, :] = solos[0].keys[..., :P, :]
        s.values[..., :P, :] = solos[0].values[..., :P, :]
    c, _ = AlignedBatchKVCache.merge(solos), None
    before = c.nbytes
    s = SharedBatchKVCache.wrap(c)
    s.share_rows([0, 1, 2], prefix_of(s, 0, P))
    assert s.sharing and s.nbytes < before
    assert s.keys.shape[2] == 50 - P and s.offset.tolist() == [50, 47, 45]  # own tokens; positions unchanged
    for i, solo in enumerate(solos):  # extract gives the row's whole history back, bit for bit
        r = s.extract(i)
        assert r.offset == solo.offset and mx.array_equal(r.keys, solo.keys[..., :solo.offset, :]).item()
    s.filter([1, 2])
    assert s.sharing and s.share == [True, True]
    p = s.prefix
    s.filter([1])
    assert s.prefix is p  # a row still reads it


def test_the_prefix_is_dropped_when_its_last_reader_leaves():
    c, _ = _layer([30, 28, 12])
    s = SharedBatchKVCache.wrap(c)
    s.share_rows([0, 1], prefix_of(s, 0, 10))
    keep = s.extract(2)
    s.filter([2])
    assert s.prefix is None and s.share == [False] and not s.sharing
    assert mx.array_equal(s.extract(0).keys, keep.keys).item()  # the row that never shared is untouched


def test_rows_of_another_prefix_cannot_join_a_sharing_layer():
    a, _ = _layer([30, 30], seed=0)
    b, _ = _layer([30, 30], seed=10)
    a, b = SharedBatchKVCache.wrap(a), SharedBatchKVCache.wrap(b)
    a.share_rows([0, 1], prefix_of(a, 0, 10))
    b.share_rows([0, 1], prefix_of(b, 0, 10))
    with pytest.raises(ValueError, match="different shared prefixes"):
        a.extend(b)


def test_the_plan_picks_the_run_that_saves_most_and_keeps_adapters_apart():
    rng = np.random.default_rng(0)
    sys_a, sys_b = rng.integers(0, 999, 600), rng.integers(0, 999, 300)
    rows = [np.concatenate([sys_a, rng.integers(0, 999, 20)]) for _ in range(2)]
    rows += [np.concatenate([sys_b, rng.integers(0, 999, 20)]) for _ in range(5)]
    rows.append(rng.integers(0, 999, 400))
    P, picked = plan(rows, [None] * 8, 64)
    assert P >= 300 and picked == [2, 3, 4, 5, 6]  # 300 x 4 saved beats 600 x 1
    P, picked = plan(rows, [None, None, 0, 1, 0, 1, 0, None], 64)  # KV differs per adapter
    assert picked == [2, 4, 6]
    assert plan(rows, [None] * 8, 700) == (0, [])


def test_admission_charges_a_live_prefix_once():
    proj = KVProjection((LayerBytes("full", 100), LayerBytes("rotating", 10, window=8)))
    live = {"on": False}
    s = Scheduler(max_batch=16, kv_budget=10 ** 6, row_bytes=proj.row_bytes, shared_bytes=proj.shared_bytes,
                  shared_tokens=lambda req: 900 if live["on"] else 0, prefix_bytes=lambda: 90_000 if live["on"] else 0)
    req = Request("a", list(range(1000)), 24)
    assert s.projected_bytes(req, shared=True) == 1024 * 100 + 80
    live["on"] = True
    s.sharing_version = lambda: 1
    assert s.projected_bytes(req, shared=True) == 124 * 100 + 80 and s.used_bytes == 90_000
    assert s.projected_bytes(req) == 1024 * 100 + 80  # admission, prefill and "can it ever fit": the whole row


def test_rows_admitted_before_a_prefix_formed_are_charged_again_when_it_forms():
    proj = KVProjection((LayerBytes("full", 100),))
    state = {"live": False, "version": 0}
    s = Scheduler(max_batch=8, kv_budget=250_000, row_bytes=proj.row_bytes, shared_bytes=proj.shared_bytes,
                  shared_tokens=lambda req: 900 if state["live"] else 0,
                  prefix_bytes=lambda: 90_000 if state["live"] else 0, sharing_version=lambda: state["version"])
    for i in range(4):
        s.add(Request(f"r{i}", list(range(1000)), 24))
    out = s.schedule()
    assert len(out.admitted) == 2  # 2 x 102,400 whole rows fit in 250,000; a third would not
    for c in out.prefills:
        s.on_prefill_chunk(c)
    for rid in out.admitted:  # their cohort joins the batch and reads one prefix
        s.on_joined(rid)
    state.update(live=True, version=1)
    out = s.schedule()
    assert out.admitted == ["r2"]  # memory allows it now (this iteration's prompt tokens end with its chunk)
    assert s.used_bytes == 90_000 + 2 * 12_400 + 102_400  # running rows pay their own tokens; r2 prefills whole
    state.update(live=False, version=2)  # freed with its last reader: whole rows again
    s.schedule()
    assert s.used_bytes == 3 * 102_400


def test_the_probe_turns_sharing_off_where_attention_is_computed_by_hand():
    from mlx_lm.models import gemma2, llama

    from mlxb.cache.protocol import layer_kinds

    g = gemma2.Model(gemma2.ModelArgs("gemma2", 32, 2, 64, 4, 8, 1e-6, 64, 2))
    assert "cannot read a shared layer" in probe(g, layer_kinds(g))
    m = llama.Model(llama.ModelArgs("llama", 32, 2, 64, 4, 1e-6, 64, 2))
    assert probe(m, layer_kinds(m)) is None


def test_a_plan_must_save_enough_where_the_backend_asks_for_it():
    rng = np.random.default_rng(1)
    pre = rng.integers(0, 999, 300)
    rows = [np.concatenate([pre, rng.integers(0, 999, 10)]) for _ in range(4)]
    assert plan(rows, [None] * 4, 64, min_saved=900)[1] == [0, 1, 2, 3]  # 300 x 3 saved
    assert plan(rows, [None] * 4, 64, min_saved=901) == (0, [])


def test_a_prefix_without_its_float32_values_gives_the_same_bits_and_holds_less():
    """Under memory pressure a half-precision prefix keeps no float32 copy of its values: the cascade casts them
    per step to the same float32 values, so the output is bit-identical, and the prefix holds half the bytes."""
    from mlxb.cache.shared import SharedPrefix

    B, Hq, H, N, P, T, D = 3, 8, 2, 1, 200, 30, 64
    dt = mx.bfloat16
    q, kp, vp = _rand((B, Hq, N, D), 11, dt), _rand((1, H, P, D), 12, dt), _rand((1, H, P, D), 13, dt)
    ks, vs = _rand((B, H, T, D), 14, dt), _rand((B, H, T, D), 15, dt)
    share = mx.array([True, False, True])
    outs, sizes = [], []
    for keep in (True, False):
        p = SharedPrefix(kp, vp, keep_f32=keep)
        v = p.values if p.values32 is None else p.values32
        outs.append(cascade_attention(q, SharedKV((ks, p.keys, share)), SharedKV((vs, v, share)), D ** -0.5, None))
        sizes.append(p.nbytes)
    assert outs[0].dtype == outs[1].dtype == dt
    assert mx.array_equal(outs[0], outs[1]).item()
    assert sizes[1] * 2 == sizes[0]  # bf16 keys + values, against + float32 values
