"""`mlxb bench lora` with every failed prefill's traceback printed (CUDA diagnosis)."""
import sys
import traceback

import mlxb.engine.prefill as P
from mlxb.bench.lora import run

_orig = P.prefill_failed


def _pf(eng, failed, e):
    traceback.print_exception(e)
    return _orig(eng, failed, e)


P.prefill_failed = _pf
try:
    print(run(sys.argv[1], adapters=4, rank=16, batches=(8,), gen=16, repeats=1)["rows"])
except Exception:
    traceback.print_exc()
