"""The engine thread: owns every MLX call; runs the serial mechanism and the continuous batch.

Callers (the gateway, on any thread or event loop) hand requests in through a thread-safe inbox
and read results from per-request ``OutputStream``s. One lock (``device_lock``) is the single
exclusion domain for the device: the engine holds it for each batch iteration and for a whole
serial request. A waiting serial request holds admission; running rows finish; then the serial
request runs and admission resumes (drain, never starve).
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Optional

import mlx.core as mx

from mlxb.cache.allocator import clear_pool, trim_allocator_cache
from mlxb.cache.shared import SharedBatchKVCache
from mlxb.cache.protocol import admission_projection, layer_kinds
from mlxb.engine.calls import EngineCalls
from mlxb.engine.delivery import Delivery, Live
from mlxb.engine.device_health import DeviceHealth
from mlxb.engine.engine_stats import engine_stats, spec_stats, step_timing
from mlxb.engine.prefill import COHORT_SPLIT_MIN, prefill_cohorts, prefill_one
from mlxb.engine.step import decode_and_retire
from mlxb.engine.reuse import PrefixReuse
from mlxb.engine.runner import Runner
from mlxb.engine.scheduler import Scheduler
from mlxb.engine.serial import SHUTTING_DOWN, run_serial
from mlxb.engine.stream import OutputStream, Outbox
from mlxb.engine.threads import release_thread_state, stop_at_exit, wait_gone
from mlxb.engine.trace import IterationTrace, memory_activity
from mlxb.errors import EngineFailure, EngineUnavailableError, MlxbError
from mlxb.models.model_fixes import engine_view
from mlxb.request import Request, RequestStatus


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch: int = 8,
        prefill_chunk: int = 2048,
        kv_budget: Optional[int] = None,
        context_limit: Optional[int] = None,
        max_joiners: Optional[int] = None,
        prefill_burst: Optional[int] = None,
        join_full: str = "extend",
        capture: Optional[Callable] = None,
        faults: frozenset = frozenset(),
        prompt_cache=None,
        min_shared: int = 32,
        kv_scheme=None,
        spec=None,
        runner_cls=Runner,  # mlxb.distributed.leader.TPRunner (bound to its Link) under --tp
        compile_decode=False,  # --compile-decode "lone" / --compile-batch "all" (mlxb.engine.compiled)
        share_min: Optional[int] = None,  # shared-prefix KV (mlxb.engine.sharing): fewest tokens worth sharing; None: off
        share_f32_values: bool = False,  # a shared prefix also keeps its values in float32 while memory allows
        cohort_split_min: int = COHORT_SPLIT_MIN,  # padded tokens a cohort split by length must save (0: never split)
    ):
        model = engine_view(model)  # load_model's already; a model built elsewhere gets the corrections here
        self.model, self.tokenizer = model, tokenizer
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.cohort_split_min = cohort_split_min
        self.kinds = layer_kinds(model)
        self.batchable = all(k is not None for k in self.kinds)
        from mlxb.cache.kv_plan import as_plan, fit_plan

        self.kv_scheme = fit_plan(as_plan(kv_scheme, len(self.kinds)), model)  # mlxb.cache.quantized.KVPlan or None
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", []) or [])
        # NOTE: the runner first: under --tp it is announced to the other ranks before the forward below
        self.runner = runner_cls(model, self.kinds, join_full=join_full, capture=capture, faults=faults, kv_scheme=self.kv_scheme, spec=spec,
                                 special_tokens=sorted(self.eos_ids), compile_decode=compile_decode,
                                 share_min=share_min)
        if share_f32_values and self.runner.sharing is not None:
            self.runner.sharing.values32 = None
        self.projection = admission_projection(model, self.kinds, self.kv_scheme, spec) if self.batchable else None
        self.reuse = PrefixReuse(self)  # the prompt cache's engine-side glue (off until attached)
        self.scheduler = Scheduler(
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            context_limit=context_limit,
            kv_budget=kv_budget,
            row_bytes=self.projection.row_bytes if self.projection else (lambda n: 0),
            max_joiners=max_joiners,
            prefill_burst=prefill_burst,
            prefix_lookup=None,  # set by attach_prompt_cache
            min_shared=min_shared,
            cache_bytes=self.reuse.nbytes,
            evict_cache=self.reuse.evict,
            **self._sharing_budget(),
        )
        self.attach_prompt_cache(prompt_cache)
        self.device_lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._calls = EngineCalls(self.device_lock)  # work handed to the engine thread (prompt scoring)
        self._serial: deque[Live] = deque()
        self.counters = {"steps": 0, "tokens": 0, "requests": 0, "serial_requests": 0, "batched_steps": 0, "requeued": 0,
                         "cohort_splits": 0}
        self._requeued_this_iteration = False
        self.delivery = Delivery(self.eos_ids, self.counters)
        self.delivery.outbox = Outbox()  # flushed per iteration and serial token, and early (mlxb/engine/stream.py)
        self._live: dict[str, Live] = self.delivery.live  # the same dict: the engine admits, delivery retires
        self._stop = threading.Event()
        self.fatal: Optional[BaseException] = None
        self.last_beat = time.monotonic()
        self.warmup: Optional[dict] = None  # what mlxb.engine.warmup ran before start, if it ran
        self.attention_kernels = self.cuda_graphs = "default"  # set by build_gateway
        self.device_health = DeviceHealth()  # forwards that raise, for /health (mlxb.engine.device_health)
        self.last_forward: list[str] = []  # capture only: request ids of the last decode forward
        self.trace = IterationTrace()  # MLXB_TRACE=FILE: one JSON line per iteration (diagnostics)
        self.idle_poll_s = 0.05  # how long an idle engine waits on its inbox per loop
        self._thread = threading.Thread(target=self._loop, name="mlxb-engine", daemon=True)

    def _sharing_budget(self) -> dict:
        """Admission's view of shared-prefix KV (``Scheduler`` notes): nothing when the runner does not share."""
        sh = self.runner.sharing
        if sh is None or self.projection is None:
            return {}
        r = self.runner
        return {"shared_tokens": sh.covers, "shared_bytes": self.projection.shared_bytes,
                "prefix_bytes": lambda: sh.prefix_bytes(r.caches if r.merged else None),
                "sharing_version": lambda: sh.version, "prefix_start": r.reads_live,
                "own_step": SharedBatchKVCache.OWN_STEP}

    # ---- caller side -----------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return "off" if self.max_batch <= 1 else "batch" if self.batchable else "serial"

    def start(self) -> "Engine":
        self._thread.start()
        stop_at_exit(self)
        return self

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def check_admissible(self, req: Request) -> None:
        """Raise now (on the caller's thread) if ``req`` can never run."""
        self.scheduler.check(req)  # reads immutable limits only

    def submit(self, req: Request, stream: OutputStream) -> None:
        if not self.alive:
            raise EngineUnavailableError("the engine thread is not running; restart the server")
        self.check_admissible(req)
        self.reuse.prefetch(req)
        self._inbox.put(("submit", req, stream))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id, None))

    def score(self, ids: list[int], top: int = 0, adapter: int = -1, timeout: float = 600.0) -> list:
        """Prompt logprobs of ``ids`` (``mlxb.engine.score``), computed on the engine thread between
        iterations; blocks the caller (run it in an executor from async code)."""
        from mlxb.engine.score import prompt_logprobs

        if hasattr(self.runner, "link"):
            raise MlxbError("echo with logprobs (prompt logprobs) is not available under --tp; start the server "
                            "without --tp to score prompts", param="echo", code="unsupported_field")
        if not self.alive:
            raise EngineUnavailableError("the engine thread is not running; restart the server")

        def job():
            if self.runner.lora is not None:
                self.runner.lora.set([adapter])
            return prompt_logprobs(self.model, ids, top)

        fut: Future = Future()
        self._inbox.put(("call", job, fut))
        return fut.result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the engine thread after its current step; every request still in it ends with a 503
        error (the server is shutting down), so open streams close instead of hanging."""
        self._stop.set()
        self._inbox.put(("wake", None, None))
        if self._thread.is_alive():
            self._thread.join(timeout)
            if not self._thread.is_alive():
                wait_gone(self._thread)

    def shutdown(self, timeout: float = 60.0) -> None:
        self.stop(timeout)
        mx.synchronize()
        if self.prompt_cache is not None:  # durable flush: RAM entries go to the SSD tier
            self.prompt_cache.close()

    def kill_for_test(self) -> None:
        """Make the engine thread die as a crash would (used to test /health)."""
        self._inbox.put(("die", None, None))

    def stats(self) -> dict:
        return engine_stats(self)

    def spec_stats(self) -> Optional[dict]:
        return spec_stats(self)

    @property
    def prompt_cache(self):
        """The attached ``mlxb.cache.prompt_cache.PromptCache``, or None (off)."""
        return self.reuse.cache

    def attach_prompt_cache(self, prompt_cache) -> None:
        """Use ``prompt_cache`` (or None: off) from the next admission on; call before ``start()``."""
        self.reuse.attach(prompt_cache if self.batchable else None)

    def prompt_cache_stats(self) -> dict:
        return self.reuse.stats()

    def step_timing(self) -> dict:
        return step_timing(self.runner)

    # ---- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        # NOTE: every engine-thread MLX call runs on one stream made at construction. With the
        # thread's implicit default stream, MLX sometimes aborted the process at exit
        # ("terminate called without an active exception") after batched decoding.
        self._stream = mx.new_stream(mx.default_device())
        try:
            with mx.stream(self._stream):
                self._loop_body()
        finally:
            release_thread_state(self.runner)

    def _loop_body(self) -> None:
        try:
            owed = False  # busy since MLX's buffer cache was last cleared
            while not self._stop.is_set():
                self.last_beat = time.monotonic()
                busy = bool(self.scheduler.has_work() or (self._serial and self.scheduler.is_idle))
                owed = owed or busy
                if not self._drain_inbox(block=not busy) and owed and not busy and not self.scheduler.waiting:
                    # NOTE: idle for a whole poll: give MLX's cached buffers back to the device for another
                    # process or the next burst. Not at once: the clear holds the GIL for milliseconds (6 ms
                    # on a 2-core CPU) while the last answer's consumer is still waking up.
                    clear_pool()
                    owed = False
                if not busy:
                    self.runner.idle()
                self._calls.run()
                self.iterate()
            self._drain_inbox(block=False)  # requests handed in while stopping are answered too
            self._calls.fail(SHUTTING_DOWN)
            for live in list(self._live.values()):
                self.delivery.finish(live, RequestStatus.FINISHED_ERROR, error=SHUTTING_DOWN)
            self._live.clear()
            self.delivery.flush()
            getattr(self.runner, "close", lambda: None)()  # --tp: the other ranks stop too
        except BaseException as e:  # the thread is dying: make it visible and fail everyone
            self.fatal = e
            self._calls.fail(EngineFailure(f"engine thread died: {e!r}"))
            for live in list(self._live.values()):
                self.delivery.finish(live, RequestStatus.FINISHED_ERROR, error=EngineFailure(f"engine thread died: {e!r}"))
            self.delivery.flush()
            raise
        finally:
            # NOTE: drain work this thread queued with async_eval (lookahead steps nobody reads);
            # MLX aborts the process at exit if a finished thread's stream still holds tasks.
            self.runner.drop_all()
            mx.synchronize()

    def iterate(self):
        """One scheduler iteration on the calling thread; returns the SchedulerOutput (None if idle).

        The engine thread calls this in its loop. Deterministic drivers (the parity driver) call it
        directly on an engine that was never started, after ``accept``-ing requests themselves.
        """
        try:
            self._apply_cancels()
            if self._serial and self.scheduler.is_idle:
                run_serial(self, self._serial.popleft())
                return None
            self.scheduler.hold_admission = bool(self._serial)
            out = self.scheduler.schedule()
            if out.is_empty:
                return None
            sh = self.runner.sharing
            if sh is not None and self.runner.read_live:  # (not under --tp: the other ranks could not follow)
                sh.pressure = self.scheduler.memory_bound
            t0 = time.perf_counter()
            self.trace.begin(memory_activity(self.prompt_cache) if self.trace.on else None)
            before = dict(self.runner.timing) if self.trace.on else None
            self.runner.pieces = [] if self.trace.on else None
            with self.device_lock:
                try:
                    self._iteration(out)
                finally:
                    self.reuse.end_iteration()
            if self.trace.on:
                self.trace.record(out, t0, len(self.runner.rows), len(self.scheduler.waiting),
                                  grammar=sum(r.sampler.constraint is not None for r in self.runner.rows),
                                  step={k[:-2]: round(1000 * (v - before.get(k, 0.0)), 2)
                                        for k, v in self.runner.timing.items() if k.endswith("_s")},
                                  pieces=self.runner.pieces, mem=memory_activity(self.prompt_cache))
            return out
        finally:
            self.delivery.flush()  # one wake-up per event loop for everything this iteration made
            if self.runner.trim_wanted:  # after the flush: a clear (tens of ms on CUDA) no longer delays these tokens
                self.runner.trim_wanted = False
                with self.device_lock:
                    trim_allocator_cache(keep=self.scheduler.used_bytes)

    def accept(self, req: Request, stream: OutputStream) -> None:
        """Hand a request in on the calling thread (for drivers of a never-started engine)."""
        assert not self._thread.is_alive(), "use submit() while the engine thread runs"
        self.check_admissible(req)
        self._accept(req, stream)

    def _drain_inbox(self, block: bool) -> bool:
        """Take what was handed in (waiting up to ``idle_poll_s`` for the first if ``block``); whether anything was."""
        got = False
        while True:
            try:
                kind, a, b = self._inbox.get(timeout=self.idle_poll_s) if block and not got else self._inbox.get_nowait()
            except queue.Empty:
                return got
            got = True
            if kind == "submit":
                self._accept(a, b)
            elif kind == "cancel":
                live = self._live.get(a)
                if live is not None:
                    live.cancelled = True
            elif kind == "call":  # run between iterations (the serial lane drains the inbox mid-request)
                self._calls.add(a, b)
            elif kind == "die":
                raise RuntimeError("engine killed for test")

    def _accept(self, req: Request, stream: OutputStream) -> None:
        detok = copy.copy(self.tokenizer._detokenizer)
        detok.reset()
        live = Live(req, stream, detok)
        self._live[req.request_id] = live
        self.counters["requests"] += 1
        self.trace.submitted(req)
        if req.mechanism == "serial":
            req.status = RequestStatus.SERIAL
            self._serial.append(live)
            self.scheduler.num_submitted += 1
        else:
            self.scheduler.add(req)

    def _apply_cancels(self) -> None:
        cancelled = [lv for lv in self._live.values() if lv.cancelled]
        if not cancelled:
            return
        ids = {lv.req.request_id for lv in cancelled}
        for lv in cancelled:
            if lv in self._serial:
                self._serial.remove(lv)
                self.delivery.finish(lv, RequestStatus.FINISHED_ABORTED)
            elif lv.req.status in (RequestStatus.WAITING, RequestStatus.PREFILLING):
                self.scheduler.on_finished(lv.req.request_id, RequestStatus.FINISHED_ABORTED)
                self.delivery.finish(lv, RequestStatus.FINISHED_ABORTED)
        keep = [i for i, r in enumerate(self.runner.rows) if r.req.request_id not in ids]
        if len(keep) < len(self.runner.rows):
            gone = [r for r in self.runner.rows if r.req.request_id in ids]
            self.runner.filter(keep)
            for r in gone:
                self.scheduler.on_finished(r.req.request_id, RequestStatus.FINISHED_ABORTED)
                self.delivery.finish(self._live[r.req.request_id], RequestStatus.FINISHED_ABORTED)

    def _iteration(self, out) -> None:
        r = self.runner
        self._requeued_this_iteration = False
        for rid in out.admitted:
            live = self._live[rid]
            live.req.timings.admitted = time.perf_counter()
            live.row = r.new_row(live.req)
        t_prefill = time.perf_counter()
        cohort = out.cohort
        for chunk in out.prefills:
            live = self._live.get(chunk.request_id)
            if live is None or live.req.status is not RequestStatus.PREFILLING:
                continue  # failed or requeued earlier in this iteration (a split leader's second chunk)
            if chunk in cohort:
                if chunk is cohort[0]:
                    prefill_cohorts(self, cohort)
            else:
                prefill_one(self, chunk)
        if out.prefills:
            r.timing["prefill_s"] += time.perf_counter() - t_prefill
            r.timing["prefill_iterations"] += 1
            self.delivery.flush()  # the joiners' first tokens leave before the decode step, not after it
        if r.rows:  # running rows, plus joiners that joined just now
            decode_and_retire(self)
