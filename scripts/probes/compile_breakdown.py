"""Host time per decode step of a lone row, plain against --compile-decode (issue 19's breakdown).

Runs one warm request, then a timed one, on an Engine with and without compile_decode="lone",
3 rounds interleaved, and prints the medians of the runner's own timings: graph build, async_eval
launch, wait for the previous token, and wall time per token.

    python scripts/probes/compile_breakdown.py MODEL GEN
"""
import statistics as S
import sys
import time
from mlxb.models import load_model
from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.request import Request
name = sys.argv[1]; gen = int(sys.argv[2])
m, tok, _, _ = load_model(name)
res = {}
for rep in range(3):
    for scope in (False, "lone"):
        eng = Engine(m, tok, max_batch=8, compile_decode=scope).start()
        try:
            r = Request("r", list(range(100, 164)), gen, ignore_eos=True); r.mechanism = "continuous"
            st = OutputStream("r"); eng.submit(r, st); list(st)
            r = Request("r2", list(range(200, 264)), gen, ignore_eos=True); r.mechanism = "continuous"
            for k in list(eng.runner.timing): eng.runner.timing[k] = 0.0
            st = OutputStream("r2"); eng.submit(r, st); t0 = time.perf_counter(); list(st); wall = time.perf_counter() - t0
            t = dict(eng.runner.timing); n = t["steps"]
            res.setdefault(scope, []).append((1e3 * t["build_s"] / n, 1e3 * t["launch_s"] / n, 1e3 * t.get("wait_s", 0) / n, 1e3 * wall / gen))
        finally:
            eng.shutdown()
for scope, v in res.items():
    print(f"{name} {'compiled' if scope else 'plain':8s} build {S.median(x[0] for x in v):.3f} ms  launch {S.median(x[1] for x in v):.3f} ms  wait {S.median(x[2] for x in v):.3f} ms  per token {S.median(x[3] for x in v):.3f} ms")
