"""Tensor parallelism (``--tp N``) over ``mx.distributed``: one process per shard, started by
``mlx.launch`` (ring backend on CPUs and Macs, NCCL on CUDA GPUs, JACCL on Thunderbolt Macs).

Every rank loads the model and shards it with the model's own ``shard(group)`` (mlx-lm's
attention heads and MLP columns split, an ``all_sum`` after ``o_proj`` and ``down_proj``), so each
rank holds 1/N of the weights and 1/N of every KV row. Rank 0 runs everything else: HTTP, the
gateway, the scheduler, sampling, delivery. The other ranks run ``mlxb.distributed.follower``: a plain
``Runner`` over their shard that replays rank 0's runner calls.

How the ranks stay in step (``TPRunner`` on rank 0):

* Calls that run the model (a prefill chunk, token 0, a cohort prefill, a decode step) send one
  message first; calls that only rearrange cache rows (new row, join, filter, drop) are queued
  and ride along with the next message, so a decode iteration costs one broadcast. A message is
  a list of int32 words sent with ``all_sum`` (rank 0 holds it, the others add zeros): a 32-word
  head, and a second ``all_sum`` only when the words do not fit (prompt ids of a new row).
* Sampling happens on rank 0 only. Its sampled tokens reach the other ranks inside the step's
  graph (``Link.share``: an ``all_sum`` of rank 0's tokens and the others' zeros), so the pipelined
  decode keeps its lookahead and the followers need no sampler, grammar, seed or logprobs state:
  every per-row feature of rank 0 works unchanged under ``--tp``. Sampling identically on every
  rank would also work while the ``all_sum`` gives every rank the same bits, but one grammar
  matcher or penalty state out of step would fork the ranks silently; broadcasting cannot.
* An exception inside a mirrored call leaves the ranks disagreeing about the cache rows: it is
  raised as ``RanksOutOfStep`` (not an ``Exception``), which kills the engine thread, so
  ``/health`` answers 503 and the server exits instead of serving from forked caches.
* A rank that stops answering (dead or hung) blocks rank 0 inside a collective. ``watchdog``
  notices (an idle engine pings every second; a ping older than 3 s, or a mirrored call older
  than ``--tp-timeout``), marks the engine failed (``/health`` 503 with the reason) and exits
  the process non-zero, which makes ``mlx.launch`` stop the other ranks.

Refused under ``--tp``: ``--batch 1`` (the serial lane). Mirrored: the prompt cache (RAM and SSD tiers,
``mlxb.distributed.cache``), speculation, LoRA (each rank holds its part of every adapter's factors), shared-prefix
KV (every rank decides the same sharing from the same token ids and row operations; its start-up probe runs on
every rank and shares only where all ranks can).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from typing import Optional


from mlxb.engine.runner import FAULTS, Runner
from mlxb.distributed.link import HEAD, Link, backend_name, command_group, init_group, shard_model  # noqa: F401 (re-exported)
from mlxb.request import Request
from mlxb.distributed.protocol import (  # noqa: F401 (re-exported)
    CHUNK, COHORT, COMPACT, DECODE, DISK_DROP, DROP, ENGINE, EXIT_CODE, EXTRACT, FILTER, FIRST, FORGET, FREE, JOIN,
    JOIN_COHORT, JOIN_MODES, NEW, PING, PUT, RESTORE, SEED, SETTLE, SPILL, SRC_COHORT, SRC_EXTRACT, SRC_ROW, STOP, VERIFY)


class RanksOutOfStep(BaseException):
    """A mirrored call failed on rank 0: the ranks' caches can no longer be trusted to agree."""


class TPRunner(Runner):
    """Rank 0's runner: each call is sent to the other ranks before it runs here."""

    def __init__(self, model, kinds, *, link: Link, lora_recipes: Optional[list] = None, **kw):
        share_min = kw.pop("share_min", None)  # set up below, after ENGINE: its probe forward runs on every rank
        super().__init__(model, kinds, **kw)
        self.pipeline_verify = False  # the followers mirror each verify step as rank 0 tells it, in order
        self.read_live = False  # a joiner's seed from the live prefix is the engine's, not a mirrored call
        self.link = link
        self.share = link.share
        # an engine is being built: the other ranks build the same runner, then measure KV bytes with
        # rank 0's Engine (one forward: its collectives); ENGINE words: join mode, faults, LoRA recipes (parity
        # only: random-weight adapters the followers build on a fresh shard; count first), KV plan
        recipes = [w for r in lora_recipes or [] for w in (r["seed"], r["rank"], r.get("num_layers", -1))]
        self._queued: list[int] = [ENGINE, JOIN_MODES.index(self.join_mode["full"]),
                                   sum(1 << i for i, f in enumerate(FAULTS) if f in self.faults),
                                   len(lora_recipes or []), *recipes, *_plan_words(self.kv, len(kinds)),
                                   -1 if share_min is None else share_min]
        self._gone: deque = deque()  # keys of rank-0 rows garbage-collected: followers drop theirs
        self._next_key = 0
        self._rows = weakref.WeakValueDictionary()  # key -> row (prompt-cache sources and seeds)
        self._sources: dict = {}  # id(layers) -> (layers, (SRC_*, index)): snapshots the followers can name
        self._free_later: list[int] = []
        self._async: deque = deque()  # words queued off the engine thread (the SSD writer's deletions)
        self.before_stop: list = []  # run before STOP (the prompt cache spills its RAM tier on every rank)
        self._last_message = time.monotonic()
        self._flush()  # now: the shared-prefix probe (every rank), then the Engine's KV projection forward
        self.setup_sharing(share_min, lambda ok: self.link.agree(ok) == self.link.size)
        self.link.busy_since = None

    def _flush(self, *words: int, kind: str = "work") -> None:
        msg, self._queued = self._queued, []
        while self._async:
            msg += self._async.popleft()
        gone = []
        while self._gone:
            gone.append(self._gone.popleft())
        if gone:
            msg += [FORGET, len(gone), *gone]
        self.link.busy_kind, self.link.busy_since = kind, time.monotonic()
        self.link.send(msg + list(words))
        self._last_message = time.monotonic()

    def _mirrored(self, words: tuple, call, *args):
        self._flush(*words)
        try:
            return call(*args)
        except Exception as e:
            raise RanksOutOfStep(f"a tensor-parallel call failed on rank 0 ({e!r}); the ranks' caches no longer agree") from e
        finally:
            self.link.busy_since = None

    def new_row(self, req: Request):
        row = super().new_row(req)
        row.tp_key = key = self._next_key
        self._next_key += 1
        self._queued += [NEW, key, req.adapter, len(req.prompt_ids), *req.prompt_ids]
        weakref.finalize(row, self._gone.append, key)
        self._rows[key] = row
        return row

    # ---- the prompt cache (mlxb.distributed.cache) ----------------------------------------------
    def cache_source(self, layers) -> Optional[tuple]:
        """How the other ranks name ``layers``: a row's prefill caches, a cohort row or an extracted row."""
        for key, row in list(self._rows.items()):
            if row.solo is layers:
                return (SRC_ROW, key)
        hit = self._sources.get(id(layers))
        return hit[1] if hit is not None and hit[0] is layers else None

    def queue_cache_op(self, *words: int) -> None:
        self._queued += list(words)

    def queue_async(self, words: list[int]) -> None:
        """Queue words from another thread (they go with the next message)."""
        self._async.append(list(words))

    def restore(self, words: tuple, load) -> tuple:
        """An SSD restore on every rank: send ``words`` now, run ``load()`` here (a result, or None when
        this rank's file was bad), then count the ranks that succeeded. Returns (result, all succeeded)."""
        self._flush(*words)
        try:
            got = load()
            return got, self.link.agree(got is not None) == self.link.size
        finally:
            self.link.busy_since = None

    def mirror_compact(self) -> None:
        self._queued.append(COMPACT)  # adaptive --spec compacted the holes before a plain step

    def queue_cache_free_later(self, eid: int) -> None:
        self._free_later.append(eid)

    def mirror_seed(self, req, entry, n: int) -> None:
        row = next(r for r in self._rows.values() if r.req is req)
        self._queued += [SEED, row.tp_key, entry.tp_id, n]

    def extract_rows(self, indices):
        out = super().extract_rows(indices)
        self._queued += [EXTRACT, len(indices), *indices]
        for j, (_, layers, _) in enumerate(out):
            self._sources[id(layers)] = (layers, (SRC_EXTRACT, j))
        return out

    def prefill_chunk(self, row, start, end, is_last):
        return self._mirrored((CHUNK, row.tp_key, start, end, int(is_last)), super().prefill_chunk, row, start, end, is_last)

    def first_token(self, row):
        return self._mirrored((FIRST, row.tp_key), super().first_token, row)

    def prefill_cohort(self, rows, starts=None, snapshot=None):
        starts = starts or [0] * len(rows)
        named = None
        if snapshot is not None:  # the followers extract every cohort row too; PUT names the ones kept

            def named(i, layers):
                self._sources[id(layers)] = (layers, (SRC_COHORT, i))
                snapshot(i, layers)

        return self._mirrored((COHORT, len(rows), *[r.tp_key for r in rows], *starts, int(snapshot is not None)),
                              super().prefill_cohort, rows, starts, named)

    def join_cohort(self, caches, rows, tokens, keep):
        self._queued += [JOIN_COHORT, len(rows), *[r.tp_key for r in rows], *tokens, len(keep), *keep]
        return super().join_cohort(caches, rows, tokens, keep)

    def join(self, row, token0):
        self._queued += [JOIN, row.tp_key, token0]
        return super().join(row, token0)

    def decode_step(self):
        for eid in self._free_later:  # entries larger than the RAM tier served this iteration's rows
            self._queued += [FREE, eid]
        self._free_later, self._sources = [], {}
        if self.proposer is None:
            return self._mirrored((DECODE,), super().decode_step)
        # --spec: rank 0 reads, gates and proposes first; the others then run the same forward (a plain
        # step, or the verify feed built from these drafts) and, with the next message, its outcome
        from mlxb.spec.verify import decode, verify_step

        def verify(props):
            words = (VERIFY, len(props), *[len(p) for p in props], *[x for p in props for x in p])
            out = self._mirrored(words, verify_step, self, props)
            kept, last, width = self.last_verify
            self._queued += [SETTLE, len(kept), width, *kept, *last]
            return out

        return decode(self, lambda: self._mirrored((DECODE,), self._plain_step), verify)

    def filter(self, keep):
        self._queued += [FILTER, len(keep), *keep]
        return super().filter(keep)

    def drop_all(self):
        self._queued.append(DROP)
        return super().drop_all()

    def idle(self) -> None:
        """Called by an idle engine: a ping a second, so a rank that stopped answering shows."""
        if time.monotonic() - self._last_message >= 1.0:
            self._flush(PING, kind="ping")
            self.link.busy_since = None

    def tp_stats(self) -> dict:
        """For /stats: the ranks, and what keeping them in step costs (KV bytes in /stats are this rank's)."""
        lk = self.link
        return {"ranks": lk.size, "backend": backend_name(), "messages_over": lk.channel,
                "kv_bytes_per": "rank", "messages": lk.messages,
                "mean_words": round(lk.words / lk.messages, 2) if lk.messages else 0.0,
                "not_mirrored": ["--batch 1"]}

    def close(self) -> None:
        """Clean stop: the other ranks leave their loops (after what must reach them first)."""
        for f in self.before_stop:
            f()
        self._flush(STOP, kind="ping")
        self.link.busy_since = None


def _plan_words(plan, n: int) -> list[int]:
    """A KV plan as words: start, then (bits, group size) per layer, (0, 0) for full width; [-1]: no plan."""
    if plan is None:
        return [-1]
    return [plan.start] + [w for sc in plan.layers for w in ((sc.bits, sc.group_size) if sc is not None else (0, 0))]


def watchdog(engine, link: Link, timeout: float, ping_timeout: float = 3.0, grace: float = 2.0) -> threading.Thread:
    """Rank 0: fail the engine (``/health`` 503) and exit the process when a rank stops answering."""
    from mlxb.errors import EngineFailure

    def run():  # also while stopping: the last message (STOP) can meet a dead rank
        while engine.fatal is None:
            time.sleep(0.25)
            since = link.busy_since
            if since is None:
                continue
            limit = ping_timeout if link.busy_kind == "ping" or engine.stopping else timeout
            waited = time.monotonic() - since
            if waited > limit and link.busy_since == since:
                engine.fatal = EngineFailure(
                    f"tensor parallel: another rank has not answered for {waited:.1f} s (dead or hung); "
                    f"this server exits with code {EXIT_CODE}")
                time.sleep(grace)  # /health answers 503 meanwhile
                os._exit(EXIT_CODE)

    t = threading.Thread(target=run, name="mlxb-tp-watchdog", daemon=True)
    t.start()
    return t
