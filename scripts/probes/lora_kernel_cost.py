"""What one LoRA projection's delta costs on the device, per variant, with host and device both counted: a chain
of N dependent calls (each output is the next call's base output) built, then evaluated once; the build time per
call is host time alone, the total per call is what a decode step pays. Shapes are an 8B Llama's projections,
4 adapters of rank 16 (float32 factors, as mlx_lm.lora saves them), rows cycling through the adapters.
Usage: python scripts/probes/lora_kernel_cost.py [--batches 8,32] [--n 200] [--repeats 5]"""
import argparse
import statistics
import time

import mlx.core as mx

from mlxb.kernels import lora_fused as lf

SHAPES = {"q/o 4096>4096": (4096, 4096), "k/v 4096>1024": (4096, 1024), "gate/up 4096>14336": (4096, 14336),
          "down 14336>4096": (14336, 4096)}


def chain(f, y, n):
    t0 = time.perf_counter()
    z = y
    for _ in range(n):
        z = f(z)
    t1 = time.perf_counter()
    mx.eval(z)
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocks", default="8,32,132", help="TARGET_BLOCKS values for the one-kernel variant")
    args = ap.parse_args()
    n_ad, r, dt = 4, 16, mx.bfloat16
    print(f"{mx.default_device()}; {n_ad} adapters, rank {r}, x/y {dt}; us per call: build (host) / total")
    sums: dict = {}
    for B in [int(b) for b in args.batches.split(",")]:
        for name, (din, dout) in SHAPES.items():
            k = mx.random.split(mx.random.key(din + dout + B), 4)
            x = mx.random.normal((B, 1, din), key=k[0]).astype(dt)
            y = mx.random.normal((B, 1, dout), key=k[1]).astype(dt)
            a = 0.01 * mx.random.normal((n_ad, din, r), key=k[2])
            b = 0.01 * mx.random.normal((n_ad, r, dout), key=k[3])
            a16, b16 = a.astype(dt), b.astype(dt)
            slots = mx.array([i % n_ad for i in range(B)], dtype=mx.int32)
            sc32, sc16 = mx.array([20.0] * n_ad), mx.array([20.0] * n_ad).astype(dt)
            a_cat = a.transpose(1, 0, 2).reshape(din, n_ad * r).astype(dt)
            b_cat = b.reshape(n_ad * r, dout).astype(dt)
            mask = mx.zeros((B, 1, n_ad * r), dtype=dt)
            h = mx.random.normal((B, 1, r)).astype(dt)
            w = (0.01 * mx.random.normal((dout, din))).astype(dt)
            mx.eval(x, y, a, b, a16, b16, slots, sc32, sc16, a_cat, b_cat, mask, h, w)
            arms = {
                "addmm (1 builtin op)": (None, lambda z: mx.addmm(z, h, b16[0])),
                "stacked (3 ops)": (None, lambda z: mx.addmm(z, (x @ a_cat) * mask, b_cat)),
                "fused split pair": (132, lambda z: lf.fused_delta(x, z, a, b, slots, sc32, "split")),
            }
            for nb in [int(v) for v in args.blocks.split(",")]:
                arms[f"fused one, {nb} blocks"] = (nb, lambda z: lf.fused_delta(x, z, a, b, slots, sc32, "one"))
            for arm, (nb, f) in arms.items():
                if nb is not None:
                    lf.TARGET_BLOCKS = nb
                chain(f, y, 10)  # compile and warm
                res = [chain(f, y, args.n) for _ in range(args.repeats)]
                bt = statistics.median(t[0] for t in res)
                tt = statistics.median(t[1] for t in res)
                sums[arm] = sums.get(arm, 0.0) + tt
                print(f"B={B:3d} {name:20s} {arm:26s} build {bt:6.1f}  total {tt:6.1f}", flush=True)
    fused = {k: v for k, v in sums.items() if k.startswith("fused")}
    best = min(fused, key=fused.get)
    print("sum over shapes and batches, us:", {k: round(v, 1) for k, v in sums.items()})
    print("BEST", "split 132" if "split" in best else "one " + best.split(", ")[1].split()[0])


if __name__ == "__main__":
    main()
