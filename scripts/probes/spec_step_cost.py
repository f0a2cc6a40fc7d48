"""What a speculative verify step costs against a plain decode step, piece by piece.

    python scripts/probes/spec_step_cost.py MODEL_DIR --context 512 --batches 1,8 --widths 1,2,3,5 --out FILE.json

For B rows of ``context`` tokens (batch caches merged from single rows, as the engine holds them), it
times with a synchronization after each piece, arms interleaved:

* the target forward over [B, L] tokens, L = 1 (a plain step) and the verify widths, once at a growing
  key length (every call a key length never seen before, as in serving) and once at a fixed one
  (the same shape again: the cache is rolled back after each call);
* the rollback of the rejected tail (``mlxb.spec.verify.rollback``) on its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlxb.cache.protocol import ROW_OPS, layer_kinds
from mlxb.spec.verify import rollback
from mlxb.models import load_model


def timed(fn) -> float:
    t = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--widths", default="1,2,3,5")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--out")
    a = ap.parse_args()
    model, _, _, _ = load_model(a.model)
    kinds = layer_kinds(model)
    rng = np.random.default_rng(0)
    rows = []
    for B in (int(b) for b in a.batches.split(",")):
        solos = []
        for _ in range(B):
            c = make_prompt_cache(model)
            model(mx.array(rng.integers(5, 8000, size=a.context).tolist())[None], cache=c)
            mx.eval([x.state for x in c])
            solos.append(c)
        merged = B > 1
        caches = [ROW_OPS[k].to_batch([s[i] for s in solos]) for i, k in enumerate(kinds)] if merged else solos[0]
        for L in (int(w) for w in a.widths.split(",")):
            x = mx.array(rng.integers(5, 8000, size=(B, L)).tolist(), dtype=mx.uint32)
            fwd = lambda: model(x, cache=caches)[:, -1, :]  # noqa: E731
            timed(fwd)  # warm this width once
            rollback(caches, kinds, [L] * B, merged)
            grow, fixed, back = [], [], []

            def roll_back():
                rollback(caches, kinds, [L] * B, merged)
                return [c.keys for c in caches if getattr(c, "keys", None) is not None]
            for _ in range(a.reps):  # the same key length every call: forward, then roll its L tokens back
                fixed.append(timed(fwd))
                back.append(timed(roll_back))
            for _ in range(a.reps):  # keys grow by L: a key length never seen before every call
                grow.append(timed(fwd))
            rows.append({"B": B, "L": L, "context": a.context, "forward_new_shape_ms": statistics.median(grow),
                         "forward_ms": statistics.median(fixed), "rollback_ms": statistics.median(back)})
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
