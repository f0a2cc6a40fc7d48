"""What ``Engine.stats()`` reports (``/stats``, ``/metrics``, the CLI banners): one place that reads the
engine, its scheduler and its runner, so the engine module keeps to running requests."""

from __future__ import annotations

from typing import Optional

from mlxb.cache.kv_plan import kv_stats


def engine_stats(eng) -> dict:
    s, r = eng.scheduler, eng.runner
    return {
        "configured": eng.max_batch,
        "mode": eng.mode,
        "batched": r.merged,
        "active_rows": len(s.running) + len(s.prefilling),
        "pending_rows": len(s.waiting) + len(eng._serial),
        "submitted_rows": s.num_submitted,
        "kv_bytes": r.kv_bytes,
        "kv_projected_bytes": s.used_bytes,
        "kv_budget_bytes": s.kv_budget,
        **eng.counters,
        "attention_kernels": eng.attention_kernels,
        "cuda_graph_check": eng.cuda_graphs,
        "failed_forwards": eng.device_health.failures,
        **kv_stats(eng.kv_scheme),
        "speculation": spec_stats(eng),
        "lora": r.lora.stats() if r.lora is not None else None,
        "tensor_parallel": getattr(r, "tp_stats", lambda: None)(),
        "compiled_decode": r.compiled.stats() if getattr(r, "compiled", None) else None,
        "step_timing": step_timing(r),
        "prompt_cache": eng.prompt_cache_stats(),
        "shared_prefix": shared_stats(r),
    }


def shared_stats(r) -> dict:
    """Shared-prefix KV: whether it runs (and why not), which layers share, the live prefix and what it saves."""
    if r.sharing is None:
        return {"active": False, "off_reason": r.sharing_off}
    return {"active": True, "min_tokens": r.sharing.min_tokens, "shared_layers": "full-attention",
            **r.sharing.stats(r.caches if r.merged else None, r.rows)}


def spec_stats(eng) -> Optional[dict]:
    """--spec: the method, whether it runs on this model (and why not), drafted / accepted tokens."""
    r = eng.runner
    if r.spec is None:
        return None
    c, sp = r.spec_counts, r.spec
    off = r.spec_off or ("--batch 1 is the strict serial lane (mlx-lm's generate_step); speculation runs on "
                         "the batch lane" if eng.max_batch == 1 else None)
    acc = round(c["accepted"] / c["drafted"], 4) if c["drafted"] else None
    return {"method": sp.method, "draft_model": sp.draft_name, "max_batch": sp.max_batch, "adaptive": sp.adaptive,
            "pipeline": sp.pipeline, **{k: c[k] for k in ("pipelined_kept", "pipelined_dropped", "pipelined_cancelled")},
            "num_draft_tokens": sp.num_draft_tokens, "active": off is None, "off_reason": off, "acceptance": acc,
            **{k: c[k] for k in ("verify_steps", "drafted", "accepted")}, "verify_cost_plain_steps": round(r.step_cost.ratio, 3),
            "verify_steps_unsampled": r.step_cost.dropped}


def step_timing(runner) -> dict:
    """Mean host time per decode step (ms) by phase, from the runner's summed timings."""
    t = dict(runner.timing)
    n = t.get("steps", 0)
    out = {"steps": int(n), "mean_rows": (t.get("rows", 0) / n) if n else 0.0}
    for k in ("build_s", "launch_s", "wait_s", "emit_s", "deliver_s"):
        out[k.replace("_s", "_ms")] = 1000 * t.get(k, 0.0) / n if n else 0.0
    out["prefill_s_total"] = t.get("prefill_s", 0.0)
    return out
