"""Where does a decode step's time go? Steady-state step times, ours vs mlx-lm, on one model.

Usage: python scripts/profile_decode.py MODEL --batches 1,8,32 [--prompt-len 128] [--gen 96] [--out F]

For each B it measures, interleaved, the median steady-state step interval (the middle half of the
run, so admission and retirement are excluded) of:
  peer        mlx-lm BatchGenerator (B=1: stream_generate)
  direct      our engine driven by ``iterate()`` on this thread (no engine thread, no consumer)
  thread      our engine thread with a consumer thread reading every stream (the serving shape)
  raw_ours    a bare pipelined forward+argmax loop on our joined caches (no sampler, no delivery)
  raw_peer    the same bare loop on mlx-lm's own batch caches
This is a diagnostic, not a benchmark: `mlxb bench engine` is the measurement of record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import mlx.core as mx
import numpy as np

from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.models import load_model
from mlxb.request import Request


PHASE: dict = {}


def instrument(model):
    """Time the model call and mx.async_eval of every decode forward ([B, 1] inputs), per arm."""
    cls = type(model)
    orig_call, orig_async = cls.__call__, mx.async_eval

    def call(self, inputs, *a, **k):
        t = time.perf_counter()
        out = orig_call(self, inputs, *a, **k)
        if inputs.shape[-1] == 1:
            PHASE["build"] = PHASE.get("build", 0.0) + time.perf_counter() - t
            PHASE["n"] = PHASE.get("n", 0) + 1
            PHASE["armed"] = True
        return out

    def aeval(*a):
        t = time.perf_counter()
        orig_async(*a)
        if PHASE.pop("armed", False):
            dt = time.perf_counter() - t
            PHASE["launch"] = PHASE.get("launch", 0.0) + dt
            PHASE.setdefault("series", []).append(dt)

    orig_clear = mx.clear_cache

    def clear():
        PHASE.setdefault("clears", []).append(len(PHASE.get("series", [])))
        orig_clear()

    cls.__call__ = call
    mx.async_eval = aeval
    mx.clear_cache = clear


def phases() -> dict:
    n = PHASE.get("n", 0) or 1
    out = {"build_ms": 1000 * PHASE.get("build", 0.0) / n, "launch_ms": 1000 * PHASE.get("launch", 0.0) / n}
    ser = [1000 * x for x in PHASE.get("series", [])]
    if ser:
        out["launch_median_ms"] = statistics.median(ser)
        top = sorted(range(len(ser)), key=lambda i: -ser[i])[:4]
        out["slowest"] = [(i, round(ser[i], 1)) for i in top]
        out["excess_ms"] = sum(x - out["launch_median_ms"] for x in ser if x > 2 * out["launch_median_ms"])
        out["clears_at"] = PHASE.get("clears", [])
    PHASE.clear()
    return out


def steady(stamps: list[float]) -> float:
    d = [b - a for a, b in zip(stamps, stamps[1:])]
    n = len(d)
    mid = d[n // 4: max(n // 4 + 1, 3 * n // 4)]
    return statistics.median(mid) * 1000 if mid else float("nan")


def prompts(B, L, vocab, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab - 1, size=L).tolist() for _ in range(B)]


def peer(model, ps, gen):
    from mlx_lm.generate import BatchGenerator

    bg = BatchGenerator(model, max_tokens=gen, stop_tokens=None, completion_batch_size=len(ps),
                        prefill_batch_size=len(ps))
    bg.insert(ps, max_tokens=[gen] * len(ps))
    stamps = []
    while True:
        r = bg.next_generated()
        if not r:
            break
        if len(r) == len(ps):
            stamps.append(time.perf_counter())
    bg.close()
    return steady(stamps)


def peer_single(model, tok, p, gen):
    import copy

    from mlx_lm import stream_generate

    t = copy.copy(tok)
    t._eos_token_ids = set()
    stamps = [time.perf_counter() for _ in stream_generate(model, t, p, max_tokens=gen)]
    return steady(stamps)


def peer_caches(model, ps):
    """mlx-lm's batch caches after its own prompt processing (for the raw loop)."""
    from mlx_lm.generate import BatchGenerator

    bg = BatchGenerator(model, max_tokens=1000, stop_tokens=None, completion_batch_size=len(ps),
                        prefill_batch_size=len(ps))
    bg.insert(ps, max_tokens=[1000] * len(ps))
    while len(bg._generation_batch) < len(ps):
        bg.next_generated()
    c = bg._generation_batch.prompt_cache
    tok = bg._generation_batch._next_tokens
    return c, tok


def raw(model, caches, tok, n):
    stamps = []
    y = tok
    for _ in range(n):
        logits = model(y[:, None], cache=caches)[:, -1, :]
        nxt = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
        mx.async_eval(nxt)
        y.tolist()
        y = nxt
        stamps.append(time.perf_counter())
    return steady(stamps)


def requests(ps, gen, prefix, put) -> list[OutputStream]:
    """One request per prompt (EOS ignored) handed to ``put(request, stream)``; returns the streams."""
    sts = []
    for i, p in enumerate(ps):
        r = Request(f"{prefix}{time.perf_counter_ns()}-{i}", p, gen, ignore_eos=True)
        st = OutputStream(r.request_id)
        put(r, st)
        sts.append(st)
    return sts


def direct(model, tok, ps, gen, chunk, keep_caches=False):
    eng = Engine(model, tok, max_batch=len(ps), prefill_chunk=chunk)
    requests(ps, gen, "d", eng.accept)
    stamps = []
    eng.runner.timing.clear()
    while eng.scheduler.has_work():
        out = eng.iterate()
        if out is not None and not out.prefills and len(eng.runner.rows) == len(ps):
            stamps.append(time.perf_counter())
            if keep_caches and len(stamps) == 3:
                return eng.runner
    t = eng.step_timing()
    eng.runner.drop_all()
    return steady(stamps), t


def threaded(eng, ps, gen):
    eng.runner.timing.clear()
    sts = requests(ps, gen, "t", eng.submit)
    stamps = []

    def others():
        for st in sts[1:]:
            for _ in st:
                pass

    th = threading.Thread(target=others)
    th.start()
    n = 0
    for o in sts[0]:
        if o.token is not None:
            n += 1
            stamps.append(time.perf_counter())
    th.join()
    return steady(stamps), eng.step_timing()


def show(row: dict) -> None:
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                      if not k.endswith(("timing", "phases"))}), flush=True)
    print("  phases", {k: {p: (round(x, 2) if isinstance(x, float) else x) for p, x in v.items()}
                       for k, v in row.items() if k.endswith("phases")}, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="peer, direct and thread only")
    a = ap.parse_args()
    model, tok, _, _ = load_model(a.model)
    instrument(model)
    vocab = int(model.args.vocab_size)
    batches = [int(b) for b in a.batches.split(",")]
    eng = Engine(model, tok, max_batch=max(batches), prefill_chunk=a.chunk).start()
    res = []
    try:
        w = prompts(2, a.prompt_len, vocab, 5)
        peer(model, w, 8), direct(model, tok, w, 8, a.chunk), threaded(eng, w, 8)
        for rep in range(a.repeats):
            for B in batches:
                ps = prompts(B, a.prompt_len, vocab, 100 * rep + B)
                row = {"B": B, "repeat": rep}
                phases()
                row["peer_ms"] = peer(model, ps, a.gen)
                row["peer_phases"] = phases()
                if B == 1:
                    row["peer_single_ms"] = peer_single(model, tok, ps[0], a.gen)
                row["direct_ms"], row["direct_timing"] = direct(model, tok, ps, a.gen, a.chunk)
                row["direct_phases"] = phases()
                row["direct_onecohort_ms"], _ = direct(model, tok, ps, a.gen, max(a.chunk, B * a.prompt_len))
                row["direct_onecohort_phases"] = phases()
                row["thread_ms"], row["thread_timing"] = threaded(eng, ps, a.gen)
                row["thread_phases"] = phases()
                if a.quick:
                    res.append(row)
                    show(row)
                    continue
                runner = direct(model, tok, ps, a.gen, a.chunk, keep_caches=True)
                row["raw_ours_ms"] = raw(model, runner.caches, runner.register, a.gen)
                runner.drop_all()
                c, t = peer_caches(model, ps)
                row["raw_peer_ms"] = raw(model, c, t, a.gen)
                del c
                mx.clear_cache()
                show(row)
                print("  direct timing", {k: round(v, 3) for k, v in row["direct_timing"].items()}, flush=True)
                print("  thread timing", {k: round(v, 3) for k, v in row["thread_timing"].items()}, flush=True)
                res.append(row)
    finally:
        eng.shutdown()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
