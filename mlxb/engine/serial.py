"""The strict serial mechanism (``--batch 1``, or a model whose caches cannot batch): mlx-lm's
``generate_step`` on plain single-row caches, one whole request under the device lock. With the
prompt cache on it starts from the longest cached prefix and stores what it held at the end, as the
batch lane does (``PrefixReuse.serial_prefill``)."""

from __future__ import annotations

import time

import mlx.core as mx

from mlxb.engine.runner import Row
from mlxb.engine.sampler import RowSampler
from mlxb.errors import EngineFailure, EngineUnavailableError
from mlxb.request import Request, RequestStatus


SHUTTING_DOWN = EngineUnavailableError("the server is shutting down; retry against a running server")


def run_serial(engine, live) -> None:
    """Run one serial request to its end on the engine thread (cancellation checked per token)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlxb.cache.quantized import serial_caches

    req = live.req
    engine.counters["serial_requests"] += 1
    req.timings.admitted = time.perf_counter()
    with engine.device_lock:
        row = Row(req, RowSampler(req.sampling, engine.runner.special_tokens, req.constraint))
        try:
            cache, start, status = None, 0, None
            if engine.prompt_cache is not None and req.cache_prompt:
                cache, start = engine.reuse.serial_prefill(req, row)
            if engine.kv_scheme is not None:
                cache = serial_caches(cache if cache is not None else make_prompt_cache(engine.model), engine.kinds,
                                      engine.kv_scheme)
            if engine.runner.lora is not None:  # the one row's adapter for every step generate_step runs
                engine.runner.lora.set([req.adapter])
            gen = generate_step(
                mx.array(req.prompt_ids[start:], dtype=mx.uint32),
                engine.model,
                max_tokens=req.max_tokens,
                sampler=row.sampler.sample,
                logits_processors=row.sampler.serial_processors(req.num_prompt_tokens - start) or None,
                prefill_step_size=engine.prefill_chunk,
                prompt_cache=cache,
                **(_kv_args(engine.kv_scheme) if engine.kv_scheme else {}),
            )
            for tok, logprobs in gen:
                if row.steps == 0:
                    req.timings.prefill_done = time.perf_counter()
                engine._drain_inbox(block=False)
                if engine.stopping:
                    engine.delivery.finish(live, RequestStatus.FINISHED_ERROR, error=SHUTTING_DOWN)
                    break
                if live.cancelled:
                    engine.delivery.finish(live, RequestStatus.FINISHED_ABORTED)
                    break
                engine.counters["steps"] += 1
                engine.device_health.ok()
                em = engine.runner._emit(row, int(tok), logprobs[None] if _wants_vec(engine, req) else None)
                status = engine.delivery.deliver(em)
                engine.delivery.flush()
                if status is not None:
                    break
            if cache is not None and engine.reuse.keeps(req, status):  # holds prompt + every emitted token
                engine.reuse.put_finished(req.prompt_ids + row.tokens, cache, req.num_prompt_tokens + len(row.tokens),
                                          req.adapter)
        except Exception as e:
            engine.device_health.failed(e)
            engine.delivery.finish(live, RequestStatus.FINISHED_ERROR, error=EngineFailure(f"generation failed: {e}"))
    engine._live.pop(req.request_id, None)  # a consumer-raised eviction ends the row here too


def _wants_vec(engine, req: Request) -> bool:
    return engine.runner.capture is not None or req.sampling.logprobs or req.sampling.top_logprobs > 0


def _kv_args(plan) -> dict:
    """generate_step converts once ``kv_bits`` is set; each layer then converts under its own scheme
    (``serial_caches``), so any plan, per-layer ones included, runs on this path."""
    s = next(s for s in plan.layers if s is not None) if any(plan.layers) else None
    if s is None:
        return {}
    return {"kv_bits": s.bits, "kv_group_size": s.group_size, "quantized_kv_start": plan.start}
