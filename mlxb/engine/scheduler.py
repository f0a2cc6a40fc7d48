"""Iteration-level scheduler: admission, chunked joiner prefill, decode, retirement.

Pure Python on plain data; it never imports mlx (a test proves it). The runner executes what
``schedule()`` decides and reports back through ``on_*`` calls.

Admission is FIFO and head-of-line: the oldest waiting request starts prefill when admission is
not held by a serial waiter, the running and prefilling rows are below the concurrency cap, and its
worst-case KV bytes fit the budget.

Each iteration spends at most ``prefill_chunk`` prompt tokens of joiner prefill (the held-back last
token's L=1 step counts as one), then one decode step runs over every running row. Several short
joiners can finish in one iteration (a burst of B agents joins together; the runner prefills such
whole prompts as one batched cohort), a long one is split across iterations and prefilled alone.
Either way running rows stall for at most one chunk's worth of prefill between two decode steps.

A fleet's turn boundary: when at least ``MIN_TURN_QUEUE`` requests wait to prefill (queued or mid-prefill)
and they outnumber the rows that decode, the queue's wait matters more than the few running rows' stall,
so the iteration may spend one chunk per running row's share of the queue (``ceil(queued / running)``
chunks, at most ``prefill_burst``):
agents whose next turns arrive together join in one or two cohorts instead of one chunk's worth per
iteration (on an H200, 32 agents' turns of ~280 uncached tokens waited up to 4 iterations of ~0.4 s).

When the engine is idle (no row decoding, no prefill in flight) nothing can stall, so that
iteration may spend up to ``prefill_burst`` tokens (default eight chunks, 16384 tokens at the default
chunk: the largest forward mlx-lm's own default prompt batch runs, 8 prompts x 2048): a burst that arrives at
an idle engine is prefilled as one cohort, as mlx-lm's prompt batch does, and its rows then decode
and finish in step. One chunk is still at most ``prefill_chunk`` tokens.

Prompt cache: at admission ``prefix_lookup(req)`` (the engine's prompt cache, mlx-free from here)
gives how many leading prompt tokens are already cached; prefill starts there. A burst that shares a
prefix computes it once: when a request admitted in this iteration shares at least ``min_shared``
more tokens with a row whose chunk in this same iteration covers them, its prefill starts at the
shared length (``cached_tokens``) and the leader's chunk is split there (``PrefillChunk.shared``:
the runner snapshots it alone, out of any cohort, and the follower starts from that snapshot).

One memory ceiling: ``kv_budget`` covers live rows' projected bytes plus the prompt cache's RAM
bytes (``cache_bytes()``); admission evicts cache entries (``evict_cache(n)``) before it ever
queues a row for memory. Shared-prefix KV: a live shared prefix is charged once (``prefix_bytes()``), and a
running row whose prompt it opens is charged only for what it holds itself (``shared_tokens(req)`` tokens
fewer in the layers that share). A joiner whose prompt opens with the live prefix starts its prefill there
(``prefix_start(req)``, where the runner can seed it: every layer shares): it neither computes nor copies the
prefix, and it is charged its own tokens from admission. Any other row is charged whole while it prefills (its
own caches hold the prefix until it joins the batch and drops it). Running rows are charged again at each
iteration's admission (cheap: ``shared_tokens`` is asked once per row and prefix, ``sharing_version``).

Snapshot marks: a chunk also ends at each of the request's ``snapshot_at`` prompt lengths (set only where
the cache keeps exact snapshots), so a later prompt that shares that prefix finds a snapshot there.

A request that can never fit (over the context limit, or over the budget alone) is rejected when
it is added, never left to block the queue. Running rows are never evicted for memory.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache
from typing import Callable, Optional

from mlxb.engine.outputs import PrefillChunk, SchedulerOutput
from mlxb.errors import ContextLimitError, KVBudgetError
from mlxb.request import Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        max_batch: int = 8,
        prefill_chunk: int = 2048,
        context_limit: Optional[int] = None,
        kv_budget: Optional[int] = None,
        row_bytes: Callable[[int], int] = lambda n: 0,
        max_joiners: Optional[int] = None,
        prefill_burst: Optional[int] = None,
        prefix_lookup: Optional[Callable[[Request], int]] = None,
        min_shared: int = 32,
        cache_bytes: Callable[[], int] = lambda: 0,
        evict_cache: Callable[[int], int] = lambda n: 0,
        shared_tokens: Callable[[Request], int] = lambda req: 0,
        shared_bytes: Callable[[int], int] = lambda n: 0,
        prefix_bytes: Callable[[], int] = lambda: 0,
        sharing_version: Callable[[], int] = lambda: 0,
        prefix_start: Callable[[Request], int] = lambda req: 0,
        own_step: int = 1,
    ):
        assert max_batch >= 1 and prefill_chunk >= 1
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.prefill_burst = max(prefill_burst or 8 * prefill_chunk, prefill_chunk)
        self.context_limit = context_limit
        self.kv_budget = kv_budget
        self.max_joiners = max_joiners or max_batch  # joiners prefilled in one iteration (--prompt-concurrency)
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prefill in flight (only the first may be partial)
        self.prefill_pos: dict[str, int] = {}
        self.running: list[Request] = []  # batch row order
        self.hold_admission = False  # set while a serial request waits for the batch to drain
        self.num_submitted = 0
        self._projected: dict[str, int] = {}
        self.prefix_lookup = prefix_lookup
        self.min_shared = max(1, min_shared)
        self.cache_bytes = cache_bytes
        self.evict_cache = evict_cache
        self.num_shared = 0  # followers that started from a leader's snapshot in the same iteration
        # shared-prefix KV: prompt tokens a live shared prefix covers for a request, their bytes per row, and
        # the live prefix's own bytes (charged once, whatever the number of rows that read it)
        self.shared_tokens, self.prefix_bytes = shared_tokens, prefix_bytes
        # charges are asked per admitted row at every iteration: the byte counts (a loop over the layers) are
        # pure in the token count, so each count is computed once
        self.row_bytes, self.shared_bytes = lru_cache(maxsize=1 << 14)(row_bytes), lru_cache(maxsize=1 << 12)(shared_bytes)
        self.sharing_version = sharing_version
        self.prefix_start = prefix_start  # tokens a joiner may skip by reading the live prefix from its first chunk
        # rows that read the live prefix share one own buffer, left-padded to its widest row and grown in steps of
        # ``own_step`` tokens: each is charged that width (``_width``: the widest such row's own tokens)
        self.own_step = max(1, own_step)
        self._width = 0
        self.memory_bound = False  # the queue's head waits for KV budget (set by admission, each iteration)
        self._shared_memo: dict = {}  # request id -> (sharing version, tokens the live prefix serves it)

    # ---- admission -------------------------------------------------------------------------
    def _reads(self, req: Request) -> int:
        """Prompt tokens the live shared prefix serves ``req`` (asked once per row and prefix)."""
        v = self.sharing_version()
        memo = self._shared_memo.get(req.request_id)
        if memo is None or memo[0] != v:
            memo = self._shared_memo[req.request_id] = (v, self.shared_tokens(req))
        return memo[1]

    def _own(self, req: Request, P: int) -> int:
        return req.num_prompt_tokens + req.max_tokens - P

    def projected_bytes(self, req: Request, shared: bool = False, width: Optional[int] = None) -> int:
        """A row's worst-case KV bytes; with ``shared``, less what it reads from the live shared prefix, and as
        wide as the widest row that reads it (``width`` own tokens, default the current one): rows reading one
        prefix hold their own tokens in one buffer whose width is its longest row's, in ``own_step`` steps."""
        whole = self.row_bytes(req.num_prompt_tokens + req.max_tokens)
        P = self._reads(req) if shared else 0
        if not P:
            return whole
        w = max(self._own(req, P), self._width if width is None else width)
        w = -(-w // self.own_step) * self.own_step
        return min(whole, self.row_bytes(P + w) - self.shared_bytes(P))

    def _readers(self) -> list:
        """Admitted rows charged as readers of the live prefix: running rows it serves, and joiners admitted to
        start at it."""
        return ([r for r in self.running if self._reads(r)]
                + [r for r in self.prefilling if r.reads_prefix and self._reads(r)])

    def check(self, req: Request) -> None:
        """Raise if ``req`` can never run; otherwise return (it may still have to wait)."""
        need = req.num_prompt_tokens + req.max_tokens
        if self.context_limit is not None and need > self.context_limit:
            raise ContextLimitError(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.max_tokens}) = {need} exceeds the "
                f"model's context limit of {self.context_limit} tokens; shorten the prompt or lower max_tokens",
                param="max_tokens",
            )
        if self.kv_budget is not None:
            b = self.projected_bytes(req, shared=False)
            if b > self.kv_budget:
                raise KVBudgetError(
                    f"this request alone needs {b} bytes of KV cache (prompt {req.num_prompt_tokens} + max_tokens "
                    f"{req.max_tokens}) but --kv-budget is {self.kv_budget}; raise --kv-budget to at least {b} "
                    "or lower max_tokens",
                    param="max_tokens",
                )

    def add(self, req: Request) -> None:
        self.check(req)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.num_submitted += 1

    @property
    def used_bytes(self) -> int:
        return sum(self._projected.values()) + self.prefix_bytes()

    def _can_admit(self, req: Request, evict: bool = False) -> bool:
        if self.hold_admission:
            return False
        if len(self.running) + len(self.prefilling) >= self.max_batch:
            return False
        if self.kv_budget is not None:
            need = self.used_bytes + self.projected_bytes(req, shared=self.prefix_start(req) > 0)
            self.memory_bound = True  # (cleared below when it fits)
            P = self._reads(req) if self.prefix_start(req) else 0
            if P and self._own(req, P) > self._width:  # a wider reader widens every reader's share of the buffer
                wide = self._own(req, P)
                need += sum(self.projected_bytes(r, True, wide) - self.projected_bytes(r, True) for r in self._readers())
            if need > self.kv_budget:
                return False
            self.memory_bound = False
            over = need + self.cache_bytes() - self.kv_budget
            if over > 0 and evict:  # NOTE: cached prefixes give way to live rows, never the reverse
                self.evict_cache(over)
        return True

    def _cached_start(self, req: Request, out: SchedulerOutput) -> int:
        """Prompt tokens ``req`` need not prefill: cached, or shared with a leader this iteration."""
        if not req.cache_prompt or self.prefix_lookup is None:
            return 0
        cached = best = min(self.prefix_lookup(req), req.num_prompt_tokens - 1)
        at = None
        prefilling = {r.request_id: r for r in self.prefilling}
        ids = req.prompt_ids
        for i, c in enumerate(out.prefills):
            lead = prefilling[c.request_id]
            if not lead.cache_prompt or lead.adapter != req.adapter:  # KV is per LoRA adapter
                continue
            limit = min(req.num_prompt_tokens - 1, c.end)
            need = max(best + 1, c.start + 1, cached + self.min_shared)  # the fewest shared tokens that would count
            if need > limit or ids[need - 1] != lead.prompt_ids[need - 1]:
                continue  # they part before that: no use comparing the whole prefix (an agent turn's own history)
            n = common_prefix(ids, lead.prompt_ids, limit)
            if n > max(best, c.start) and n - cached >= self.min_shared:
                best, at = n, i
        if at is not None:
            c = out.prefills[at]  # the leader's chunk ends at the shared length; the rest follows it
            parts = [PrefillChunk(c.request_id, c.start, best, best == c.end and c.is_last, shared=True, first=c.first)]
            if best < c.end:
                parts.append(PrefillChunk(c.request_id, best, c.end, c.is_last, shared=c.shared))
            out.prefills[at:at + 1] = parts
            self.num_shared += 1
        return best

    # ---- one iteration ---------------------------------------------------------------------
    def iteration_budget(self) -> int:
        """Prompt tokens this iteration may prefill (module notes): a burst when idle; one chunk while the
        running rows outnumber the queue; else a chunk per running row's share of the queue, up to a burst."""
        if self.is_idle:
            return self.prefill_burst
        return iteration_budget(len(self.waiting) + len(self.prefilling), len(self.running), self.prefill_chunk,
                                self.prefill_burst)

    def _reproject(self) -> None:
        """Rows that read the live prefix pay their own tokens at the readers' width; every other admitted row
        pays whole."""
        readers = self._readers()
        self._width = max((self._own(r, self._reads(r)) for r in readers), default=0)
        for req in readers:
            if req.request_id in self._projected:
                self._projected[req.request_id] = self.projected_bytes(req, shared=True)
        for req in self.running:  # no longer served by the live prefix: whole again
            if req.request_id in self._projected and not self._reads(req):
                self._projected[req.request_id] = self.projected_bytes(req)
        for rid in [k for k in self._shared_memo if k not in self._projected]:
            del self._shared_memo[rid]

    def schedule(self) -> SchedulerOutput:
        self._reproject()
        self.memory_bound = False
        out = SchedulerOutput()
        budget = self.iteration_budget()
        i = 0
        while budget > 0 and i < self.max_joiners:
            if i < len(self.prefilling):
                req = self.prefilling[i]
            elif self.waiting and self._can_admit(self.waiting[0], evict=True):
                req = self.waiting.popleft()
                req.reads_prefix = self.prefix_start(req)
                start = max(self._cached_start(req, out), req.reads_prefix)
                req.cached_tokens = start
                req.status = RequestStatus.PREFILLING
                self.prefilling.append(req)
                self.prefill_pos[req.request_id] = start
                if req.reads_prefix:
                    self._width = max(self._width, self._own(req, req.reads_prefix))
                self._projected[req.request_id] = self.projected_bytes(req, shared=req.reads_prefix > 0)
                out.admitted.append(req.request_id)
            else:
                break
            i += 1
            # NOTE: the last prompt token is held back; the runner feeds it as an L=1 step.
            pos, body = self.prefill_pos[req.request_id], req.num_prompt_tokens - 1
            end = chunk_end(pos, min(pos + min(budget, self.prefill_chunk), body), req.snapshot_at)
            is_last = end >= body
            out.prefills.append(PrefillChunk(req.request_id, pos, end, is_last, first=req.request_id in out.admitted))
            budget -= (end - pos) + (1 if is_last else 0)
            if not is_last:
                break
        out.decode = bool(self.running)
        return out

    # ---- runner feedback -------------------------------------------------------------------
    def on_prefill_chunk(self, chunk: PrefillChunk) -> None:
        assert chunk.request_id in self.prefill_pos, chunk
        self.prefill_pos[chunk.request_id] = chunk.end

    def _take_prefilling(self, request_id: str) -> Optional[Request]:
        req = next((r for r in self.prefilling if r.request_id == request_id), None)
        if req is not None:
            self.prefilling.remove(req)
            del self.prefill_pos[request_id]
        return req

    def on_joined(self, request_id: str) -> None:
        """Prefill finished and token 0 did not end the row: it is now a running row (last in order)."""
        req = self._take_prefilling(request_id)
        assert req is not None, request_id
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def on_finished(self, request_id: str, status: RequestStatus) -> Optional[Request]:
        """Remove a finished/aborted/failed row wherever it is; returns it (None if unknown)."""
        assert status.is_finished
        self._projected.pop(request_id, None)
        req = self._take_prefilling(request_id)
        if req is None:
            req = next((r for r in self.running if r.request_id == request_id), None)
            if req is not None:
                self.running.remove(req)
            else:
                req = next((r for r in self.waiting if r.request_id == request_id), None)
                if req is None:
                    return None
                self.waiting.remove(req)
        req.status = status
        return req

    def requeue(self, request_id: str) -> Request:
        """A prefilling request goes back to the head of the queue (its prefill ran out of device
        memory; the engine freed what it could): admitted again from scratch, cache lookup included."""
        req = self._take_prefilling(request_id)
        assert req is not None, request_id
        self._projected.pop(request_id, None)
        req.status, req.cached_tokens = RequestStatus.WAITING, 0
        self.waiting.appendleft(req)
        return req

    def fail_all_running(self) -> list[Request]:
        """A device error cannot be attributed to a row: every running row fails (prefill too)."""
        failed = list(self.running) + list(self.prefilling)
        for r in failed:
            self.on_finished(r.request_id, RequestStatus.FINISHED_ERROR)
        return failed

    # ---- views -----------------------------------------------------------------------------
    @property
    def is_idle(self) -> bool:
        """No running row and no prefill in flight (the device is free for a serial request)."""
        return not self.running and not self.prefilling

    def has_work(self) -> bool:
        if self.running or self.prefilling:
            return True
        return bool(self.waiting) and self._can_admit(self.waiting[0], evict=False)

    def row_index(self, request_id: str) -> int:
        return next(i for i, r in enumerate(self.running) if r.request_id == request_id)


MIN_TURN_QUEUE = 4  # fewer waiting turns of agent size (100-300 tokens) fit one chunk anyway


def iteration_budget(queued: int, running: int, chunk: int, burst: int) -> int:
    """A busy iteration's prefill tokens: one chunk, or ``ceil(queued / running)`` chunks (at most ``burst``)
    when more requests wait than rows decode. The parity plan (``mlxb.parity.plan``) states the same rule."""
    # NOTE: the stall of a running row is bounded by one burst; a turn boundary of an agent fleet trades it
    # for the queue's wait, which is what every waiting agent sees as its TTFT
    if running <= 0 or queued <= running or queued < MIN_TURN_QUEUE:
        return chunk
    return max(chunk, min(burst, chunk * -(-queued // running)))


def chunk_end(pos: int, end: int, marks) -> int:
    """A prefill chunk from ``pos`` ends at ``end``, or earlier at the first snapshot mark inside it."""
    inside = [m for m in marks if pos < m < end]
    return min(inside) if inside else end


def common_prefix(a, b, limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``. Slice comparisons run in C
    (a burst of 18 followers of a 2k-token prefix compared token by token in Python took ~40 ms of
    an iteration on this CPU); the bisection keeps it exact."""
    n = min(limit, len(a), len(b))
    if n <= 0:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
