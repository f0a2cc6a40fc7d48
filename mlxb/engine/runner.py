"""The runner: the only code that calls the model and touches cache arrays.

It executes the scheduler's decisions on one running batch:

* ``prefill_cohort`` prefills two or more whole prompts admitted in the same iteration together:
  right-padded, one forward, rolled to left padding (mlx-lm's ``PromptProcessingBatch`` layout),
  then one [n, 1] step for the held-back tokens; ``join_cohort`` adds the survivors at once.
* ``prefill_chunk`` feeds a joiner's prompt alone, on its own single-row caches. A prefill chunk
  is evaluated through the cache state only, so MLX never computes the LM head over the chunk
  (no ``[1, L, V]`` logits exist); the held-back last prompt token then runs as an L=1 step
  whose logits give token 0, sampled on the solo caches.
* ``join`` adopts a row into an empty batch as-is, otherwise joins per layer kind through
  ``mlxb.cache.protocol.ROW_OPS``.
* ``decode_step`` is pipelined like mlx-lm's ``GenerationBatch``: it builds and launches step
  t+1 from the unread token register, then reads step t's tokens as integers.
* ``filter`` retires rows (the extra lookahead KV write of a finished row is dropped with it;
  ``mlxb.engine.retire``).

After every join and filter the runner marks full-attention batch caches ``aligned`` when no row is
left-padded (host-side token counts reach the buffer index); see ``AlignedBatchKVCache.make_mask``.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlxb.cache.protocol import DEFAULT_JOIN, ROW_OPS
from mlxb.cache.kv_plan import as_plan, check_plan
from mlxb.cache.quantized import maybe_quantize, quantize_now
from mlxb.engine.compiled import CompiledDecode
from mlxb.engine.decode import Decode
from mlxb.engine.retire import Retire

from mlxb.engine.sampler import RowSampler, sample_rows, token_logprob
from mlxb.engine.sharing import Sharing, sharing_off, probe as probe_sharing
from mlxb.cache import shared as shared_cache
from mlxb.kernels import dense_attention
from mlxb.spec.verify import RowSpec, StepCost, row_spec, setup
from mlxb.spec.ahead import cancel as cancel_ahead
from mlxb.request import Request, TokenLogprob

# MLXB_TRACE_SYNC=1 (diagnostic, with MLXB_TRACE): a cohort's pieces (merge, forward, snapshots, token-0 step, emit)
# are each evaluated and the device synchronized before the next, so the trace's ``pieces`` attribute the device's
# time; without it they are host wall times, and on an asynchronous device the merge's copies land in the forward's
# share
TRACE_SYNC = os.environ.get("MLXB_TRACE_SYNC") == "1"

# test-only planted bugs for the parity negative controls; never reachable from the server
FAULTS = ("scalar_rope", "no_filter_trim", "double_last_token", "always_aligned", "prefix_off_by_one",
          "grammar_one_step_late", "kv_stale_scale", "lora_shift", "spec_rollback_off_by_one", "compiled_mask_late",
          "shared_offset", "shared_merge", "live_seed_position")


@dataclass
class Row:
    req: Request
    sampler: RowSampler
    solo: list = field(default_factory=list)  # single-row caches during prefill
    context: Optional[mx.array] = None  # token history for penalty processors
    steps: int = 0  # tokens sampled so far (token 0 included)
    plain: bool = False  # plain greedy (sampling params never change): one batched argmax serves it
    base: int = 0  # tokens in this row's caches, minus the runner's step count at join
    tokens: list = field(default_factory=list)  # sampled token ids, in order
    seeded: bool = False  # solo caches set up (from a cached prefix when prefill starts past 0)
    spec: Optional[RowSpec] = None  # speculation state (--spec), None when this row does not speculate
    shared: int = 0  # leading tokens this row reads from the batch's shared prefix (mlxb.engine.sharing)
    live: Optional[tuple] = None  # the live prefix it reads from its first prefill chunk (Sharing.ref), if any


@dataclass
class Emitted:
    row: Row
    token: int
    logprob: Optional[TokenLogprob]
    grammar_done: bool = False  # the row's grammar is complete with this token: the row stops here


class Runner(Retire, Decode):
    def __init__(
        self,
        model,
        kinds: list[str],
        *,
        join_full: str = "extend",
        capture: Optional[Callable[[str, int, int, np.ndarray, Optional[tuple]], None]] = None,
        faults: frozenset = frozenset(),
        special_tokens: Optional[list[int]] = None,
        kv_scheme=None,
        spec=None,
        compile_decode=False,  # False | "lone" (a lone row's steps) | "all" (batch steps too); True means "lone"
        share_min: Optional[int] = None,  # shared-prefix KV: the fewest prompt tokens worth sharing; None: off
    ):
        self.model = model
        self.kinds = kinds
        self.kv = check_plan(as_plan(kv_scheme, len(kinds)), kinds)  # KVPlan (--kv-bits / --kv-config) or None
        self.spec, self.spec_off, self.proposer = setup(spec, kinds)  # --spec: config, why off, proposer
        self.spec_counts: dict[str, int] = defaultdict(int)
        self.step_cost = StepCost()  # --spec: what a verify step costs in plain steps here (measured)
        self.ahead = None  # --spec: a lone row's verify step launched before the last one was read (spec_ahead)
        self.pipeline_verify = True  # whether that may happen on this runner (not --tp)
        self.join_mode = dict(DEFAULT_JOIN, full=join_full, latent=join_full)
        self.capture = capture
        self.faults = faults
        self.special_tokens = special_tokens or []
        self.rows: list[Row] = []
        self.caches: Optional[list] = None
        self.merged = False  # True once caches are batch caches
        self.register: Optional[mx.array] = None  # [B] inputs of the next step
        self.pending: list = []  # per row: logprobs of the unread register token, or None if emitted
        self.pending_geo: Optional[list] = None  # capture only: cache geometry of the unread step
        self.num_steps = 0
        # per-step host timings (seconds, summed): graph build, async_eval launch, wait for the
        # previous step's tokens, turning them into Emitted records; the engine adds delivery. With
        # grammar rows the last tokens are read inside the build (early_s) and masks made there (mask_s).
        # *_cpu_s: the engine thread's own CPU time in a launch (the rest of its wall time it waited: for
        # the GIL, which mx.async_eval releases, or inside MLX)
        self.timing: dict[str, float] = defaultdict(float)
        self.pieces: Optional[list] = None  # [name, ms] of this iteration's cohort pieces while MLXB_TRACE is on
        self.trim_wanted = False  # MLX's buffer pool may have grown: trimmed once the iteration's tokens are out
        # first full/latent layer: its buffer geometry is recorded with captured steps
        self._geo_layer = next((i for i, k in enumerate(kinds) if k in ("full", "latent")), None)
        self.lora = getattr(model, "mlxb_lora", None)  # mlxb.adapters.lora.LoRAContext when --adapters
        self.share = lambda tokens: tokens  # --tp: rank 0's sampled tokens on every rank (mlxb.distributed.leader)
        self.compiled = CompiledDecode(model, "compiled_mask_late" in faults, compile_decode == "all") if compile_decode else None
        self.sharing = None  # mlxb.engine.sharing.Sharing: rows that read one copy of a common prompt prefix
        self.read_live = True  # joiners may start their prefill at the live shared prefix (reads_live)
        self.setup_sharing(share_min)

    def setup_sharing(self, share_min: Optional[int], agree: Optional[Callable[[bool], bool]] = None) -> None:
        """Shared-prefix KV on (``share_min``: the fewest common tokens worth sharing) when this runner's layers
        and the model's attention allow it (a probe forward decides); ``agree`` (``--tp``): every rank's verdict
        at once, sharing only where all ranks can."""
        self.sharing, self.sharing_off = None, sharing_off(share_min, self.kv, self.join_mode["full"], self.kinds)
        if self.sharing_off is None:
            self.sharing_off = probe_sharing(self.model, self.kinds)
        if agree is not None and share_min is not None and not agree(self.sharing_off is None):
            self.sharing_off = self.sharing_off or "another tensor-parallel rank cannot share"
        if self.sharing_off is None:
            self.sharing = Sharing(self.kinds, share_min, offset_fault=1 if "shared_offset" in self.faults else 0)
            self.sharing.seed_fault = "live_seed_position" in self.faults
            shared_cache.MERGE_FAULT = "shared_merge" in self.faults

    def idle(self) -> None:
        """The engine has nothing to run (``mlxb.distributed.leader.TPRunner`` pings the other ranks)."""

    def fwd(self, rows, x, cache):
        """The model over ``rows`` (batch order), each with its LoRA adapter slot (``mlxb.adapters.lora``)."""
        if self.lora is not None:
            slots = [r.req.adapter for r in rows]
            self.lora.set(slots[1:] + slots[:1] if "lora_shift" in self.faults else slots)  # planted: shifted by one
        if not dense_attention._ON:  # the common case: no context manager on the decode step
            return self.model(x, cache=cache)
        with dense_attention.ours():  # --kv-attention fused: this forward's decode reads may take mlxb's kernel
            return self.model(x, cache=cache)

    # ---- prefill ---------------------------------------------------------------------------
    def new_row(self, req: Request) -> Row:
        row = Row(req, RowSampler(req.sampling, self.special_tokens, req.constraint), make_prompt_cache(self.model),
                  plain=req.sampling.is_plain_greedy and req.constraint is None)
        if row.sampler.processors:
            row.context = mx.array(req.prompt_ids[:-1], dtype=mx.uint32)
        row.spec = row_spec(self, req)
        if req.reads_prefix:  # admitted to start at the live prefix (Scheduler: prefix_start): keep a reference
            assert self.sharing is not None and self.sharing.covers(req) == req.reads_prefix, req.request_id
            row.live = self.sharing.ref()
        return row

    def reads_live(self, req: Request) -> int:
        """Prompt tokens ``req`` may skip by reading the live shared prefix from its first prefill chunk (no copy
        of it, not computed): every layer must share (a sliding-window or recurrent layer needs the prefix in its
        own state), and not under ``--tp`` (rank 0's engine seeds rows; the other ranks could not follow)."""
        sh = self.sharing
        if sh is None or not self.read_live or len(sh.layers) != len(self.kinds):
            return 0
        return sh.covers(req)

    def seed(self, row: Row, lent: Optional[list], cohort: bool) -> None:
        """Single-row caches for a joiner that reads the live prefix (``row.live``): ``lent`` holds its first
        ``start`` cached tokens when the prompt cache had more than the prefix, else None."""
        row.solo = self.sharing.seed(row.live, lent, cohort)
        if not cohort:
            row.shared = int(row.live[0].size)

    @staticmethod
    def whole(row: Row) -> list:
        """A joiner's single-row caches with every token it holds or reads (a prompt-cache snapshot): its own list
        when it reads no live prefix (``--tp`` names snapshots by that identity)."""
        if not row.shared:
            return row.solo
        return [c.extract(0) if isinstance(c, shared_cache.SharedBatchKVCache) else c for c in row.solo]

    def prefill_chunk(self, row: Row, start: int, end: int, is_last: bool) -> None:
        ids = row.req.prompt_ids
        if is_last and "double_last_token" in self.faults:
            end = len(ids)  # planted bug: the held-back token is fed here and again below
        if end > start:
            self.fwd([row], mx.array(ids[start:end])[None], row.solo)
            row.solo = maybe_quantize(row.solo, self.kinds, self.kv, end)  # where mlx-lm's generate_step converts
            mx.eval([c.state for c in row.solo])
            self.trim_wanted = True

    def first_token(self, row: Row) -> Emitted:
        """Feed the held-back last prompt token (L=1) and sample token 0 on the solo caches."""
        last = mx.array(row.req.prompt_ids[-1:], dtype=mx.uint32)
        logits = self.fwd([row], last[None], row.solo)[:, -1, :]
        row.solo = maybe_quantize(row.solo, self.kinds, self.kv, row.req.num_prompt_tokens)
        if row.context is not None:
            row.context = mx.concatenate([row.context, last])
        tok, lp = row.sampler(row.context, logits)
        tok = self.share(tok)
        mx.eval(tok, lp)
        geo = None
        if self.capture is not None and self._geo_layer is not None:
            geo = (int(row.solo[self._geo_layer].offset), 0)
        return self._emit(row, int(tok.item()), lp, geo)

    def _geometry(self) -> list:
        """Per batch row: (key buffer width, left padding) of the first full layer after a forward."""
        if self._geo_layer is None:
            return [None] * len(self.rows)
        c = self.caches[self._geo_layer]
        if not self.merged:
            return [(int(c.offset), 0)]
        return [(int(c._idx), int(p)) for p in c.left_padding.tolist()]

    def _emit(self, row: Row, token: int, logprobs: Optional[mx.array], geo: Optional[tuple] = None) -> Emitted:
        step = row.steps
        row.steps += 1
        row.tokens.append(token)
        done = False
        if row.sampler.constraint is not None:  # the matcher sees each token once, in order
            row.sampler.constraint.advance(row.tokens)
            done = row.sampler.constraint.done
        cap = None if self.capture is None else (lambda vec: self.capture(row.req.request_id, step, token, vec, geo))
        return Emitted(row, token, token_logprob(row.req.sampling, token, logprobs, cap), done)

    def prefill_cohort(self, rows: list[Row], starts: Optional[list[int]] = None,
                       snapshot: Optional[Callable[[int, list], None]] = None) -> tuple[list, list[Emitted]]:
        """Prefill several uncached prompt suffixes together: the rows' solo caches (empty, or holding
        a cached prefix of ``starts[i]`` tokens) are merged (left-padded), the suffixes right-padded,
        one forward, then rolled to left padding, as mlx-lm's ``PromptProcessingBatch`` does; feed
        every held-back last token in one [n, 1] step, and sample each row's token 0. Returns the
        cohort's batch caches and emits. ``snapshot(i, layers)`` receives row ``i``'s single-row caches
        (mlx-lm's ``extract``) after the suffixes ran, before the held-back tokens: ``len(prompt) - 1``."""
        clock = [time.perf_counter()]

        def piece(name: str, arrays: Callable[[], list] = list) -> None:  # for the trace only (see TRACE_SYNC)
            if self.pieces is None:
                return
            if TRACE_SYNC:
                mx.eval(arrays())
                mx.synchronize()
            now = time.perf_counter()
            self.pieces.append([f"cohort_{name}", round(1000 * (now - clock[0]), 2)])
            clock[0] = now

        starts = starts or [0] * len(rows)
        bodies = [r.req.prompt_ids[s:-1] for r, s in zip(rows, starts)]
        if "double_last_token" in self.faults:
            bodies = [r.req.prompt_ids[s:] for r, s in zip(rows, starts)]  # planted bug: the held-back token is fed twice
        lengths = [len(b) for b in bodies]
        # room for the bodies, the held-back tokens and the roll's wrap (so what wraps is never-written zeros):
        # the forward writes in place instead of regrowing (a copy of the cohort's whole buffer)
        room = 2 * max(lengths) - min(lengths) + 1 if lengths else 0
        caches = None
        if self.sharing is not None and len(rows) >= 2:  # borrowed prefixes read once, not merged as copies
            caches = self.sharing.cohort_caches(rows, starts, self.kinds, room=room)
        if caches is None:
            caches = [ROW_OPS[k].to_batch([r.solo[i] for r in rows], room=room) for i, k in enumerate(self.kinds)]
        for r, s, n in zip(rows, starts, lengths):
            r.base = s + n + 1 - self.num_steps  # cached prefix, body and the held-back last token
        piece("merge", lambda: [c.state for c in caches])
        width = max(lengths)
        if width > 0:
            pad = [width - n for n in lengths]
            if max(pad) > 0:
                for c in caches:
                    c.prepare(lengths=lengths, right_padding=pad)
            self.fwd(rows, mx.array([b + [0] * (width - len(b)) for b in bodies]), caches)
            if max(pad) > 0:
                piece("forward", lambda: [c.state for c in caches])
                for c in caches:
                    c.finalize()
            mx.eval([c.state for c in caches])
            piece("roll" if max(pad) > 0 else "forward")
        if self.kv is not None and min(s + n for s, n in zip(starts, lengths)) >= self.kv.start:
            caches = self._quantized(caches)  # every body reached the start: convert before the held-back step
        if snapshot is not None:
            for i in range(len(rows)):
                snapshot(i, [ROW_OPS[k].extract(c, i) for k, c in zip(self.kinds, caches)])
        piece("snapshot")
        last = mx.array([r.req.prompt_ids[-1] for r in rows], dtype=mx.uint32)
        logits = self.fwd(rows, last[:, None], caches)[:, -1, :]
        geo = None
        if self.capture is not None and self._geo_layer is not None:
            c = caches[self._geo_layer]
            geo = [(int(c._idx), int(p)) for p in c.left_padding.tolist()]
        toks_arr, lps = sample_rows(rows, last, logits)
        toks_arr = self.share(toks_arr)
        for r in rows:
            r.solo = []
        mx.eval(toks_arr, lps)  # one sync for the whole cohort
        piece("token0")
        values = toks_arr.tolist()
        out = [self._emit(r, values[i], lps[i], geo[i] if geo else None) for i, r in enumerate(rows)]
        self.trim_wanted = True  # after the iteration's tokens are delivered (Engine.iterate), not before
        piece("emit")
        return caches, out

    def join_cohort(self, caches: list, rows: list[Row], tokens: list[int], keep: list[int]) -> None:
        """Join cohort rows ``keep`` (indices into ``rows``; the others finished at token 0)."""
        if not keep:
            return
        t0 = time.perf_counter()
        if len(keep) < len(rows):
            caches = [ROW_OPS[k].filter(c, keep) for k, c in zip(self.kinds, caches)]
        self._attach([rows[i] for i in keep], [tokens[i] for i in keep], self._quantized(caches), merged=True)
        if self.pieces is not None:  # the batch's extend (its copies run here only under TRACE_SYNC)
            if TRACE_SYNC:
                mx.eval([c.state for c in self.caches])
                mx.synchronize()
            self.pieces.append(["cohort_join", round(1000 * (time.perf_counter() - t0), 2)])

    # ---- join ------------------------------------------------------------------------------
    def join(self, row: Row, token0: int) -> None:
        """Join one prefilled row: adopted as-is into an empty batch (its B=1 step is the serial
        graph), otherwise per layer kind as a one-row batch."""
        row.base = row.req.num_prompt_tokens - self.num_steps  # the solo caches hold the whole prompt
        solo, row.solo = row.solo, []
        if row.shared:  # it read the live prefix from its first chunk: shared batch layers already
            self.sharing.cohort = row.live
            self._attach([row], [token0], solo, merged=True)
            return
        if self.rows:
            solo = [ROW_OPS[k].to_batch([c]) for k, c in zip(self.kinds, self._quantized(solo))]
        self._attach([row], [token0], solo, merged=bool(self.rows))

    def _attach(self, rows: list[Row], tokens: list[int], caches: list, merged: bool) -> None:
        """Append ``rows`` whose caches are ``caches`` (batch caches when ``merged``) at the end."""
        cancel_ahead(self)
        tok = mx.array(tokens, dtype=mx.uint32)
        if not self.rows:
            if merged and self.sharing is not None:  # a cohort becomes the batch
                _, caches = self.sharing.before_join([], None, rows, caches)
            self.caches, self.merged, self.register = caches, merged, tok
        else:
            if not self.merged:
                self.caches = [ROW_OPS[k].to_batch([c]) for k, c in zip(self.kinds, self._quantized(self.caches))]
                self.merged = True
            if self.sharing is not None:
                self.caches, caches = self.sharing.before_join(self.rows, self.caches, rows, caches)
            self.caches = [ROW_OPS[k].join_batch(b, c, self.join_mode[k])
                           for k, b, c in zip(self.kinds, self.caches, caches)]
            self.register = mx.concatenate([self.register, tok])
        self.rows.extend(rows)
        self.pending.extend([None] * len(rows))
        if self.pending_geo is not None:
            self.pending_geo.extend([None] * len(rows))
        self._align()

    def _quantized(self, caches: list) -> list:
        return caches if self.kv is None else quantize_now(caches, self.kinds, self.kv)

