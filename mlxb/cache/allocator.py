"""MLX's buffer cache between iterations: kept while it is useful, returned when it grows."""

from __future__ import annotations

import mlx.core as mx

_SLACK: list = []
POOL = {"clears": 0, "cleared_bytes": 0}  # every return of MLX's free-buffer pool by mlxb (MLXB_TRACE reads it)


def clear_pool() -> None:
    """``mx.clear_cache()``, counted: on CUDA the next allocations pay again (a trace names where)."""
    POOL["clears"] += 1
    POOL["cleared_bytes"] += mx.get_cache_memory()
    mx.clear_cache()


def trim_allocator_cache(keep: int = 0) -> bool:
    """Give MLX's cached free buffers back to the device only when they exceed a slack (an eighth of
    the allocator's memory limit, at least 1 GiB, at least ``keep`` bytes: the engine passes its live KV,
    about what a join frees when it copies the batch into a larger buffer). mlx-lm clears after every
    prefill chunk; on CUDA one clear of a cohort's transient buffers took 20-30 ms on an H200
    (``scripts/cohort_cost.py``), 17-114 ms in an H100 agent loop (stop 65), and the next step paid again
    to allocate them. Allocation never changes values: no parity effect. Returns whether it cleared."""
    if not _SLACK:
        try:
            _SLACK.append(max(1 << 30, int(mx.get_memory_limit()) // 8))
        except Exception:
            _SLACK.append(1 << 30)
    if mx.get_cache_memory() > max(_SLACK[0], keep):
        clear_pool()
        return True
    return False
