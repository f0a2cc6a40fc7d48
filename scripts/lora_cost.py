"""What per-row LoRA costs one decode forward ([B, 1] tokens, a KV cache of --context tokens), by variant,
and what one LoRA projection's ops cost alone. Usage: python scripts/lora_cost.py MODEL [B] [rank]."""
import statistics
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlxb.adapters.lora import install, read_adapter
from mlxb.models.adapters import ensure_adapters
from mlxb.models.registry import load_model


def timed(f, n=30):
    for _ in range(3):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts)


def main():
    src = sys.argv[1]
    B = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    rank = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    folders = ensure_adapters(src, None, f"bench:{src}", [{"seed": 100 + i, "rank": rank, "num_layers": -1} for i in range(4)])
    model, tok, *_ = load_model(src)
    ctx = install(model, [read_adapter(f"a{i}", f) for i, f in enumerate(folders)])
    V = int(model.args.vocab_size)
    cache = make_prompt_cache(model)
    ps = mx.array(np.random.default_rng(0).integers(3, V - 1, size=(B, 128)), dtype=mx.uint32)
    ctx.set([-1] * B)
    mx.eval(model(ps, cache=cache))
    x = mx.array(np.random.default_rng(1).integers(3, V - 1, size=(B, 1)), dtype=mx.uint32)

    def fwd():
        mx.eval(model(x, cache=cache))
        for c in cache:
            c.trim(1)

    print(f"LoRA path {ctx.path}, concat kernel {ctx.cat_kernel} ({ctx.cat_kernel_off})", flush=True)
    arms = {"base": [-1] * B, "one": [0] * B, "mixed": [i % 4 for i in range(B)], "half": [0 if i % 2 else -1 for i in range(B)]}
    for name, slots in arms.items():
        ctx.set(slots)
        print(f"forward {name:6s} B={B}: {timed(fwd):.3f} ms", flush=True)
    # one projection alone (the MLP up projection's shape); the concat path has no per-projection layer
    m = next(mod for n, mod in model.named_modules() if n.endswith("mlp.up_proj"))
    if not hasattr(m, "lora_a"):
        print(f"LoRA path: {ctx.path}; {mx.default_device()} (no per-projection ops to time)")
        return
    a, b = m.lora_a, m.lora_b
    xin = mx.random.normal((B, 1, a.shape[1])).astype(mx.bfloat16)
    ids = mx.array([i % 4 for i in range(B)], dtype=mx.uint32)
    a0, b0 = m._each[0]
    a16, b16 = a0.astype(mx.bfloat16), b0.astype(mx.bfloat16)
    A16, B16 = a.astype(mx.bfloat16), b.astype(mx.bfloat16)
    mx.eval(a16, b16, A16, B16)
    ops = {
        "base linear": lambda: m.base(xin),
        "x@a@b fp32 factors": lambda: (xin @ a0) @ b0,
        "x@a@b bf16 factors": lambda: (xin @ a16) @ b16,
        "gather_mm fp32": lambda: mx.gather_mm(mx.gather_mm(xin, a, rhs_indices=ids), b, rhs_indices=ids),
        "gather_mm bf16": lambda: mx.gather_mm(mx.gather_mm(xin, A16, rhs_indices=ids), B16, rhs_indices=ids),
        "take+matmul fp32": lambda: (xin @ mx.take(a, ids, axis=0)) @ mx.take(b, ids, axis=0),
        "take+matmul bf16": lambda: (xin @ mx.take(A16, ids, axis=0)) @ mx.take(B16, ids, axis=0),
    }
    if getattr(m, "_stacked", False):  # the stacked path: every adapter's shrink at once, a row mask, addmm
        ctx.set([i % 4 for i in range(B)])
        y0, M = m.base(xin), ctx.mask(m._dt)
        mx.eval(y0, M)
        ops["stacked mixed (3 ops)"] = lambda: mx.addmm(y0, (xin @ m._a_cat) * M, m._b_cat)
        ops["stacked one (2 ops)"] = lambda: mx.addmm(y0, xin @ m._one[0][0], m._one[0][1])
    if getattr(m, "_fused", False):  # the fused kernel: the whole delta and the add in one launch
        from mlxb.kernels import lora_fused

        ctx.set([i % 4 for i in range(B)])
        y0, sl, sc = m.base(xin), ctx.row_slots(xin), m._fused_scales(xin)
        mx.eval(y0, sl, sc)
        ops["fused mixed (1 op)"] = lambda: lora_fused.fused_delta(xin, y0, a, b, sl, sc)
    for k, f in ops.items():
        try:
            print(f"op {k:22s}: {timed(lambda: mx.eval(f()), 100) * 1000:.1f} us", flush=True)
        except Exception as e:  # e.g. the CPU's gather_mm is float32-only
            print(f"op {k:22s}: failed: {e}", flush=True)
    n_lora = sum(1 for _, mod in model.named_modules() if type(mod).__name__ == "MultiLoRALinear")
    print(f"LoRA projections: {n_lora}; dtype of factors {a.dtype}, base {xin.dtype}, {mx.default_device()}; "
          f"path: {ctx.path}")


if __name__ == "__main__":
    main()
