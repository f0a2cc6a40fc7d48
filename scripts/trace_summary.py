"""Summarize an `MLXB_TRACE` file: where the engine's time and each request's time to first token went.

    python scripts/trace_summary.py TRACE.jsonl [--since SECONDS] [--json OUT.json]

Per request (``token0`` events): queue wait (submitted -> admitted), prefill (admitted -> token 0), the
uncached tokens it prefilled and the size of the cohort it was prefilled in; per served request (``submit``
events), its path from the server's handler through tokenization to the engine. Per iteration: wall ms of
decode-only iterations and of iterations with joiner prefill, and each phase's share (``seed``,
``cohort``, ``chunk``, ``snapshot``, ``token0``, ``join``, ``decode``, ``retire``). A diagnostic, not a
benchmark: the phases are host wall time between marks, so a phase that reads a result also waits for
the device work queued before it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict

import numpy as np


def pcts(xs) -> dict:
    a = np.asarray(list(xs), dtype=float)
    if not a.size:
        return {"n": 0}
    return {"n": int(a.size), "p50": round(float(np.percentile(a, 50)), 2), "p95": round(float(np.percentile(a, 95)), 2),
            "max": round(float(a.max()), 2), "sum": round(float(a.sum()), 1)}


def _gaps(ts: list) -> dict:
    """Gaps between successive times (seconds, sorted) that belong to one burst (under 250 ms apart), in ms."""
    return pcts(1000 * (b - a) for a, b in zip(ts, ts[1:]) if b - a < 0.25)


def _steps(its) -> dict:
    by = defaultdict(list)
    for d in its:
        for k, v in (d.get("step") or {}).items():
            by[k].append(v)
    return {k: pcts(v) for k, v in sorted(by.items())}


def summarize(lines: list[dict], since: float = 0.0) -> dict:
    its = [d for d in lines if "ms" in d and d["t"] >= since]
    t0 = [d for d in lines if d.get("event") == "token0" and d["t"] >= since]
    with_prefill = [d for d in its if d["prefills"]]
    decode_only = [d for d in its if not d["prefills"]]
    phases = defaultdict(list)
    for d in with_prefill:
        for name, ms in d["phases"]:
            phases[name].append(ms)
    decode_phase = [ms for d in decode_only for name, ms in d["phases"] if name == "decode"]
    # iterations whose prefill was one cohort (one cohort phase, no chunk alone): its forward's padded tokens
    # (rows x longest body) against its real ones, and what the cohort phase cost per 1,000 padded tokens
    one = [d for d in with_prefill if [n for n, _ in d["phases"]].count("cohort") == 1
           and all(n != "chunk" for n, _ in d["phases"]) and len(d["prefills"]) >= 2]
    padded = [len(d["prefills"]) * max(p[1] - p[0] for p in d["prefills"]) for d in one]
    real = [sum(p[1] - p[0] for p in d["prefills"]) for d in one]
    cohort_ms = [dict(d["phases"])["cohort"] for d in one]
    subs = [d for d in lines if d.get("event") == "submit" and d["t"] >= since and d.get("made") is not None]
    made = sorted(e["made"] for e in subs)
    recv = sorted(e["recv"] for e in subs if "recv" in e)
    return {
        "iterations": len(its),
        "decode_only_ms": pcts(d["ms"] for d in decode_only),
        "decode_only_decode_phase_ms": pcts(decode_phase),
        "with_prefill_ms": pcts(d["ms"] for d in with_prefill),
        "with_prefill_phases_ms": {k: pcts(v) for k, v in sorted(phases.items())},
        "rows": pcts(d["rows"] for d in its),
        # decode-only iterations with and without grammar rows (forced tool calls, schemas) in the batch
        "decode_only_free_ms": pcts(d["ms"] for d in decode_only if not d.get("grammar")),
        "decode_only_grammar_ms": pcts(d["ms"] for d in decode_only if d.get("grammar")),
        "rows_free": pcts(d["rows"] for d in decode_only if not d.get("grammar")),
        "rows_grammar": pcts(d["rows"] for d in decode_only if d.get("grammar")),
        # the decode step's host timings (ms per iteration: build, launch, wait, emit, early, mask) by kind
        "step_free_ms": _steps(d for d in decode_only if not d.get("grammar")),
        "step_grammar_ms": _steps(d for d in decode_only if d.get("grammar")),
        "requests": len(t0),
        "queue_wait_ms": pcts(e["wait_ms"] for e in t0),
        "prefill_ms": pcts(e["prefill_ms"] for e in t0),
        "uncached_tokens": pcts(e["prompt"] - (e["cached"] or 0) for e in t0),
        "cached_tokens": pcts(e["cached"] or 0 for e in t0),
        "cohort_size": pcts(e["cohort"] for e in t0),
        "cohort_padded_tokens": pcts(padded),
        "cohort_padding_ratio": round(sum(padded) / sum(real), 3) if sum(real) else None,
        "cohort_ms_per_1k_padded": round(1000 * sum(cohort_ms) / sum(padded), 1) if sum(padded) else None,
        # those iterations' cohort phase by piece (the line's ``pieces``; device-attributed only when the server
        # ran with MLXB_TRACE_SYNC=1, else host wall time)
        "cohort_pieces_ms": {k: pcts(dict(d.get("pieces", [])).get(k, 0.0) for d in one)
                             for k in sorted({k for d in one for k, _ in d.get("pieces", [])})},
        # requests made (built by the gateway) one after another within a burst: the gateway's per-request work
        "arrival_gap_ms": _gaps(made),
        "made_to_engine_ms": pcts(1000 * (e["t"] - e["made"]) for e in subs),
        # a served request's path to the engine (submit events with ``recv``/``prep``): the handler got it -> a prep
        # thread began on it (body read, JSON parsed, a free prep thread and the GIL) -> built (tokenized) -> the
        # engine took it in; and the gaps between handler arrivals within a burst (what the clients and HTTP spread)
        "recv_to_prep_ms": pcts(1000 * (e["prep"] - e["recv"]) for e in subs if "recv" in e and "prep" in e),
        "prep_to_made_ms": pcts(1000 * (e["made"] - e["prep"]) for e in subs if "prep" in e),
        "recv_to_engine_ms": pcts(1000 * (e["t"] - e["recv"]) for e in subs if "recv" in e),
        "recv_gap_ms": _gaps(recv),
        # what moved memory (the lines' ``mem``), in all, and the cohort iterations slower than twice their median:
        # how many of them followed a pool return or a spill (a fresh allocation or a device-to-host read)
        "mem_moved": {k: round(sum(d.get("mem", {}).get(k, 0) for d in its), 1)
                      for k in sorted({k for d in its for k in d.get("mem", {})})},
        "slow_cohorts": _slow(one, cohort_ms),
    }


def _slow(one: list[dict], cohort_ms: list[float]) -> dict:
    if not cohort_ms:
        return {}
    bar = 2 * sorted(cohort_ms)[len(cohort_ms) // 2]
    slow = [d for d, ms in zip(one, cohort_ms) if ms > bar]
    return {"n": len(slow), "of": len(one), "over_ms": round(bar, 1),
            "with_pool_clears": sum(1 for d in slow if d.get("mem", {}).get("pool_clears")),
            "with_spills": sum(1 for d in slow if d.get("mem", {}).get("spills"))}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--since", type=float, default=0.0, help="Only what happened this many seconds after the engine started.")
    ap.add_argument("--json", help="Also write the summary here.")
    a = ap.parse_args(argv)
    opener = gzip.open if a.trace.endswith(".gz") else open  # traces are kept gzipped under reports/
    with opener(a.trace, "rt") as f:
        lines = [json.loads(ln) for ln in f if ln.strip()]
    s = summarize(lines, a.since)
    for k, v in s.items():
        if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            print(f"{k}:")
            for kk, vv in v.items():
                print(f"  {kk:10s} {vv}")
        else:
            print(f"{k:28s} {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
