"""Where does a cached cohort's iteration go? A diagnostic, not a benchmark.

Usage: python scripts/cohort_cost.py MODEL [--rows 7,13,18,13] [--system 2211] [--own 75]
       python scripts/cohort_cost.py MODEL --mode turn [--rows 16,31] [--system 1500] [--history 400] [--own 113]
                                        [--running 16] [--share-min 256]

Drives an engine that is not started (as the warm-up does): a leader with a ``--system``-token
prompt, then ``rows`` followers that share it arrive while the leader's first chunk runs, so the
next iteration splits the leader and prefills the followers as one cohort from its snapshot (the
agent burst of ``bench load --dataset shared-prefix``). The pieces of that iteration are wrapped
with ``mx.synchronize()`` on both sides and timed, which serializes the device but attributes
the time. Each round uses a new system prompt (a cold prefix, warm kernels after round one).

``--mode turn`` is an agent loop's turn boundary instead (``bench load --dataset agent-loop``): ``rows`` agents
each ran a first turn (a shared ``--system`` prompt, ``--history`` tokens of their own, 8 generated tokens, kept
by the prompt cache at retire); while ``--running`` other rows decode, every agent sends its next turn (that
prompt, its generated ids, ``--own`` new tokens) and the timed iteration prefills them as one cohort from their
own cached turns. ``--share-min`` turns shared-prefix KV on (``MLXB_SHARE_MIN_SAVED`` sets the GPU floor).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from collections import defaultdict

import mlx.core as mx
import numpy as np

from mlxb.engine.build import build_prompt_cache, choose_attention_kernels
from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.kernels.quantized_attention import set_kv_attention
from mlxb.models import load_model
from mlxb.request import Request

SPENT: dict = defaultdict(float)


def _arrays(obj, depth=0) -> list:
    """Arrays an op's result (or the cache it changed in place) holds, so the lazy work runs now."""
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, (list, tuple)) and depth < 3:
        return [x for o in obj for x in _arrays(o, depth + 1)]
    state = getattr(obj, "state", None) if depth < 3 and not isinstance(obj, (int, float, str)) else None
    return _arrays(state, depth + 1) if state is not None and not callable(state) else []


def timed(label, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        mx.synchronize()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        mx.eval(_arrays(out) + (_arrays(a[0]) if a and hasattr(a[0], "state") else []))
        mx.synchronize()
        SPENT[label] += time.perf_counter() - t0
        return out
    return wrapper


class _Timed:
    """The model with its forward timed; every other attribute is the model's."""

    def __init__(self, model):
        self._model = model

    def __call__(self, x, *a, **kw):
        # a prefill's logits are never evaluated by the engine (only the caches' state is): evaluating them
        # here would time the vocabulary projection over every position, which the engine skips
        label = f"forward{tuple(x.shape)}"
        mx.synchronize()
        t0 = time.perf_counter()
        out = self._model(x, *a, **kw)
        cache = kw.get("cache") or (a[0] if a else None)
        mx.eval(_arrays(cache) if x.shape[1] > 1 and cache is not None else out)
        mx.synchronize()
        SPENT[label] += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


def _time_attention():
    """Attention inside each forward, timed apart (its inputs evaluated first, so the projections stay in the
    forward's share): ``attention(L=1)`` for single-query steps, ``attention(L>1)`` for prefill and verify."""
    import sys

    import mlx_lm.models.base as base

    original = base.scaled_dot_product_attention

    def wrapper(queries, keys, values, *a, **kw):
        mask = kw.get("mask", a[2] if len(a) > 2 else None)
        mx.eval([x for x in (queries, keys, values, mask) if isinstance(x, mx.array)])
        mx.synchronize()
        t0 = time.perf_counter()
        out = original(queries, keys, values, *a, **kw)
        mx.eval(out)
        mx.synchronize()
        SPENT["attention(L=1)" if queries.shape[2] == 1 else "attention(L>1)"] += time.perf_counter() - t0
        return out

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("mlx_lm.models.") and \
                getattr(mod, "scaled_dot_product_attention", None) is original:
            mod.scaled_dot_product_attention = wrapper


def instrument(engine):
    from mlx_lm.models import cache as C

    from mlxb.engine import runner as R

    for cls, name in [(C.BatchKVCache, "finalize"), (C.BatchKVCache, "extend"), (C.BatchKVCache, "filter")]:
        setattr(cls, name, timed("mlx-lm " + name, getattr(cls, name)))  # nested inside mlxb's where it calls them
    from mlxb.cache.dense import AlignedBatchKVCache

    AlignedBatchKVCache.merge = classmethod(timed("merge", AlignedBatchKVCache.merge.__func__))
    # mlxb's own row operations (they override mlx-lm's, so wrapping the base class alone misses them)
    from mlxb.cache.shared import SharedBatchKVCache
    from mlxb.engine.sharing import Sharing

    for cls, tag in ((AlignedBatchKVCache, ""), (SharedBatchKVCache, "shared ")):
        for name in ("extend", "filter", "extract", "finalize"):
            if name in vars(cls):
                setattr(cls, name, timed(tag + name, vars(cls)[name]))
    for name in ("cohort_caches", "before_join"):
        setattr(Sharing, name, timed("sharing " + name, getattr(Sharing, name)))
    R.sample_rows = timed("sample", R.sample_rows)
    from mlxb.engine import decode as D

    D.sample_rows = timed("sample", D.sample_rows)
    for name in ("_emit", "_align", "_attach"):
        setattr(R.Runner, name, timed(name, getattr(R.Runner, name)))
    mx.clear_cache = timed("clear_cache", mx.clear_cache)
    engine.runner.model = _Timed(engine.runner.model)
    _time_attention()
    engine.reuse.seed = timed("seed", engine.reuse.seed)
    engine.reuse.boundary_snapshot = timed("boundary_snapshot", engine.reuse.boundary_snapshot)
    engine.reuse.put_finished = timed("put_finished", engine.reuse.put_finished)
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", default="7,13,18,13")
    ap.add_argument("--system", type=int, default=2211)
    ap.add_argument("--own", type=int, default=75)
    ap.add_argument("--out")
    ap.add_argument("--mode", choices=["burst", "turn"], default="burst")
    ap.add_argument("--history", type=int, default=400)
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--share-min", type=int, default=None)
    ap.add_argument("--kv-attention", default=os.environ.get("MLXB_KV_ATTENTION", "mlx-lm"),
                    help="mlx-lm or fused (CUDA: mlxb's decode-attention kernel, as `mlxb serve --kv-attention`)")
    a = ap.parse_args()
    attention = choose_attention_kernels(None)
    set_kv_attention(a.kv_attention)
    model, tok, _, _ = load_model(a.model)
    vocab = model.args.vocab_size
    eng = Engine(model, tok, max_batch=128, prefill_chunk=2048, share_min=a.share_min)
    eng.attach_prompt_cache(build_prompt_cache(eng, kv_budget=None, disk_dir=tempfile.mkdtemp()))
    from mlxb.engine.warmup import warm_up

    warm_up(eng)
    instrument(eng)
    rng = np.random.default_rng(0)
    results = turns(eng, a, vocab, rng) if a.mode == "turn" else bursts(eng, a, vocab, rng)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"attention": attention, "kv_attention": a.kv_attention, "device": str(mx.default_device()), "mode": a.mode,
                       "share_min": a.share_min, "rounds": results}, f, indent=1)


def _run(eng, reqs) -> list:
    """Submit ``reqs`` and iterate until they finish; their generated ids."""
    streams = []
    for r in reqs:
        r.mechanism = "continuous"
        streams.append(OutputStream(r.request_id))
        eng.accept(r, streams[-1])
    while any(r.request_id in eng._live for r in reqs):
        eng.iterate()
    out = []
    for st in streams:
        ids = []
        while not st._q.empty():
            item = st._q.get()
            if getattr(item, "token", None) is not None:
                ids.append(item.token)
        out.append(ids)
    return out


def turns(eng, a, vocab, rng) -> list:
    results = []
    for rnd, B in enumerate(int(x) for x in a.rows.split(",")):
        system = rng.integers(5, vocab - 1, size=a.system).tolist()
        first = [system + rng.integers(5, vocab - 1, size=a.history + i % 9).tolist() for i in range(B)]
        gen = _run(eng, [Request(f"t{rnd}-{i}-1", p, 8, ignore_eos=True) for i, p in enumerate(first)])
        running = [Request(f"bg{rnd}-{i}", rng.integers(5, vocab - 1, size=a.history).tolist(), 4096,
                           ignore_eos=True) for i in range(a.running)]
        streams = []
        for r in running:
            r.mechanism = "continuous"
            streams.append(OutputStream(r.request_id))
            eng.accept(r, streams[-1])
        while any(r.request_id in eng.scheduler.prefill_pos or any(w is r for w in eng.scheduler.waiting)
                  for r in running) or len(eng.scheduler.running) < a.running:
            eng.iterate()
        for _ in range(3):
            eng.iterate()  # the running rows decode
        second = [p + g + rng.integers(5, vocab - 1, size=a.own + i % 9).tolist() for i, (p, g) in enumerate(zip(first, gen))]
        reqs = [Request(f"t{rnd}-{i}-2", p, 4, ignore_eos=True) for i, p in enumerate(second)]
        for r in reqs:
            r.mechanism = "continuous"
            eng.accept(r, OutputStream(r.request_id))
        SPENT.clear()
        mx.synchronize()
        t0 = time.perf_counter()
        out = eng.iterate()
        wall = time.perf_counter() - t0
        cached = [r.cached_tokens for r in reqs]
        row = {"round": rnd, "agents": B, "running": a.running, "admitted": len(out.admitted) if out else 0,
               "cached_min": min(cached), "prompt_max": max(len(p) for p in second), "wall_ms": round(1000 * wall, 1),
               "unattributed_ms": round(1000 * (wall - sum(SPENT.values())), 1),
               **{k: round(1000 * v, 1) for k, v in sorted(SPENT.items(), key=lambda kv: -kv[1])}}
        if eng.runner.sharing is not None:
            row["sharing"] = eng.runner.sharing.stats(eng.runner.caches, eng.runner.rows)
        results.append(row)
        print(json.dumps(row), flush=True)
        for r in running:
            eng.cancel(r.request_id)
        eng._drain_inbox(block=False)
        while eng._live:
            eng.iterate()
    return results


def bursts(eng, a, vocab, rng) -> list:
    results = []
    for rnd, B in enumerate(int(x) for x in a.rows.split(",")):
        system = rng.integers(5, vocab - 1, size=a.system).tolist()
        reqs = [Request(f"r{rnd}-{i}", system + rng.integers(5, vocab - 1, size=a.own + i % 9).tolist(), 4,
                        ignore_eos=True) for i in range(B + 1)]
        for r in reqs:
            r.mechanism = "continuous"
        eng.accept(reqs[0], OutputStream(reqs[0].request_id))
        eng.iterate()  # the leader's first chunk
        for r in reqs[1:]:
            eng.accept(r, OutputStream(r.request_id))
        SPENT.clear()
        mx.synchronize()
        t0 = time.perf_counter()
        eng.iterate()  # leader's tail (split at the shared length) + the followers' cohort + one decode
        wall = time.perf_counter() - t0
        row = {"round": rnd, "followers": B, "wall_ms": round(1000 * wall, 1),
               "unattributed_ms": round(1000 * (wall - sum(SPENT.values())), 1),
               **{k: round(1000 * v, 1) for k, v in sorted(SPENT.items(), key=lambda kv: -kv[1])}}
        results.append(row)
        print(json.dumps(row), flush=True)
        while eng._live:
            eng.iterate()
    return results


if __name__ == "__main__":
    main()
