"""Where the engine thread's B=1 decode time goes: the same engine and prompt, per-step ms (median of
the middle half), with the consumer and the GIL varied. Usage: python scripts/probes/thread_probe.py MODEL.

  direct       engine.iterate() on this thread, nothing consumes (the runner's own cost)
  thread       engine thread, this thread iterates the stream (detokenizes every token): serving's shape
  thread-raw   engine thread, this thread reads the raw queue (no detokenizer)
  thread-late  engine thread, this thread sleeps until the end, then reads (no wake per token)
  thread-si    as ``thread`` with sys.setswitchinterval(1e-4)
  peer         mlx-lm stream_generate on this thread (a lone request's reference)
"""
import statistics
import sys
import time

import numpy as np

from mlxb.engine.engine import Engine
from mlxb.engine.stream import _END, OutputStream
from mlxb.models import load_model
from mlxb.request import Request


def mid(stamps):
    d = [b - a for a, b in zip(stamps, stamps[1:])]
    d = d[len(d) // 4: 3 * len(d) // 4]
    return 1000 * statistics.median(d)


def req(p, gen, tag):
    return Request(f"{tag}{time.perf_counter_ns()}", p, gen, ignore_eos=True)


def direct(model, tok, p, gen):
    eng = Engine(model, tok, max_batch=2, prefill_chunk=4096)
    r = req(p, gen, "d")
    eng.accept(r, OutputStream(r.request_id))
    stamps = []
    while eng.scheduler.has_work():
        out = eng.iterate()
        if out is not None and not out.prefills:
            stamps.append(time.perf_counter())
    return mid(stamps)


def threaded(eng, p, gen, how):
    r = req(p, gen, how)
    st = OutputStream(r.request_id)
    stamps = []
    if how == "late":  # stamp on the engine side: wrap put
        orig = st._push

        def push(item, outbox):
            stamps.append(time.perf_counter())
            orig(item, outbox)
        st._push = push
        eng.submit(r, st)
        while True:
            item = st._q.get()
            if item is _END:
                break
        return mid(stamps[1:-1])
    eng.submit(r, st)
    if how == "raw":
        while True:
            item = st._q.get()
            if item is _END:
                break
            stamps.append(time.perf_counter())
    else:
        for o in st:
            if o.token is not None:
                stamps.append(time.perf_counter())
    return mid(stamps)


def peer(model, tok, p, gen):
    import copy

    from mlx_lm import stream_generate

    t = copy.copy(tok)
    t._eos_token_ids = set()
    return mid([time.perf_counter() for _ in stream_generate(model, t, p, max_tokens=gen)])


def main():
    name = sys.argv[1]
    gen = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    model, tok, _, _ = load_model(name)
    rng = np.random.default_rng(0)
    p = rng.integers(3, int(model.args.vocab_size) - 1, size=128).tolist()
    eng = Engine(model, tok, max_batch=8, prefill_chunk=4096).start()
    arms = ["peer", "direct", "thread", "thread-raw", "thread-late", "thread-si"]
    res = {a: [] for a in arms}
    base_si = sys.getswitchinterval()
    try:
        for a in arms:  # warm every path once
            if a == "peer":
                peer(model, tok, p, 16)
            elif a == "direct":
                direct(model, tok, p, 16)
            else:
                threaded(eng, p, 16, "x")
        for rep in range(reps):
            for a in arms if rep % 2 == 0 else list(reversed(arms)):
                if a == "peer":
                    v = peer(model, tok, p, gen)
                elif a == "direct":
                    v = direct(model, tok, p, gen)
                elif a == "thread-si":
                    sys.setswitchinterval(1e-4)
                    v = threaded(eng, p, gen, "si")
                    sys.setswitchinterval(base_si)
                else:
                    v = threaded(eng, p, gen, a.split("-")[-1])
                res[a].append(v)
    finally:
        eng.shutdown()
    for a in arms:
        v = res[a]
        print(f"{a:12s} ms/token median {statistics.median(v):.3f} min {min(v):.3f} max {max(v):.3f}"
              f"  peer/this {statistics.median(res['peer']) / statistics.median(v):.3f}", flush=True)


if __name__ == "__main__":
    main()
