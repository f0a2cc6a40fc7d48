"""Run the engine under test on a parity case, deterministically, with the logit capture on.

The engine is built exactly as the server builds it but never started: the driver hands requests
in at their arrival iteration and calls ``Engine.iterate()`` itself, so the schedule depends on
the case alone, never on thread timing. The engine's real scheduler decides admission and joins;
the driver records what it did so the parity run can check it against the case's plan.
"""

from __future__ import annotations

import tempfile
from typing import Optional

import mlx.core as mx

from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.parity.plan import Planner, plan
from mlxb.parity.protocol import MIN_SHARED, SHARED_MIN, Case, step_record
from mlxb.request import Request, SamplingParams


def run_engine(model, tokenizer, case: Case, faults: frozenset = frozenset(), runner_cls=None,
               compile_decode=False) -> dict:
    records: dict[int, list] = {i: [] for i in range(len(case.rows))}

    def capture(rid: str, step: int, token: int, vec, geo) -> None:
        r = int(rid[1:])
        if step >= case.rows[r].max_tokens:  # a verify step's token for a row that already had its last one
            return
        assert step == len(records[r]), (rid, step)
        records[r].append(step_record(token, vec, geo))

    scheme = None
    if case.kv:
        from mlxb.cache.kv_plan import KVScheme

        scheme = KVScheme(case.kv["bits"], case.kv["group_size"], case.kv["start"])
    spec = None
    if case.spec:  # prompt lookup at every B, each row's draft length fixed (the protocol's rule)
        from mlxb.spec.verify import SpecConfig

        spec = SpecConfig("lookup", max(max(case.spec["rows"]), 1), case.spec["ngram"], max_batch=case.b,
                          adaptive=False)
    eng = Engine(model, tokenizer, max_batch=case.b, prefill_chunk=case.prefill_chunk,
                 join_full=case.join_full, capture=capture, faults=faults, min_shared=MIN_SHARED, kv_scheme=scheme,
                 spec=spec, compile_decode=compile_decode, share_min=SHARED_MIN if case.case == "shared" else None,
                 **({"runner_cls": runner_cls} if runner_cls else {}))
    disk = tempfile.TemporaryDirectory() if case.prefix else None
    if case.prefix and hasattr(eng.runner, "link"):  # --tp: rank 0's cache names each entry to the other ranks
        from mlxb.distributed.cache import MirroredPromptCache  # (RAM only: the SSD round trip keeps every entry)

        eng.attach_prompt_cache(MirroredPromptCache(model, eng.kinds, max_bytes=1 << 40, runner=eng.runner))
    elif case.prefix:  # the prompt cache as served, RAM never full, SSD tier in a private folder
        from mlxb.cache.prompt_cache import PromptCache

        eng.attach_prompt_cache(PromptCache(model, eng.kinds, max_bytes=1 << 40, disk_dir=disk.name,
                                            disk_bytes=1 << 40))
        assert eng.prompt_cache.trimmable == case.prefix["trimmable"], "the case's reuse rule is not the model's"
    grammars = None
    if case.grammar:  # constrained rows: the server's own grammar path (llguidance matcher per row)
        from mlxb.engine.gateway import _vocab_size
        from mlxb.constrain.grammar import Grammars

        grammars = Grammars(tokenizer, _vocab_size(model, tokenizer), sorted(getattr(tokenizer, "eos_token_ids", []) or []))
    timeline, streams, reqs, feeds = [], [], {}, []  # feeds: per iteration (tokens per forward row, verify step)
    limit = len(plan(case)) + 8  # one token per forward at least: the plain plan is the longest
    try:
        for k in range(limit):
            arriving = [i for i, spec in enumerate(case.rows) if spec.arrive == k]
            if any((case.link(i) or {}).get("ssd") for i in arriving) and eng.prompt_cache.disk is not None:
                eng.prompt_cache.spill_all()  # every snapshot leaves RAM for the SSD tier
                assert eng.prompt_cache.disk.flush(), "SSD writer did not finish"
            for i, spec in enumerate(case.rows):
                if spec.arrive == k:
                    prompt = case.resolve(i, {r: [x["t"] for x in v] for r, v in records.items()})
                    req = Request(f"r{i}", prompt, spec.max_tokens, SamplingParams(), ignore_eos=True,
                                  adapter=case.lora["rows"][i] if case.lora else -1,
                                  num_draft_tokens=case.spec["rows"][i] if case.spec else None)
                    kind_text = case.constraint(i)
                    if kind_text is not None:
                        kind, text = kind_text
                        g = grammars.from_regex(text, "regex") if kind == "regex" else grammars.from_lark(text, "grammar")
                        req.constraint = grammars.constraint(g, kind)
                    reqs[i] = req
                    req.mechanism = "continuous"
                    st = OutputStream(req.request_id)
                    eng.accept(req, st)
                    streams.append(st)
            eng.last_forward = []
            before, verified = _produced(eng, records), eng.runner.spec_counts["verify_steps"]
            out = eng.iterate()
            after = _produced(eng, records)
            feeds.append(({r: after[r] - before.get(r, 0) for r in after if after[r] > before.get(r, 0)},
                          eng.runner.spec_counts["verify_steps"] > verified))
            chunks = []
            for c in out.prefills if out else []:
                start = c.start
                if c.first and 0 < reqs[int(c.request_id[1:])].reads_prefix == c.start:
                    start = 0  # it read those tokens from the live shared prefix; mlx-lm (no such prefix) computes them
                chunks.append([int(c.request_id[1:]), start, c.end, c.is_last])
            entry = {"prefills": chunks, "forward": [int(r[1:]) for r in eng.last_forward]}
            if case.prefix:
                entry["cached"] = {int(rid[1:]): reqs[int(rid[1:])].cached_tokens for rid in (out.admitted if out else [])}
            timeline.append(entry)
            if len(streams) == len(case.rows) and not eng._live:
                break
    finally:
        eng.runner.drop_all()
        mx.synchronize()
        if disk is not None:
            eng.prompt_cache.close()
            disk.cleanup()
    expected, mismatch = _replay(case, feeds)
    want = [{"prefills": [[c.row, c.start, c.end, c.is_last] for c in it.prefills], "forward": it.forward}
            for it in expected]
    if case.prefix:
        for w, it in zip(want, expected):
            w["cached"] = {r: 0 for r in _admitted(it, expected)} | {r: s[2] for r, s in it.seeds.items()}
    for k in range(max(len(want), len(timeline)) if mismatch is None else 0):
        a = timeline[k] if k < len(timeline) else None
        b = want[k] if k < len(want) else None
        if a != b:
            mismatch = {"iteration": k, "engine": a, "plan": b}
            break
    out = {"records": {str(r): v for r, v in records.items()}, "schedule_mismatch": mismatch}
    if case.spec:  # what the case exercised: verify steps, drafted and accepted tokens
        out["spec"] = {k: int(v) for k, v in eng.runner.spec_counts.items()}
    if eng.runner.sharing is not None:  # what the case exercised: prefixes made, rows that read one, live reads
        out["exercised"] = dict(eng.runner.sharing.counts)
    return out


def _produced(eng, records: dict) -> dict[int, int]:
    """Tokens whose logits exist per row: emitted ones plus the batch's pending (not yet read) ones."""
    out = {r: len(v) for r, v in records.items()}
    for row, p in zip(eng.runner.rows, eng.runner.pending):
        out[int(row.req.request_id[1:])] += p is not None
    return out


def _replay(case: Case, feeds: list) -> tuple[list, Optional[dict]]:
    """The plan, its forwards settled with the tokens the engine's forwards gave (one each but in a
    ``spec`` verify step); a gain the protocol does not allow is a schedule mismatch."""
    p, its = Planner(case), []
    for k, (gains, verify) in enumerate(feeds):
        if p.finished:
            break
        it = p.begin()
        try:
            # a row that joined now got token 0 from its prefill, before the forward
            its.append(p.end(it, {r: gains.get(r, 0) - (r in it.joins) for r in it.forward} if case.spec else None,
                             verify))
        except ValueError as e:
            return its, {"iteration": k, "engine": str(e), "plan": None}
    while not p.finished and len(its) < len(feeds) + 8:  # the engine stopped early: what the plan still had
        its.append(p.end(p.begin()))
    return its, None


def _admitted(it, its) -> list[int]:
    """Rows whose first chunk runs in iteration ``it`` (admitted there)."""
    before = {c.row for x in its[: its.index(it)] for c in x.prefills}
    return [c.row for c in it.prefills if c.row not in before]
