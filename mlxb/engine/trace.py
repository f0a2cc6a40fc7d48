"""Optional per-iteration trace (JSON lines) for diagnosing latency: what ran and how long it took.

Off unless ``MLXB_TRACE=FILE`` is set in the server's environment (or a path is given); ``{pid}`` in the
name becomes the process id (two servers of an A/B run write two files). One line
per iteration: seconds since start, wall ms of the iteration, the prefill chunks (start, end,
shared, cohort), rows decoded (and how many under a grammar), the queue, the decode step's host
timings (``step``: graph build, launch, wait for the last tokens, emit; ms) and MLX's active/peak
memory. ``mem`` (where nonzero): what happened to memory since the last line: MLX's free-buffer pool
returned (``pool_clears``, ``pool_cleared_mb``), prompt-cache entries evicted from RAM, spilled to the SSD
tier (and the engine thread's ms preparing them), SSD files written (the writer thread's ms). Appending a line
costs microseconds; the iteration's own work already synchronizes with the device.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import mlx.core as mx


class IterationTrace:
    def __init__(self, path: Optional[str] = None):
        path = (path or os.environ.get("MLXB_TRACE") or "").replace("{pid}", str(os.getpid())) or None
        self._f = open(path, "a", buffering=1) if path else None
        self._t0 = time.perf_counter()
        self._mem: Optional[dict] = None  # memory_activity's totals at the last line (None until the first begin)

    @property
    def on(self) -> bool:
        return self._f is not None

    def begin(self, mem: Optional[dict] = None) -> None:
        """``mem``: ``memory_activity``'s totals, read by the first iteration as the baseline."""
        if self._mem is None and mem is not None:
            self._mem = dict(mem)
        self._phases: list = []
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        """Close a phase of the current iteration (host wall time since the previous mark)."""
        if self._f is not None:
            now = time.perf_counter()
            self._phases.append([name, round(1000 * (now - self._last), 2)])
            self._last = now

    def record(self, out, t_start: float, rows: int, waiting: int, grammar: int = 0,
               step: Optional[dict] = None, pieces: Optional[list] = None, mem: Optional[dict] = None) -> None:
        """``pieces``: [name, ms] of the runner's cohort pieces this iteration (kept only where a cohort ran);
        ``mem``: ``memory_activity``'s running totals (the line keeps what changed since the last one)."""
        if self._f is None:
            return
        moved = {}
        if mem is not None:
            last = self._mem or {}
            moved = {k: round(v - last.get(k, 0), 2) for k, v in mem.items() if v != last.get(k, 0)}
            self._mem = dict(mem)
        cohort = set(id(c) for c in out.cohort)
        now = time.perf_counter()
        self._f.write(json.dumps({
            "t": round(t_start - self._t0, 4), "ms": round(1000 * (now - t_start), 2),
            "admitted": len(out.admitted),
            "prefills": [[c.start, c.end, int(c.shared), int(id(c) in cohort)] for c in out.prefills],
            "rows": rows, "grammar": grammar, "waiting": waiting, "phases": self._phases, "step": step or {},
            "active_mb": round(mx.get_active_memory() / 1e6), "peak_mb": round(mx.get_peak_memory() / 1e6),
            **({"pieces": pieces} if pieces else {}), **({"mem": moved} if moved else {}),
        }) + "\n")

    def since_start(self, t: float) -> float:
        return round(t - self._t0, 4)

    def event(self, name: str, **kw) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"t": round(time.perf_counter() - self._t0, 4), "event": name, **kw}) + "\n")

    def submitted(self, req) -> None:
        """The engine took ``req`` in: its path there, as seconds since start: ``recv`` (the server's handler got
        it), ``prep`` (validation and tokenization began), ``made`` (the request was built); the line's ``t`` is now."""
        if self._f is not None:
            tm = req.timings
            self.event("submit", prompt=req.num_prompt_tokens, made=self.since_start(tm.submitted),
                       **{k: self.since_start(v) for k, v in (("recv", tm.received), ("prep", tm.prepared)) if v is not None})

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def memory_activity(prompt_cache) -> dict:
    """Running totals of what moves memory: pool returns (every ``clear_pool``), RAM evictions, SSD spills
    (with their engine-thread prepare time) and writes (writer-thread time)."""
    from mlxb.cache.allocator import POOL

    out = {"pool_clears": POOL["clears"], "pool_cleared_mb": POOL["cleared_bytes"] / 1e6}
    if prompt_cache is not None:
        out["evictions"] = prompt_cache.ram.num_evictions
        disk = prompt_cache.disk
        if disk is not None:
            c = disk.counters
            out.update(spills=c["spills"], spill_prepare_ms=1000 * c["prepare_s"], ssd_writes=c["writes"],
                       ssd_write_ms=1000 * c["write_s"])
    return out
