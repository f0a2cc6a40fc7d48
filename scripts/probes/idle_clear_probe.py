"""What clearing MLX's buffer cache the moment the engine goes idle costs a lone request's last token.

Usage: python scripts/probes/idle_clear_probe.py MODEL [--gen 128] [--prompt-len 128] [--repeats 5] [--out F]

Arms, interleaved per repeat on the same prompt (B=1, greedy, ``ignore_eos``):
  deferred   the engine as shipped: the clear waits for an empty inbox poll (``Engine.idle_poll_s``)
  at_once    the same engine with the clear run right after the iteration that finished the request
             (the engine before this change), emulated by clearing after the final flush
  peer       mlx-lm ``stream_generate``
Per arm: the last inter-token interval, the decode rate from token 0 (``bench engine``'s b1 metric) and the
request's wall time (submit to last token). A diagnostic; ``mlxb bench engine`` is the measurement of record.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.engine.warmup import freeze_heap, warm_up
from mlxb.models import load_model
from mlxb.request import Request


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    model, tok, _, _ = load_model(a.model)
    eng = Engine(model, tok, max_batch=8)
    warm_up(eng)
    eng.start()
    freeze_heap()
    flush = eng.delivery.flush
    at_once = [False]

    def flush_then_clear():  # the old loop: idle right after the iteration that finished the last request
        flush()
        if at_once[0] and not eng._live:
            mx.clear_cache()

    eng.delivery.flush = flush_then_clear
    vocab = int(getattr(model.args, "vocab_size", 8192))

    def ours(prompt, clear_at_once):
        at_once[0] = clear_at_once
        r = Request(f"p{time.perf_counter_ns()}", prompt, a.gen, ignore_eos=True)
        st = OutputStream(r.request_id)
        t0 = time.perf_counter()
        eng.submit(r, st)
        ts = [time.perf_counter() for o in st if o.token is not None]
        time.sleep(0.2)  # the engine goes idle (and clears) before the next arm
        return t0, ts

    def peer(prompt, _):
        from mlx_lm import stream_generate

        t = copy.copy(tok)
        t._eos_token_ids = set()
        t0 = time.perf_counter()
        ts = [time.perf_counter() for _ in stream_generate(model, t, prompt, max_tokens=a.gen)]
        return t0, ts

    arms = {"deferred": (ours, False), "at_once": (ours, True), "peer": (peer, None)}
    rng = np.random.default_rng(0)
    warm = rng.integers(3, vocab - 1, size=a.prompt_len).tolist()
    for f, arg in arms.values():
        f(warm, arg)
    res: dict = {k: [] for k in arms}
    try:
        for rep in range(a.repeats):
            prompt = rng.integers(3, vocab - 1, size=a.prompt_len).tolist()
            order = list(arms) if rep % 2 == 0 else list(arms)[::-1]
            for k in order:
                f, arg = arms[k]
                t0, ts = f(prompt, arg)
                res[k].append({"last_ms": (ts[-1] - ts[-2]) * 1e3, "step_ms": float(np.median(np.diff(ts))) * 1e3,
                               "decode_tps": (a.gen - 1) / (ts[-1] - ts[0]), "wall_s": ts[-1] - t0})
            print(json.dumps({"repeat": rep, **{k: v[-1] for k, v in res.items()}}), flush=True)
    finally:
        eng.shutdown()
    summary = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in res.items()}
    for k in ("deferred", "at_once"):
        ratios = [x["decode_tps"] / p["decode_tps"] for x, p in zip(res[k], res["peer"])]
        summary[k]["decode_over_peer"] = [min(ratios), statistics.median(ratios), max(ratios)]
    print(json.dumps({"summary": summary, "device": str(mx.default_device())}, indent=1))
    if a.out:
        json.dump({"rows": res, "summary": summary, "config": vars(a)}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
