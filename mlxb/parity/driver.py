"""Run the engine under test on a parity case, deterministically, with the logit capture on.

The engine is built exactly as the server builds it but never started: the driver hands requests
in at their arrival iteration and calls ``Engine.iterate()`` itself, so the schedule depends on
the case alone, never on thread timing. The engine's real scheduler decides admission and joins;
the driver records what it did so the parity run can check it against the case's plan.
"""

from __future__ import annotations

import mlx.core as mx

from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.parity.protocol import Case, plan, step_record
from mlxb.request import Request, SamplingParams


def run_engine(model, tokenizer, case: Case, faults: frozenset = frozenset()) -> dict:
    records: dict[int, list] = {i: [] for i in range(len(case.rows))}

    def capture(rid: str, step: int, token: int, vec, geo) -> None:
        r = int(rid[1:])
        assert step == len(records[r]), (rid, step)
        records[r].append(step_record(token, vec, geo))

    eng = Engine(model, tokenizer, max_batch=case.b, prefill_chunk=case.prefill_chunk,
                 join_full=case.join_full, capture=capture, faults=faults)
    expected = plan(case)
    timeline, streams = [], []
    limit = len(expected) + 8
    try:
        for k in range(limit):
            for i, spec in enumerate(case.rows):
                if spec.arrive == k:
                    req = Request(f"r{i}", list(spec.prompt), spec.max_tokens, SamplingParams(), ignore_eos=True)
                    req.mechanism = "continuous"
                    st = OutputStream(req.request_id)
                    eng.accept(req, st)
                    streams.append(st)
            eng.last_forward = []
            out = eng.iterate()
            chunks = [[int(c.request_id[1:]), c.start, c.end, c.is_last] for c in out.prefills] if out else []
            timeline.append({"prefills": chunks, "forward": [int(r[1:]) for r in eng.last_forward]})
            if len(streams) == len(case.rows) and not eng._live:
                break
    finally:
        eng.runner.drop_all()
        mx.synchronize()
    want = [{"prefills": [[c.row, c.start, c.end, c.is_last] for c in it.prefills], "forward": it.forward}
            for it in expected]
    mismatch = None
    for k in range(max(len(want), len(timeline))):
        a = timeline[k] if k < len(timeline) else None
        b = want[k] if k < len(want) else None
        if a != b:
            mismatch = {"iteration": k, "engine": a, "plan": b}
            break
    return {"records": {str(r): v for r, v in records.items()}, "schedule_mismatch": mismatch}
