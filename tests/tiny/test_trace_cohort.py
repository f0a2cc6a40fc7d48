"""``MLXB_TRACE``: an iteration that prefills a cohort records its pieces (``cohort_merge``, ``_forward``,
``_roll`` (suffixes of unequal length), ``_snapshot``, ``_token0``, ``_emit``, then ``_join`` into the batch, in the
line's ``pieces``), ``scripts/trace_summary.py`` reports them, and
``MLXB_TRACE_SYNC=1`` (which evaluates each piece before the next) leaves every token as it was."""

import json

import numpy as np

from mlxb.engine import runner as runner_mod
from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.engine.trace import IterationTrace
from mlxb.request import Request
from scripts.trace_summary import summarize

PIECES = {"cohort_merge", "cohort_forward", "cohort_roll", "cohort_snapshot", "cohort_token0", "cohort_emit", "cohort_join"}


def _run(model, tok, turns, path):
    eng = Engine(model, tok, max_batch=8, prefill_chunk=1024)
    eng.trace = IterationTrace(str(path))
    streams = {f"t{i}": OutputStream(f"t{i}") for i in range(len(turns))}
    for i, p in enumerate(turns):
        eng.accept(Request(f"t{i}", p, 4, ignore_eos=True), streams[f"t{i}"])
    while any(k in eng._live for k in streams):
        eng.iterate()
    eng.trace.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [[o.token for o in streams[f"t{i}"] if o.token is not None] for i in range(len(turns))], lines


def test_a_cohort_iteration_traces_its_pieces_and_sync_keeps_the_tokens(tiny_models, tmp_path, monkeypatch):
    model, tok, _, _ = tiny_models("tiny-llama")
    rng = np.random.default_rng(5)
    turns = [rng.integers(3, 8000, size=n).tolist() for n in (30, 33, 31, 35)]
    plain, lines = _run(model, tok, turns, tmp_path / "plain.jsonl")
    cohort = [d for d in lines if "ms" in d and len(d["prefills"]) >= 2]
    assert len(cohort) == 1 and [n for n, _ in cohort[0]["phases"]].count("cohort") == 1
    pieces = dict(cohort[0]["pieces"])
    assert set(pieces) == PIECES and all(v >= 0 for v in pieces.values())
    # the pieces are the runner's cohort phase, cut up: together no longer than it (host wall time); the join is
    # the join phase's
    phases = dict(cohort[0]["phases"])
    assert sum(v for k, v in pieces.items() if k != "cohort_join") <= phases["cohort"] + 1.0
    assert pieces["cohort_join"] <= phases["join"] + 1.0
    decode_only = [d for d in lines if "ms" in d and not d["prefills"]]
    assert decode_only and not any("pieces" in d for d in decode_only)  # only where a cohort ran
    summary = summarize(lines)
    assert set(summary["cohort_pieces_ms"]) == PIECES and summary["cohort_pieces_ms"]["cohort_forward"]["n"] == 1

    monkeypatch.setattr(runner_mod, "TRACE_SYNC", True)
    synced, lines = _run(model, tok, turns, tmp_path / "sync.jsonl")
    assert synced == plain
    assert set(dict(next(d for d in lines if "ms" in d and len(d["prefills"]) >= 2)["pieces"])) == PIECES


def test_a_trace_line_names_the_evictions_spills_and_pool_returns_of_its_iteration(tiny_models, tmp_path):
    """``mem`` on a line: what moved memory since the last line (RAM evictions, SSD spills with their prepare
    time, pool returns); summed over the lines it equals the prompt cache's own counters. An H100 agent loop had
    cohorts of 1.4 s among ones of 0.3 s while the RAM tier spilled, with nothing in the trace to tell why."""
    from mlxb.cache.allocator import POOL
    from mlxb.cache.prompt_cache import PromptCache

    model, tok, _, _ = tiny_models("tiny-llama")
    eng = Engine(model, tok, max_batch=4, prefill_chunk=1024)
    pc = PromptCache(model, eng.kinds, max_bytes=60_000, disk_dir=tmp_path / "ssd", disk_bytes=1 << 30)
    eng.attach_prompt_cache(pc)  # a RAM tier of about one entry: every next one evicts and spills
    eng.trace = IterationTrace(str(tmp_path / "t.jsonl"))
    rng = np.random.default_rng(3)
    clears0 = POOL["clears"]
    for i in range(4):
        st = OutputStream(f"r{i}")
        eng.accept(Request(f"r{i}", rng.integers(3, 8000, size=40).tolist(), 3, ignore_eos=True), st)
        while f"r{i}" in eng._live:
            eng.iterate()
        if i == 1:
            eng.reuse.after_device_error(RuntimeError("planted: not a memory error"))  # one counted pool return
    eng.trace.close()
    pc.disk.flush()
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines() if '"ms"' in x]
    moved = [d["mem"] for d in lines if "mem" in d]
    assert pc.ram.num_evictions >= 2 and pc.disk.counters["spills"] >= 2
    assert sum(m.get("evictions", 0) for m in moved) == pc.ram.num_evictions
    assert sum(m.get("spills", 0) for m in moved) == pc.disk.counters["spills"]
    assert all(m["spill_prepare_ms"] >= 0 for m in moved if "spills" in m)
    assert POOL["clears"] > clears0 and sum(m.get("pool_clears", 0) for m in moved) >= 1
    got = summarize([json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()])["mem_moved"]
    assert got["spills"] == pc.disk.counters["spills"] and got["evictions"] == pc.ram.num_evictions
    # the first line starts from the totals before it, not from the process's lifetime
    assert lines[0].get("mem", {}).get("pool_clears", 0) <= 1
    pc.close()
