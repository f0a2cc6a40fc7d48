"""The runner's decode step: the plain pipelined step (``_plain_step``) with grammar rows' masks, the choice
between it and a verify step (``decode_step``, ``--spec``), and reading a step's tokens into ``Emitted`` records.
A part of ``mlxb.engine.runner.Runner`` (a base class of it), kept apart by concern."""

from __future__ import annotations

import os
import time
from typing import Optional

import mlx.core as mx

from mlxb.cache.quantized import maybe_quantize
from mlxb.constrain.grammar import apply_row_masks
from mlxb.engine.sampler import sample_rows
from mlxb.spec.verify import decode as spec_decode

GRAMMAR_ONE_LAUNCH = os.environ.get("MLXB_GRAMMAR_ONE_LAUNCH") == "1"
PLAIN_TRIM_STEPS = 256  # MLX's buffer pool is checked every this many plain steps (a verify step: VERIFY_TRIM_STEPS)


class Decode:
    """Runner methods that run a decode step (see the module notes)."""

    def _needs_vectors(self, row) -> bool:
        """The row's log-prob vector is read with its token: parity captures, or the request reports logprobs
        (a sampled row that asks for none kept a [1, V] copy a step for nothing)."""
        sp = row.req.sampling
        return self.capture is not None or bool(sp.logprobs or sp.top_logprobs)

    def count_step(self, trim_every: int) -> None:
        """One decode step done (plain or verify); every ``trim_every`` steps MLX's buffer pool is checked
        against its slack once the iteration's tokens are out (``Engine.iterate``)."""
        self.num_steps += 1
        if self.num_steps % trim_every == 0:
            self.trim_wanted = True

    def decode_step(self) -> list:
        """A verify step where some row has drafts (--spec), otherwise a plain pipelined step."""
        return spec_decode(self) if self.proposer is not None else self._plain_step()

    def _plain_step(self) -> list:
        t0 = time.perf_counter()
        inputs = self.register
        if "scalar_rope" in self.faults and self.merged:
            for c in self.caches:  # planted bug: one RoPE offset for every row
                if hasattr(c, "offset") and isinstance(c.offset, mx.array) and c.offset.ndim == 1:
                    c.offset = mx.broadcast_to(c.offset.max(), c.offset.shape)
        logits = self.compiled.step(inputs, self.caches, self.merged) if self.compiled and self.lora is None else None
        if logits is None:  # (--compile-decode: the steps it can run compiled, mlxb.engine.compiled)
            logits = self.fwd(self.rows, inputs[:, None], self.caches)[:, -1, :]
        if self.kv is not None and not self.merged:  # a lone adopted row converts as generate_step does
            off = next((c.offset for c, k in zip(self.caches, self.kinds) if k == "full"), 0)
            self.caches = maybe_quantize(self.caches, self.kinds, self.kv, int(off))
        rows = self.rows
        early = None
        cons = [i for i, r in enumerate(rows) if r.sampler.constraint is not None]
        late = "grammar_one_step_late" in self.faults  # planted bug: masks from the state before the last token
        if cons and not late and any(p is not None for p in self.pending):
            # NOTE: a grammar row's mask for this step needs the token it sampled in the last one. The
            # forward is launched first; last step's tokens are read and emitted (matchers advance)
            # while it runs, then the masked sampling is built. Without grammar rows nothing changes.
            # GRAMMAR_ONE_LAUNCH (diagnostic, MLXB_GRAMMAR_ONE_LAUNCH=1): read them first instead and
            # launch forward and masked sampling together (one launch a step instead of two).
            if not GRAMMAR_ONE_LAUNCH:
                tl, cl = time.perf_counter(), time.thread_time()
                mx.async_eval(logits)
                self.timing["fwd_launch_s"] += time.perf_counter() - tl  # wall: the encode plus any wait for the GIL
                self.timing["fwd_launch_cpu_s"] += time.thread_time() - cl  # this thread's CPU time in it
            te = time.perf_counter()
            early = self._emit_pending(inputs, self.pending, self.pending_geo)
            self.timing["early_s"] += time.perf_counter() - te  # the read and emit (wait_s's share here)
        if cons:  # every grammar row's mask in one device op (llguidance fills them in parallel)
            tg = time.perf_counter()
            logits = apply_row_masks(logits, [rows[i].sampler.constraint for i in cons], cons)
            self.timing["mask_s"] += time.perf_counter() - tg
        if all(r.plain or (r.req.sampling.is_plain_greedy and r.sampler.constraint is not None) for r in rows):
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            sampled = mx.argmax(logprobs, axis=-1)
            new_pending = [logprobs[i : i + 1] for i in range(len(rows))] if self.capture else [True] * len(rows)
        else:
            sampled, lps = sample_rows(rows, inputs, logits, masked=bool(cons))
            new_pending = [lp if self._needs_vectors(r) else True for r, lp in zip(rows, lps)]
        sampled = self.share(sampled)
        t1, c1 = time.perf_counter(), time.thread_time()
        mx.async_eval(sampled, [p for p in new_pending if p is not True])
        t2 = time.perf_counter()
        self.timing["launch_cpu_s"] += time.thread_time() - c1  # launch_s less this: time the thread did not run
        prev, prev_geo = self.pending, self.pending_geo
        self.register, self.pending = sampled, new_pending
        if self.capture is not None:
            self.pending_geo = self._geometry()
        self.count_step(PLAIN_TRIM_STEPS)
        tm = self.timing
        tm["steps"] += 1
        tm["rows"] += len(rows)
        tm["build_s"] += t1 - t0
        tm["launch_s"] += t2 - t1
        if early is not None:
            return early
        if not any(p is not None for p in prev):
            return []
        t3 = time.perf_counter()
        out = self._emit_pending(inputs, prev, prev_geo)
        tm["wait_s"] += t3 - t2
        return out

    def _emit_pending(self, inputs: mx.array, pending: list, geo: Optional[list]) -> list:
        """Read the tokens of the last step (``inputs``) and emit them for the rows that sampled one."""
        values = inputs.tolist()
        t = time.perf_counter()
        out = [
            self._emit(r, values[i], None if p is True else p, geo[i] if geo else None)
            for i, (r, p) in enumerate(zip(self.rows, pending)) if p is not None
        ]
        self.timing["emit_s"] += time.perf_counter() - t
        return out
