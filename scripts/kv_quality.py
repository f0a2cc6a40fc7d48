"""How far does quantized KV move the model's next-token distribution? Teacher-forced, against full width.

Usage: python scripts/kv_quality.py MODEL [MODEL ...] [--tokens 2048] [--chunk 64] [--group 32] [--out FILE]

One random token sequence per model is fed in ``--chunk``-token steps (as a long prefill or a run of
decode steps would be) through the model with a full-width ``KVCache`` and with mlx-lm's
``QuantizedKVCache`` at 8 and 4 bits (converted from the first chunk, as ``--quantized-kv-start 0``;
sliding-window layers as mlxb's ``QuantizedRotatingKVCache``).
Per position it compares the two next-token distributions: mean and p99 KL(full || quantized) and
top-1 agreement. The synthetic presets have random weights, so the numbers describe the numerics of
the cache, not the quality of a trained model.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlxb.cache.protocol import layer_kinds
from mlxb.cache.kv_plan import KVPlan, KVScheme, fit_plan
from mlxb.cache.quantized import maybe_quantize
from mlxb.models import load_model


def hadamard(d: int, seed: int = 0) -> mx.array:
    """A fixed random orthogonal matrix: normalized Hadamard (Sylvester) times random signs."""
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    assert h.shape[0] == d, "the head dimension must be a power of two"
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=d)
    return mx.array((h * signs[None, :]) / np.sqrt(d), dtype=mx.float32)


class RoundTripCache:
    """A full-width cache whose every new K and V went through quantize -> dequantize, optionally in a
    rotated basis (TurboQuant-style: x H, quantize, dequantize, then H^T). It measures what each scheme
    does to attention inputs at equal bytes (the rotation stores nothing extra); it is not a fast path."""

    def __new__(cls, bits: int, group: int, rotate: bool):
        from mlx_lm.models.cache import KVCache

        class _C(KVCache):
            def update_and_fetch(self, keys, values):
                return super().update_and_fetch(self._rt(keys), self._rt(values))

            def _rt(self, x):
                dt = x.dtype
                x = x.astype(mx.float32)
                if rotate:
                    h = hadamard(x.shape[-1])
                    x = x @ h
                y = mx.dequantize(*mx.quantize(x, group_size=group, bits=bits), group_size=group, bits=bits)
                if rotate:
                    y = y @ h.T
                return y.astype(dt)
        return _C()


def logprobs_roundtrip(model, tokens: list[int], chunk: int, bits: int, group: int, rotate: bool) -> np.ndarray:
    caches = [RoundTripCache(bits, group, rotate) for _ in make_prompt_cache(model)]
    out = []
    for s in range(0, len(tokens), chunk):
        logits = model(mx.array(tokens[s : s + chunk])[None], cache=caches)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        out.append(np.array(lp))
    return np.concatenate(out)


def plan_for(model, bits: int, group: int, sliding: bool = True):
    """Every quantizable layer at ``bits`` (``sliding=False``: sliding-window layers kept full), with
    the engine's own adjustments (Gemma 4's KV-shared sources stay full)."""
    kinds = layer_kinds(model)
    s = KVScheme(bits, group, 0)
    return fit_plan(KVPlan([None if (k == "rotating" and not sliding) else s for k in kinds], 0), model)


def logprobs(model, tokens: list[int], chunk: int, plan, group: int) -> np.ndarray:
    caches, kinds = make_prompt_cache(model), layer_kinds(model)
    out = []
    for s in range(0, len(tokens), chunk):
        logits = model(mx.array(tokens[s : s + chunk])[None], cache=caches)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if plan is not None:  # converted after each step, as mlx-lm's maybe_quantize_kv_cache (rings too)
            caches = maybe_quantize(caches, kinds, plan, s + chunk)
        mx.eval(lp, [c.state for c in caches])
        out.append(np.array(lp))
    return np.concatenate(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--turbo", action="store_true", help="Also compare TurboQuant-style rotation with affine at equal bytes.")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for name in a.models:
        model, tok, _, _ = load_model(name)
        rng = np.random.default_rng(0)
        tokens = rng.integers(5, min(8000, tok.vocab_size if hasattr(tok, "vocab_size") else 8000), size=a.tokens).tolist()
        ref = logprobs(model, tokens, a.chunk, None, a.group)
        arms = [(f"KV{b} (group {a.group})", lambda b=b: logprobs(model, tokens, a.chunk, plan_for(model, b, a.group),
                                                                  a.group)) for b in (8, 4)]
        if "rotating" in layer_kinds(model):
            arms += [(f"KV{b} (group {a.group}), sliding-window layers full",
                      lambda b=b: logprobs(model, tokens, a.chunk, plan_for(model, b, a.group, False), a.group))
                     for b in (8, 4)]
        if a.turbo:  # equal bytes: affine and rotated round trips at the same bits and group
            for b in (4, 3):
                arms.append((f"affine{b} round trip (group {a.group})",
                             lambda b=b: logprobs_roundtrip(model, tokens, a.chunk, b, a.group, False)))
                arms.append((f"turbo{b} round trip (group {a.group})",
                             lambda b=b: logprobs_roundtrip(model, tokens, a.chunk, b, a.group, True)))
        for label, make in arms:
            q = make()
            p = np.exp(ref)
            kl = (p * (ref - q)).sum(-1)
            row = {"model": name, "scheme": label, "tokens": a.tokens,
                   "mean_kl": float(kl.mean()), "p99_kl": float(np.percentile(kl, 99)),
                   "top1_agreement": float((ref.argmax(-1) == q.argmax(-1)).mean())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
