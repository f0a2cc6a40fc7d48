"""Where does a cached cohort's iteration go? A diagnostic, not a benchmark.

Usage: python scripts/cohort_cost.py MODEL [--rows 7,13,18,13] [--system 2211] [--own 75]

Drives an engine that is not started (as the warm-up does): a leader with a ``--system``-token
prompt, then ``rows`` followers that share it arrive while the leader's first chunk runs, so the
next iteration splits the leader and prefills the followers as one cohort from its snapshot (the
agent burst of ``bench load --dataset shared-prefix``). The pieces of that iteration are wrapped
with ``mx.synchronize()`` on both sides and timed, which serializes the device but attributes
the time. Each round uses a new system prompt (a cold prefix, warm kernels after round one).
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from collections import defaultdict

import mlx.core as mx
import numpy as np

from mlxb.engine.build import build_prompt_cache, choose_attention_kernels
from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
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
        return timed(f"forward{tuple(x.shape)}", self._model.__call__)(x, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


def instrument(engine):
    from mlx_lm.models import cache as C

    from mlxb.cache import protocol as P
    from mlxb.engine import runner as R

    for cls, name in [(C.BatchKVCache, "finalize"), (C.BatchKVCache, "extend"), (C.BatchKVCache, "filter")]:
        setattr(cls, name, timed(name, getattr(cls, name)))
    P.AlignedBatchKVCache.merge = classmethod(timed("merge", C.BatchKVCache.merge.__func__))
    R.Runner._sample_rows = staticmethod(timed("sample", R.Runner._sample_rows))
    for name in ("_emit", "_align", "_attach"):
        setattr(R.Runner, name, timed(name, getattr(R.Runner, name)))
    mx.clear_cache = timed("clear_cache", mx.clear_cache)
    engine.runner.model = _Timed(engine.runner.model)
    engine.reuse.seed = timed("seed", engine.reuse.seed)
    engine.reuse.boundary_snapshot = timed("boundary_snapshot", engine.reuse.boundary_snapshot)
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", default="7,13,18,13")
    ap.add_argument("--system", type=int, default=2211)
    ap.add_argument("--own", type=int, default=75)
    ap.add_argument("--out")
    a = ap.parse_args()
    attention = choose_attention_kernels(None)
    model, tok, _, _ = load_model(a.model)
    vocab = model.args.vocab_size
    eng = Engine(model, tok, max_batch=64, prefill_chunk=2048)
    eng.attach_prompt_cache(build_prompt_cache(eng, kv_budget=None, disk_dir=tempfile.mkdtemp()))
    from mlxb.engine.warmup import warm_up

    warm_up(eng)
    instrument(eng)
    rng = np.random.default_rng(0)
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
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"attention": attention, "device": str(mx.default_device()), "rounds": results}, f, indent=1)


if __name__ == "__main__":
    main()
