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
* ``--compile-batch`` also compiles the batch lane's steps (:class:`BatchBufferKV`, one trace per row
  count and capacity): every row writes at the shared buffer index, RoPE takes each row's offset,
  and the mask hides each row's left padding. It measured slower than the plain step on a 2-core CPU
  at B=8 and 32 (the masked read over spare keys costs more than the host time it saves), hence its
  own flag.

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

from mlxb.cache.protocol import AlignedBatchKVCache

GROW = 256  # buffer growth in tokens: a new trace every GROW steps; mask reads at most GROW - 1 spare keys


class BufferKV:
    """A ``KVCache`` stand-in inside the trace: fixed-capacity buffers, the write position (and RoPE's
    offset) as an array."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, late: bool = False):
        self.keys, self.values, self.offset, self.write = keys, values, offset, offset
        self._late = late  # planted fault (parity negative control): the mask hides the row's newest key

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys = mx.slice_update(self.keys, keys, self.write[None], axes=(2,))
        self.values = mx.slice_update(self.values, values, self.write[None], axes=(2,))
        return self.keys, self.values

    def _visible(self, n: int, window_size: Optional[int]) -> mx.array:
        """Buffer positions up to the one just written (the whole graph reads the whole buffer)."""
        if n != 1 or window_size is not None:
            raise ValueError("the compiled step runs one token through full-attention layers only")
        pos = mx.arange(self.keys.shape[2])
        return pos < self.write if self._late else pos <= self.write

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None):
        return self._visible(n, window_size)


class BatchBufferKV(BufferKV):
    """The batch lane's full-attention layer inside the trace: rows write at the shared buffer index
    ``idx``, RoPE takes each row's ``offset``, and the mask also hides each row's left padding."""

    def __init__(self, keys, values, idx, offset, left_padding, late: bool = False):
        super().__init__(keys, values, idx, late)
        self.offset, self.left_padding = offset, left_padding

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None):
        upto = self._visible(n, window_size)
        return ((mx.arange(self.keys.shape[2])[None] >= self.left_padding[:, None]) & upto[None])[:, None, None, :]


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

    def __init__(self, model, fault: bool = False, batch: bool = False):
        self.model, self.fault, self.batch_lane = model, fault, batch  # batch: --compile-batch
        self.steps = self.batch_steps = 0
        self.shapes: set = set()  # (rows, buffer capacity) traced so far
        self._fn = mx.compile(self._step)
        self._bfn = mx.compile(self._batch_step)

    def release(self) -> None:
        """Drop the compiled graphs, on the thread that traced them (MLX keeps traces per thread); a later
        step traces them again."""
        self._fn = self._bfn = None

    def _step(self, tok: mx.array, off: mx.array, *kv: mx.array):
        caches = [BufferKV(kv[i], kv[i + 1], off, self.fault) for i in range(0, len(kv), 2)]
        logits = self.model(tok[:, None], cache=caches)[:, -1, :]
        return (logits, *[a for c in caches for a in (c.keys, c.values)])

    def _batch_step(self, tok: mx.array, idx: mx.array, off: mx.array, pad: mx.array, *kv: mx.array):
        caches = [BatchBufferKV(kv[i], kv[i + 1], idx, off, pad, self.fault) for i in range(0, len(kv), 2)]
        logits = self.model(tok[:, None], cache=caches)[:, -1, :]
        return (logits, *[a for c in caches for a in (c.keys, c.values)])

    def step(self, tokens: mx.array, caches: list, merged: bool) -> Optional[mx.array]:
        """The step's logits if this step can run compiled (a lone row on ``KVCache`` layers, or with
        ``batch`` a batch of plain full-attention layers without speculative holes), else None."""
        if not merged:
            ok = bool(caches) and all(type(c) is KVCache and c.keys is not None for c in caches)
            return self(tokens, caches) if ok else None
        ok = self.batch_lane and bool(caches) and all(
            type(c) is AlignedBatchKVCache and c.keys is not None and c.holes is None for c in caches)
        return self.batch(tokens, caches) if ok else None

    def batch(self, tokens: mx.array, caches: list) -> mx.array:
        """Logits [B, V] of one step of the batch lane's ``caches``, which it advances as
        ``BatchKVCache.update_and_fetch`` would."""
        c0 = caches[0]
        idx, cap = c0._idx, c0.keys.shape[2]
        if idx >= cap:
            cap = -(-(idx + 1) // GROW) * GROW
            _grow(caches, idx, cap)
        self.shapes.add((len(tokens), cap))
        if self._bfn is None:
            self._bfn = mx.compile(self._batch_step)
        out = self._bfn(tokens, mx.array(idx, dtype=mx.int32), c0.offset, c0.left_padding,
                        *[a for c in caches for a in (c.keys, c.values)])
        off = c0.offset + 1
        for i, c in enumerate(caches):
            c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
            c._idx, c.offset = idx + 1, off
        self.batch_steps += 1
        return out[0]

    def __call__(self, tokens: mx.array, caches: list) -> mx.array:
        """Logits [1, V] of one step on ``caches`` (one row of ``KVCache``), which it advances."""
        off = caches[0].offset
        cap = caches[0].keys.shape[2]
        if off >= cap:  # grow every buffer to the next multiple of GROW (mlx-lm's KVCache steps by 256 too)
            cap = -(-(off + 1) // GROW) * GROW
            _grow(caches, off, cap)
        self.shapes.add((1, cap))
        if self._fn is None:
            self._fn = mx.compile(self._step)
        out = self._fn(tokens, mx.array(off, dtype=mx.int32), *[a for c in caches for a in (c.keys, c.values)])
        for i, c in enumerate(caches):
            c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
            c.offset = off + 1
        self.steps += 1
        return out[0]

    def stats(self) -> dict:
        return {"steps": self.steps, "batch_steps": self.batch_steps, "traced_shapes": len(self.shapes)}


def _grow(caches: list, used: int, cap: int) -> None:
    """Every layer's buffers: the first ``used`` positions, then zeros up to ``cap``."""
    for c in caches:
        c.keys, c.values = (mx.concatenate([a[..., :used, :], mx.zeros(a.shape[:2] + (cap - used, a.shape[3]), a.dtype)],
                                           axis=2) for a in (c.keys, c.values))


def self_check(model, steps: int = 12, prompt_len: int = 24) -> Optional[str]:
    """Run ``steps`` greedy steps plainly and compiled, for one row and for a padded batch of two;
    None if every logit vector is bit-equal, else what differed (the flag is then refused)."""
    from mlxb.cache.protocol import ROW_OPS

    prompts = [[(7 * i + 3) % 200 + 1 for i in range(prompt_len)], [(5 * i + 11) % 200 + 1 for i in range(prompt_len // 2)]]

    def prefilled(p):
        cache = make_prompt_cache(model)
        model(mx.array(p[:-1])[None], cache=cache)
        return cache

    for rows in (1, 2):
        runs = []
        for compiled in (False, True):
            step = CompiledDecode(model) if compiled else None
            solos = [prefilled(p) for p in prompts[:rows]]
            cache = solos[0] if rows == 1 else [ROW_OPS["full"].to_batch([s[i] for s in solos]) for i in range(len(solos[0]))]
            tok, out = mx.array([p[-1] for p in prompts[:rows]], dtype=mx.uint32), []
            for _ in range(steps):
                if step is None:
                    logits = model(tok[:, None], cache=cache)[:, -1, :]
                else:
                    logits = step(tok, cache) if rows == 1 else step.batch(tok, cache)
                tok = mx.argmax(logits, axis=-1).astype(mx.uint32)
                mx.eval(logits, tok)
                out.append(logits)
            runs.append(out)
        for i, (a, b) in enumerate(zip(*runs)):
            if not mx.array_equal(a, b).item():
                d = float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())
                return (f"the compiled decode step differs from the plain one at step {i} of {'a padded batch' if rows > 1 else 'one row'}"
                        f" (max |logit difference| {d:.3g})")
    return None
