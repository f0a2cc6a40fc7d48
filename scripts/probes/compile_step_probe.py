"""Issue 19 probe: the whole B=1 decode step under ``mx.compile`` (cache write included).

The lone row's KV lives in fixed-capacity buffers with a device-side offset, so every step has
the same shapes and one trace serves until the capacity grows (by ``--grow`` tokens):

* the new key/value is written with ``mx.slice_update`` at the offset (an array, not a constant);
* attention reads the whole buffer with a boolean mask ``arange(capacity) <= offset``;
* RoPE takes the offset array.

Arms, interleaved per repeat, each pipelined like mlx-lm's ``generate_step`` (step t+1 launched
before step t's token is read):

* ``plain``: mlx-lm's ``KVCache`` (sliced read, no mask), the model called per step;
* ``compiled``: the step above under ``mx.compile``;
* ``masked``: the same step without ``mx.compile`` (what the mask alone costs);
* ``exact`` (``--exact``): a ``shapeless`` compiled step whose KV grows by concatenation, so
  attention reads exactly the row's keys, unmasked, through the kernel mlx-lm's step takes (one
  trace for every length; the cost is a copy of the row's KV per step). Needs RoPE as a primitive,
  so it traces on GPU backends only (on the CPU MLX builds RoPE from slices).

Prints ms per token (median over repeats, min-max) and whether greedy tokens and logprob vectors
equal the plain arm's.

    python scripts/probes/compile_step_probe.py MODEL [--gen 128] [--repeats 3] [--prompt-len 128] [--grow 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxb.models import load_model


class BufferKV:
    def __init__(self, keys, values, offset):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, k, v):
        self.keys = mx.slice_update(self.keys, k, self.offset[None], axes=(2,))
        self.values = mx.slice_update(self.values, v, self.offset[None], axes=(2,))
        return self.keys, self.values

    def make_mask(self, n, return_array=False, window_size=None):
        return mx.arange(self.keys.shape[2]) <= self.offset


class CatKV:
    def __init__(self, keys, values, offset):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, k, v):
        self.keys = mx.concatenate([self.keys, k], axis=2)
        self.values = mx.concatenate([self.values, v], axis=2)
        return self.keys, self.values

    def make_mask(self, n, return_array=False, window_size=None):
        return None


def step_fn(model, n_layers, kv_class=BufferKV):
    """One traced step over ``kv_class`` stand-ins; outputs keep the [1, 1] axes (a slice would not
    trace shapeless), the runner drops them."""
    def step(tok, off, *kv):
        caches = [kv_class(kv[2 * i], kv[2 * i + 1], off) for i in range(n_layers)]
        logits = model(tok[None], cache=caches)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out = [lp, mx.argmax(lp, axis=-1).astype(mx.uint32)]
        for c in caches:
            out += [c.keys, c.values]
        return tuple(out)
    return step


def prefill(model, prompt):
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([(c.keys, c.values) for c in cache])
    return cache


def run_plain(model, prompt, gen):
    cache = prefill(model, prompt)

    def one(t):
        logits = model(t[None], cache=cache)[:, -1, :]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(lp, axis=-1).astype(mx.uint32), lp

    y, lp = one(mx.array(prompt[-1:], dtype=mx.uint32))
    mx.async_eval(y, lp)
    toks, lps, times = [], [], []
    for _ in range(gen):
        t = time.perf_counter()
        ny, nlp = one(y)
        mx.async_eval(ny, nlp)
        toks.append(y.item())
        times.append(time.perf_counter() - t)
        lps.append(lp)
        y, lp = ny, nlp
    return toks, lps, times


def grow(kv, cap):
    out = []
    for a in kv:
        pad = cap - a.shape[2]
        out.append(mx.concatenate([a, mx.zeros(a.shape[:2] + (pad, a.shape[3]), a.dtype)], axis=2) if pad > 0 else a)
    return out


def run_buffer(model, prompt, gen, fn, step):
    """The traced step pipelined over ``gen`` tokens; ``step``: buffer growth in tokens, or None (the
    exact arm's KV grows by itself)."""
    cache = prefill(model, prompt)
    off = cache[0].offset
    kv = []
    for c in cache:
        kv += [c.keys[..., :off, :], c.values[..., :off, :]]
    cap = None
    if step is not None:
        cap = -(-(off + 1) // step) * step
        kv = grow(kv, cap)
    out = fn(mx.array(prompt[-1:], dtype=mx.uint32), mx.array(off, dtype=mx.int32), *kv)
    mx.async_eval(out[:2])
    off += 1
    lp, y, kv = out[0][:, -1, :], out[1][:, -1], list(out[2:])
    toks, lps, times = [], [], []
    for _ in range(gen):
        t = time.perf_counter()
        if cap is not None and off >= cap:
            cap += step
            kv = grow(kv, cap)
        out = fn(y, mx.array(off, dtype=mx.int32), *kv)
        off += 1
        mx.async_eval(out[:2])
        toks.append(y.item())
        times.append(time.perf_counter() - t)
        lps.append(lp)
        lp, y, kv = out[0][:, -1, :], out[1][:, -1], list(out[2:])
    return toks, lps, times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--grow", type=int, default=256)
    ap.add_argument("--exact", action="store_true", help="add the shapeless exact-length arm")
    ap.add_argument("--only", default="", help="comma list of arms to run (plain always runs)")
    a = ap.parse_args()
    model, _, _, _ = load_model(a.model)
    n = len(make_prompt_cache(model))
    prompt = [100 + (i * 7) % 1000 for i in range(a.prompt_len)]
    raw = step_fn(model, n)
    comp = mx.compile(raw)
    arms = {"plain": lambda: run_plain(model, prompt, a.gen),
            "compiled": lambda: run_buffer(model, prompt, a.gen, comp, a.grow),
            "masked": lambda: run_buffer(model, prompt, a.gen, raw, a.grow)}
    if a.exact:
        ex = mx.compile(step_fn(model, n, CatKV), shapeless=True)
        arms["exact"] = lambda: run_buffer(model, prompt, a.gen, ex, None)
    if a.only:
        keep = {"plain", *a.only.split(",")}
        arms = {k: f for k, f in arms.items() if k in keep}
    for f in arms.values():  # warm-up: kernels and the first trace
        f()
    res = {k: [] for k in arms}
    same = {k: True for k in arms}
    dlp = {k: 0.0 for k in arms}
    for r in range(a.repeats):
        ref = None
        for k, f in arms.items():
            toks, lps, times = f()
            mid = sorted(times)[len(times) // 4: 3 * len(times) // 4]
            res[k].append(1e3 * statistics.median(times))
            if ref is None:
                ref = (toks, lps)
            else:
                same[k] &= toks == ref[0]
                dlp[k] = max(dlp[k], max(float(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max())
                                          for x, y in zip(lps, ref[1])))
    print(f"{a.model}: device {mx.default_device()}, prompt {a.prompt_len}, gen {a.gen}, grow {a.grow}")
    base = statistics.median(res["plain"])
    for k, v in res.items():
        m = statistics.median(v)
        print(f"  {k:9s} {m:7.3f} ms/token ({min(v):.3f}-{max(v):.3f})  plain/this {base / m:.3f}"
              f"  tokens equal {same[k]}  max|dlogprob| {dlp[k]:.3g}")


if __name__ == "__main__":
    main()
