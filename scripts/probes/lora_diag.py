import sys, traceback, time
import numpy as np
from mlxb.engine.engine import Engine
from mlxb.adapters.lora import install, read_adapter
from mlxb.models.adapters import ensure_adapters
from mlxb.models.registry import load_model
from mlxb.bench.kv import _decode_tps
import mlxb.engine.prefill as P
_orig = P.prefill_failed
def _pf(eng, failed, e):
    traceback.print_exception(e)
    return _orig(eng, failed, e)
P.prefill_failed = _pf
src = sys.argv[1]
folders = ensure_adapters(src, None, f"bench:{src}", [{"seed": 100 + i, "rank": 16, "num_layers": -1} for i in range(4)])
model, tok, *_ = load_model(src)
install(model, [read_adapter(f"a{i}", f) for i, f in enumerate(folders)])
rng = np.random.default_rng(0)
ps = [rng.integers(3, 8000, size=256).tolist() for _ in range(8)]
for started in (False, True):
    e = Engine(model, tok, max_batch=8, prefill_chunk=2048)
    if started:
        e.start()
    for slots in ([-1] * 8, [i % 4 for i in range(8)]):
        try:
            if started:
                print("started", slots[:3], _decode_tps(e, ps, 8, 2048, slots), flush=True)
            else:
                from mlxb.engine.stream import OutputStream
                from mlxb.request import Request
                sts = []
                for i, p in enumerate(ps):
                    r = Request(f"x{time.perf_counter_ns()}-{i}", p, 8, ignore_eos=True, adapter=slots[i]); st = OutputStream(r.request_id)
                    e.accept(r, st); sts.append(st)
                for _ in range(40):
                    e.iterate()
                errs = [o.error for st in sts for o in st._q.queue if getattr(o, "error", None)] if hasattr(sts[0], "_q") else "?"
                print("driven", slots[:3], "ok", errs, flush=True)
        except Exception:
            traceback.print_exc()
    if started:
        e.shutdown()
