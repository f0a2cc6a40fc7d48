"""Prompt logprobs (``echo`` with ``logprobs`` on ``/v1/completions``): what the model gives each prompt
token after the ones before it, as evaluation harnesses ask for when they score text
(lm-evaluation-harness's loglikelihood tasks send ``echo: true, logprobs: K, max_tokens: 0``).

It runs on the engine thread between iterations, under the device lock, on a fresh full-width cache in
chunks; the request's own generation (if any) then runs as usual. Chunking keeps the logits of one
chunk ([chunk, vocab], float32) in memory at a time, so a chunk's logprobs can differ from a single
whole-prompt forward in the last bits.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

CHUNK = 512


def prompt_logprobs(model, ids: list[int], top: int = 0, chunk: int = CHUNK) -> list[tuple[float, list[tuple[int, float]]]]:
    """For every prompt token after the first: its logprob and the ``top`` most likely tokens there
    (token id, logprob), best first."""
    cache = make_prompt_cache(model)
    out: list[tuple[float, list[tuple[int, float]]]] = []
    inputs = ids[:-1]  # the last prompt token predicts nothing in the prompt
    for s in range(0, len(inputs), chunk):
        piece = inputs[s:s + chunk]
        targets = mx.array(ids[s + 1:s + 1 + len(piece)], dtype=mx.int32)
        logits = model(mx.array(piece, dtype=mx.uint32)[None], cache=cache)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
        if top > 0:
            k = min(top, lp.shape[-1])
            idx = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
            vals = mx.take_along_axis(lp, idx, axis=-1)
            mx.eval(picked, idx, vals)
            idx_l, vals_l = idx.tolist(), vals.tolist()
            tops = [sorted(zip(i, v), key=lambda p: -p[1]) for i, v in zip(idx_l, vals_l)]
        else:
            mx.eval(picked)
            tops = [[] for _ in piece]
        out += list(zip(picked.tolist(), tops))
        mx.eval([c.state for c in cache])
    return out
