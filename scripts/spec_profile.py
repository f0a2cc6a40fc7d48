"""Where a speculating engine's iterations go (cProfile over Engine.iterate), against plain decoding.

    python scripts/spec_profile.py MODEL_DIR --batch 8 --context 512 --gen 96 [--arms plain,adaptive,fixed] [--quiet]

Arms: ``plain`` (no speculation), ``adaptive`` (the served default: K adapts, pauses on low acceptance),
``fixed`` (``--spec-fixed``: K drafts every step). Each arm runs twice, interleaved.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from mlxb.bench.spec import prompts_for
from mlxb.engine.engine import Engine
from mlxb.spec.verify import SpecConfig
from mlxb.engine.stream import OutputStream
from mlxb.models import load_model
from mlxb.request import Request


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--regime", default="repetitive")
    ap.add_argument("--arms", default="plain,adaptive")
    ap.add_argument("--quiet", action="store_true", help="no cProfile listing")
    a = ap.parse_args()
    arms = {"plain": None, "adaptive": SpecConfig(max_batch=64), "fixed": SpecConfig(max_batch=64, adaptive=False)}
    m, tok, _, _ = load_model(a.model)
    ps = prompts_for(a.regime, a.batch, a.context, 8000)
    for name in a.arms.split(",") * 2:
        spec = arms[name]
        eng = Engine(m, tok, max_batch=max(2, a.batch), prefill_chunk=4096, spec=spec)
        reqs = [Request(f"r{i}", p, a.gen, ignore_eos=True) for i, p in enumerate(ps)]
        for r in reqs:
            eng.accept(r, OutputStream(r.request_id))
        while any(r.num_generated == 0 for r in reqs):
            eng.iterate()
        pr = cProfile.Profile()
        t, n0, it = time.perf_counter(), sum(r.num_generated for r in reqs), 0
        pr.enable()
        while eng._live:
            eng.iterate()
            it += 1
        pr.disable()
        dt = time.perf_counter() - t
        n = sum(r.num_generated for r in reqs) - n0
        print(f"{name}: {n / dt:.0f} tok/s, {it} iterations, {dt / it * 1e3:.1f} ms each",
              eng.spec_stats() and {k: eng.spec_stats()[k] for k in ("verify_steps", "drafted", "accepted")})
        tm = eng.runner.timing
        print({k: round(v * 1e3 / max(1, tm["steps"] if "verify" not in k else eng.runner.spec_counts["verify_steps"]), 2)
               for k, v in tm.items() if k.endswith("_s")}, "plain steps", tm["steps"])
        if spec is not None and not a.quiet:
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
