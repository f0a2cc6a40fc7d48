"""Where a tensor-parallel decode step goes (run on every rank under mlx.launch): which GPU each rank
uses, one all_sum timed alone and inside one graph of 64, and mlx-lm's own sharded stream_generate
(B=1) so the cost of MLX's collective path is told apart from mlxb's.

    mlx.launch --backend nccl -n 2 -- python3 scripts/tp_diag.py MODEL_DIR [--gen 128]
"""

import argparse
import json
import subprocess
import time

import mlx.core as mx

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--gen", type=int, default=128)
ap.add_argument("--out")
ap.add_argument("--collectives-only", action="store_true", help="time the all_sums only (no model)")
a = ap.parse_args()
g = mx.distributed.init()
rank = g.rank()
res = {"rank": rank, "size": g.size(), "device": str(mx.default_device())}
x = mx.ones((1, 1, 4096), dtype=mx.bfloat16)
for _ in range(5):
    mx.eval(mx.distributed.all_sum(x, group=g))
t0 = time.perf_counter()
for _ in range(100):
    mx.eval(mx.distributed.all_sum(x, group=g))
res["one_all_sum_eval_ms"] = (time.perf_counter() - t0) * 10
for n in (1, 64):
    t0 = time.perf_counter()
    for _ in range(10):
        y = x
        for _ in range(n):
            y = mx.distributed.all_sum(y, group=g) * 0.5
        mx.eval(y)
    res[f"chain{n}_ms"] = (time.perf_counter() - t0) * 100
if a.collectives_only:
    if rank == 0:
        print(json.dumps(res))
    raise SystemExit(0)
from mlx_lm import stream_generate  # noqa: E402
from mlx_lm.utils import load  # noqa: E402

model, tok = load(a.model, lazy=True)
model.shard(g)
mx.eval(model.parameters())
res["gpus"] = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.split("\n")[:2]
prompt = list(range(10, 138))
for rep in range(3):
    last = None
    for r in stream_generate(model, tok, prompt, max_tokens=a.gen):
        last = r
    res[f"mlx_lm_sharded_b1_tps_{rep}"] = last.generation_tps
if rank == 0:
    print(json.dumps(res, indent=1))
    if a.out:
        open(a.out, "w").write(json.dumps(res, indent=1))
