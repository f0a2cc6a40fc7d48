"""The skinny matmul (mlxb/kernels/skinny.py) against MLX's own matmul on the CUDA device, per projection shape
and row count: microseconds per product (weights cycled over more than L2 holds, so each product reads its
weight from HBM), host microseconds to build the graph of one call, and whether every row equals the one-row
gemv (``x[m:m+1] @ W.T``) bit for bit. Writes JSON to --out.

    python3 scripts/skinny_cost.py --out skinny.json [--rows 1,2,4,5,8,16] [--repeats 3] [--unroll 1,4]

``--unroll``: the kernel's steps per trip (loads issued together; the sums do not change). At one row the
reference is MLX's own product, which is its gemv, so ``rows_equal_gemv`` checks the kernel against it.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from mlxb.kernels import skinny

SHAPES = {"8b-qo": (4096, 4096), "8b-kv": (1024, 4096), "8b-gateup": (14336, 4096), "8b-down": (4096, 14336),
          "1b-qo": (2048, 2048), "1b-gateup": (8192, 2048)}


def timed(fn, n_calls: int, repeats: int) -> tuple[float, float]:
    """(median device+host µs per call, median host µs to build one call's graph)."""
    per, build = [], []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [fn(i) for i in range(n_calls)]
        t1 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        t2 = time.perf_counter()
        per.append((t2 - t0) / n_calls * 1e6)
        build.append((t1 - t0) / n_calls * 1e6)
    per.sort(), build.sort()
    return per[len(per) // 2], build[len(build) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,2,4,5,8,16,32,40")
    ap.add_argument("--rw", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--unroll", default="1")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reductions", default=",".join(skinny.REDUCTIONS))
    a = ap.parse_args()
    unrolls = [int(u) for u in a.unroll.split(",")]
    rows_list = [int(r) for r in a.rows.split(",")]
    rws = [int(r) for r in a.rw.split(",")]
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "results": []}
    reductions = []
    for red in a.reductions.split(","):
        try:
            print(f"self_check {red}:", skinny.self_check(red), flush=True)
            reductions.append(red)
        except ValueError as e:
            print(f"self_check {red} failed: {e}", flush=True)
    out["reductions"] = reductions
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(2, int(200e6 // (n * k * 2)) + 1)  # > L2 (50 MB) in all
        ws = [(mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16) for _ in range(copies)]
        mx.eval(ws)
        for rows in rows_list:
            x = mx.random.normal((rows, k)).astype(mx.bfloat16)
            mx.eval(x)
            for _ in range(2):  # warm both paths (JIT)
                mx.eval(x @ ws[0].T)
            rec = {"shape": name, "n": n, "k": k, "rows": rows}
            rec["mlx_us"], rec["mlx_build_us"] = timed(lambda i: x @ ws[i % copies].T, a.calls, a.repeats)
            want = mx.concatenate([x[m:m + 1] @ ws[0].T for m in range(rows)])
            for red in reductions:
                for rw in rws:
                    for u in unrolls:
                        tag = f"{red}_rw{rw}" + (f"_u{u}" if u != 1 else "")
                        mx.eval(skinny.skinny_matmul(x, ws[0], red, rw, u))
                        rec[tag + "_us"], rec[tag + "_build_us"] = timed(
                            lambda i: skinny.skinny_matmul(x, ws[i % copies], red, rw, u), a.calls, a.repeats)
                        got = skinny.skinny_matmul(x, ws[0], red, rw, u)
                        rec[tag + "_rows_equal_gemv"] = int(mx.all(got == want, axis=1).sum().item())
                        rec[tag + "_max_diff"] = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
                        rec[tag + "_gbps"] = n * k * 2 / (rec[tag + "_us"] * 1e-6) / 1e9
            gbps = n * k * 2 / (rec["mlx_us"] * 1e-6) / 1e9
            rec["mlx_gbps"] = gbps
            out["results"].append(rec)
            print(json.dumps(rec), flush=True)
        del ws
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
