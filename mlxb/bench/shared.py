"""``mlxb bench shared``: shared-prefix KV against every row's own copy, in process, on one model.

Per repeat (fresh prompts each repeat, every arm on the same prompts): ``rows`` rows whose prompts open with
one ``prefix``-token prefix (plus ``own`` tokens of their own) are prefilled alone and joined into a batch, as
joiners do; every arm's batch is built, then ``gen`` decode steps per arm are timed in interleaved blocks. A second cell has rows
with nothing in common (random prompts) at ``plain_rows`` rows: there nothing is shared and the arms should
be level. Rows report KV bytes held by the batch after the joins, the shared bytes, and the mean decode step.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from mlxb.cache.protocol import ROW_OPS
from mlxb.engine.runner import Runner
from mlxb.request import Request, SamplingParams


def _batch(model, kinds, prompts: list, share_min: Optional[int], group: int = 8,
           values32: Optional[bool] = False) -> Runner:
    """Rows prefilled alone and joined ``group`` at a time (as a burst's cohorts join)."""
    r = Runner(model, kinds, share_min=share_min)
    if r.sharing is not None:
        r.sharing.values32 = values32
    if len(prompts) == 1:
        row = r.new_row(Request("r0", prompts[0], 1 << 20, SamplingParams(), ignore_eos=True))
        r.prefill_chunk(row, 0, len(prompts[0]) - 1, True)
        r.join(row, r.first_token(row).token)
        return r
    for g in range(0, len(prompts), group):
        rows, toks = [], []
        for i, p in enumerate(prompts[g:g + group]):
            row = r.new_row(Request(f"r{g + i}", p, 1 << 20, SamplingParams(), ignore_eos=True))
            r.prefill_chunk(row, 0, len(p) - 1, True)
            toks.append(r.first_token(row).token)
            row.base = len(p) - r.num_steps
            rows.append(row)
        caches = [ROW_OPS[k].to_batch([row.solo[i] for row in rows]) for i, k in enumerate(kinds)]
        for row in rows:
            row.solo = []
        r.join_cohort(caches, rows, toks, list(range(len(rows))))
        mx.eval([c.state for c in r.caches])
    return r


def _cells(model, kinds, prompts: list, gen: int, arms: dict, blocks: int = 8) -> dict:
    """Every arm's batch built first (``arms``: name -> (share_min, values32)), then their decode steps timed in
    ``blocks`` interleaved blocks (arm order reversed every other block), so a drift of the device's speed
    during the cell falls on every arm alike. Returns name -> row."""
    runners = {a: _batch(model, kinds, prompts, sm, values32=v32) for a, (sm, v32) in arms.items()}
    for r in runners.values():  # the first step of each shape (not timed)
        mx.eval(r.register)
        r.decode_step()
        mx.eval(r.register)
    spent, steps = dict.fromkeys(runners, 0.0), dict.fromkeys(runners, 0)
    per = max(1, gen // blocks)
    order = list(runners)
    for b in range(max(1, blocks)):
        for a in (order if b % 2 == 0 else order[::-1]):
            r = runners[a]
            t = time.perf_counter()
            for _ in range(per):
                r.decode_step()
            mx.eval(r.register)
            spent[a] += time.perf_counter() - t
            steps[a] += per
    out = {}
    for a, r in runners.items():
        sh = r.sharing.stats(r.caches, r.rows) if r.sharing is not None else {}
        out[a] = {"rows": len(prompts), "kv_bytes": r.kv_bytes, "shared_bytes": sh.get("shared_bytes", 0),
                  "rows_sharing": sh.get("rows_sharing", 0), "step_ms": 1000 * spent[a] / steps[a], "steps": steps[a]}
        r.drop_all()
    return out


def run(model, kinds, *, rows: int = 16, prefix: int = 2048, own: int = 32, gen: int = 32, plain_rows: int = 8,
        plain_len: int = 256, repeats: int = 3, share_min: int = 256, vocab: int = 8000, seed: Optional[int] = None,
        f32_arm: bool = False, cells: tuple = ("fleet", "unshared", "b1"),
        progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """``f32_arm``: the fleet cell also runs sharing whose prefix keeps a float32 copy of its values (arm
    ``shared-f32``, serve's ``--share-f32-values``; the default arm ``shared`` casts them every step)."""
    seed = int(time.time()) if seed is None else seed
    out = []
    for rep in range(repeats):
        rng = np.random.default_rng(seed + rep)  # fresh text per repeat
        pre = rng.integers(3, vocab, size=prefix).tolist()
        fleet = [pre + rng.integers(3, vocab, size=own).tolist() for _ in range(rows)]
        stray = [rng.integers(3, vocab, size=plain_len).tolist() for _ in range(plain_rows)]
        lone = [rng.integers(3, vocab, size=plain_len).tolist()]
        for cell, prompts in (("fleet", fleet), ("unshared", stray), ("b1", lone)):
            if cell not in cells:
                continue
            arms = {"shared": (share_min, False), "copies": (None, False)}
            if f32_arm and cell == "fleet":
                arms["shared-f32"] = (share_min, None)
            if rep % 2:
                arms = dict(reversed(list(arms.items())))
            if progress:
                progress(f"repeat {rep + 1}/{repeats}: {cell} ({len(prompts)} rows), arms {', '.join(arms)}")
            for arm, res in _cells(model, kinds, prompts, gen, arms).items():
                out.append({"cell": cell, "arm": arm, "repeat": rep, "seed": seed + rep, "prefix_tokens": prefix
                            if cell == "fleet" else 0, "gen": gen, **res})
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """Per cell and sharing arm: medians (min, max over repeats) of that arm / copies for step time and KV bytes."""
    out = []
    for cell, arm in dict.fromkeys((r["cell"], r["arm"]) for r in rows if r["arm"] != "copies"):
        ratios = {"step": [], "kv": []}
        for rep in sorted({r["repeat"] for r in rows if r["cell"] == cell}):
            a = next(r for r in rows if r["cell"] == cell and r["repeat"] == rep and r["arm"] == arm)
            b = next(r for r in rows if r["cell"] == cell and r["repeat"] == rep and r["arm"] == "copies")
            ratios["step"].append(b["step_ms"] / a["step_ms"])  # > 1: sharing is faster
            ratios["kv"].append(b["kv_bytes"] / max(1, a["kv_bytes"]))  # > 1: sharing holds fewer bytes
        pick = [r for r in rows if r["cell"] == cell and r["arm"] in (arm, "copies")]
        out.append({"cell": cell if arm == "shared" else f"{cell} ({arm})", "rows": pick[0]["rows"],
                    "repeats": len(ratios["step"]),
                    "speedup_median": float(np.median(ratios["step"])), "speedup_min": min(ratios["step"]),
                    "speedup_max": max(ratios["step"]), "kv_ratio_median": float(np.median(ratios["kv"])),
                    "step_ms_shared": float(np.median([r["step_ms"] for r in pick if r["arm"] == arm])),
                    "step_ms_copies": float(np.median([r["step_ms"] for r in pick if r["arm"] == "copies"])),
                    "kv_bytes_shared": int(np.median([r["kv_bytes"] for r in pick if r["arm"] == arm])),
                    "kv_bytes_copies": int(np.median([r["kv_bytes"] for r in pick if r["arm"] == "copies"]))})
    return out


def admission(model, tokenizer, *, rows: int, prefix: int, own: int, gen: int, budget_rows: float,
              share_min: int = 256, vocab: int = 8000, seed: Optional[int] = None,
              progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Rows decoding at once under one ``--kv-budget`` (``budget_rows`` whole rows' worth of KV), ``rows``
    requests sharing a ``prefix``-token prefix, sent together: the engine as served (scheduler and all), copies
    against sharing, fresh prompts per arm. Peak rows are sampled from the engine's stats while it runs."""
    import threading

    from mlxb.engine.engine import Engine
    from mlxb.engine.stream import OutputStream

    seed = int(time.time()) if seed is None else seed
    out = []
    for k, arm in enumerate(("copies", "shared")):
        rng = np.random.default_rng(seed + 100 + k)
        pre = rng.integers(3, vocab, size=prefix).tolist()
        prompts = [pre + rng.integers(3, vocab, size=own).tolist() for _ in range(rows)]
        eng = Engine(model, tokenizer, max_batch=rows, share_min=share_min if arm == "shared" else None)
        budget = int(budget_rows * eng.projection.row_bytes(prefix + own + gen))
        eng.scheduler.kv_budget = budget
        eng.start()
        peak, done = {"rows": 0, "kv": 0}, threading.Event()

        def watch():
            while not done.is_set():
                s = eng.stats()
                peak["rows"] = max(peak["rows"], len(eng.scheduler.running))
                peak["kv"] = max(peak["kv"], s["kv_bytes"])
                time.sleep(0.005)

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        t = time.perf_counter()
        try:
            streams = []
            for i, p in enumerate(prompts):
                req = Request(f"a{i}", p, gen, SamplingParams(), ignore_eos=True)
                req.mechanism = "continuous"
                st = OutputStream(req.request_id)
                eng.submit(req, st)
                streams.append(st)
            n = sum(1 for st in streams for o in st if o.token is not None)
        finally:
            done.set()
            w.join()
            eng.shutdown()
        wall = time.perf_counter() - t
        if progress:
            progress(f"admission {arm}: peak {peak['rows']} rows")
        out.append({"arm": arm, "rows": rows, "budget_bytes": budget, "budget_rows": budget_rows,
                    "peak_running": peak["rows"], "peak_kv_bytes": peak["kv"], "tokens": n, "wall_s": wall,
                    "tok_s": n / wall})
    return out
