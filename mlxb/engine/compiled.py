"""``--compile-decode``: the lone row's decode step as one ``mx.compile`` graph (issue 19).

A lone row (adopted into an empty batch, so its caches are mlx-lm's own ``KVCache``) pays the host
for building its step's graph op by op every token; on a small model that is most of the step. Here
the whole forward is traced once and replayed:

* The step's inputs are the token, the row's offset **as an array** and every layer's key and
  value buffer; its outputs are the logits and the updated buffers. The shapes only change when
  the buffers grow (by ``GROW`` tokens), so one trace serves ``GROW`` steps.
* Inside the trace each layer sees a :class:`BufferKV`: the new key and value are written with
  ``mx.slice_update`` at the offset, attention reads the whole buffer with the boolean mask
  ``arange(capacity) <= offset``, and RoPE takes the offset array.
* Outside it the row keeps ordinary ``KVCache`` objects (buffer, integer offset), so joins,
  extraction into the prompt cache, speculation's verify and trim, and KV conversion see nothing
  new: a second row joining simply ends the compiled steps.

On this CPU (float32 and bfloat16) the masked whole-buffer read is bit-equal to mlx-lm's sliced one
(tested). Where MLX's masked attention takes another kernel the logits can differ: on CUDA (H200,
``reports/h200/session32``) the boolean mask sends decode attention to the unfused fallback, which
changed tokens and was slower on an 8B shape, so CUDA is refused. Elsewhere :func:`self_check`
compares compiled and plain steps bit for bit on the served model before the flag takes effect.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

GROW = 256  # buffer growth in tokens: a new trace every GROW steps; mask reads at most GROW - 1 spare keys


class BufferKV:
    """A ``KVCache`` stand-in inside the trace: fixed-capacity buffers, offset as an array."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, late: bool = False):
        self.keys, self.values, self.offset = keys, values, offset
        self._late = late  # planted fault (parity negative control): the mask hides the row's newest key

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys = mx.slice_update(self.keys, keys, self.offset[None], axes=(2,))
        self.values = mx.slice_update(self.values, values, self.offset[None], axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None):
        if n != 1 or window_size is not None:
            raise ValueError("the compiled step runs one token through full-attention layers only")
        pos = mx.arange(self.keys.shape[2])
        return pos < self.offset if self._late else pos <= self.offset


def why_not(model, kinds: list, *, lora=None, tp: bool = False) -> Optional[str]:
    """Why ``--compile-decode`` cannot serve this model here, or None."""
    if tp:
        return "--compile-decode is one process only; leave it off with --tp"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return ("--compile-decode is refused on CUDA: its masked whole-buffer attention falls back to MLX's unfused "
                "path there, which changed tokens and was slower on an 8B shape (reports/h200/session32)")
    if lora is not None:
        return "--compile-decode does not compose with --adapters (the adapter slot would be frozen into the trace)"
    if any(k != "full" for k in kinds) or not all(type(c) is KVCache for c in make_prompt_cache(model)):
        return "--compile-decode needs a model whose every layer is full attention on mlx-lm's KVCache"
    return None


class CompiledDecode:
    """One compiled [1, 1] step for a lone row on ``KVCache`` layers; counts its steps and traces."""

    def __init__(self, model, fault: bool = False):
        self.model, self.fault = model, fault
        self.steps = 0
        self.shapes: set = set()  # buffer capacities traced so far
        self._fn = mx.compile(self._step)

    def _step(self, tok: mx.array, off: mx.array, *kv: mx.array):
        caches = [BufferKV(kv[i], kv[i + 1], off, self.fault) for i in range(0, len(kv), 2)]
        logits = self.model(tok[:, None], cache=caches)[:, -1, :]
        return (logits, *[a for c in caches for a in (c.keys, c.values)])

    @staticmethod
    def serves(caches: list) -> bool:
        return bool(caches) and all(type(c) is KVCache and c.keys is not None for c in caches)

    def __call__(self, tokens: mx.array, caches: list) -> mx.array:
        """Logits [1, V] of one step on ``caches`` (one row of ``KVCache``), which it advances."""
        off = caches[0].offset
        cap = caches[0].keys.shape[2]
        if off >= cap:  # grow every buffer to the next multiple of GROW (mlx-lm's KVCache steps by 256 too)
            new = -(-(off + 1) // GROW) * GROW
            for c in caches:
                c.keys, c.values = (mx.concatenate([a[..., :off, :], mx.zeros(a.shape[:2] + (new - off, a.shape[3]), a.dtype)],
                                                   axis=2) for a in (c.keys, c.values))
            cap = new
        self.shapes.add(cap)
        out = self._fn(tokens, mx.array(off, dtype=mx.int32), *[a for c in caches for a in (c.keys, c.values)])
        for i, c in enumerate(caches):
            c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
            c.offset = off + 1
        self.steps += 1
        return out[0]

    def stats(self) -> dict:
        return {"steps": self.steps, "traced_capacities": len(self.shapes)}


def self_check(model, steps: int = 12, prompt_len: int = 24) -> Optional[str]:
    """Run ``steps`` greedy steps of one prompt plainly and compiled; None if every logit vector is
    bit-equal, else what differed (the flag is then refused)."""
    prompt = mx.array([(7 * i + 3) % 200 + 1 for i in range(prompt_len)], dtype=mx.uint32)
    runs = []
    for compiled in (False, True):
        step = CompiledDecode(model) if compiled else None
        cache = make_prompt_cache(model)
        model(prompt[None, :-1], cache=cache)
        tok, out = prompt[-1:], []
        for _ in range(steps):
            logits = step(tok, cache) if step else model(tok[None], cache=cache)[:, -1, :]
            tok = mx.argmax(logits, axis=-1).astype(mx.uint32)
            mx.eval(logits, tok)
            out.append(logits)
        runs.append(out)
    for i, (a, b) in enumerate(zip(*runs)):
        if not mx.array_equal(a, b).item():
            d = float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())
            return f"the compiled decode step differs from the plain one at step {i} (max |logit difference| {d:.3g})"
    return None
