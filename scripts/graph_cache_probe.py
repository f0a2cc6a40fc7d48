"""Does MLX's CUDA graph cache end a long-lived process (its "Cache thrashing" fuse), and does mlxb's setting stop it?

MLX's CUDA backend records kernels into CUDA graphs and keeps the executable graphs in an LRU cache keyed by the
graph's topology (``MLX_CUDA_GRAPH_CACHE_SIZE`` entries). Some MLX versions count every miss over the process's
life and throw "Cache thrashing is happening ..." from the next one once the count passes twice the capacity, on
whatever thread evaluates, leaving that stream's encoder unusable. A server that mixes batch sizes, verify widths
and prompt lengths for hours makes new topologies all the time.

Each setting runs in a child process on a small cache (capacity 8, so the fuse, if any, is 16 misses away): it
evaluates chains of distinct lengths with up to 250 kernels per graph (so every length is a new topology), reports
the first iteration that threw and whether a fresh op on the same stream still evaluates afterwards.

    python3 scripts/graph_cache_probe.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def child(n: int) -> dict:
    import mlx.core as mx

    out = {"device": str(mx.default_device()), "threw_at": None, "error": None, "after": None}
    for i in range(1, n + 1):
        try:
            x = mx.ones((8, 8))
            for _ in range(i):
                x = x * 1.0001 + 0.5
            mx.eval(x)
        except Exception as e:  # noqa: BLE001 - we report whatever MLX raises
            out["threw_at"], out["error"] = i, str(e)[:300]
            break
    try:
        y = mx.arange(16).sum()
        mx.eval(y)
        out["after"] = f"ok ({y.item()})"
    except Exception as e:  # noqa: BLE001
        out["after"] = f"failed: {str(e)[:200]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return
    import mlx.core as mx

    base = {"MLX_CUDA_GRAPH_CACHE_SIZE": "8", "MLX_MAX_OPS_PER_BUFFER": "250"}
    settings = {
        "MLX defaults (fuse on)": {},
        "MLX_ENABLE_CACHE_THRASHING_CHECK=0": {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0"},
        "mlxb.engine.build.cuda_graph_env()": {"MLXB_PROBE_APPLY": "1"},
    }
    rows = {"mlx": mx.__version__, "cuda": bool(hasattr(mx, "cuda") and mx.cuda.is_available()), "settings": {}}
    for name, extra in settings.items():
        env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_CACHE_THRASHING_CHECK"}
        env.update(base, **extra)
        code = ("import os,sys,json\n"
                "if os.environ.get('MLXB_PROBE_APPLY'):\n"
                "    from mlxb.engine.build import cuda_graph_env; print('applied:', cuda_graph_env(), file=sys.stderr)\n"
                "sys.argv=['x','--child','60']\n"
                "exec(open(%r).read())" % os.path.abspath(__file__))
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        last = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        rows["settings"][name] = (json.loads(last[-1]) if last else
                                  {"rc": p.returncode, "stderr": p.stderr[-600:]})
        rows["settings"][name]["stderr_tail"] = p.stderr[-300:]
        print(name, json.dumps(rows["settings"][name]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
