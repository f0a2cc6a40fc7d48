"""In-process engine benchmark: our engine vs mlx-lm on the same model, machine and prompts.

Arms run interleaved (ours, peer, ours, peer, ...) so drift hits both; every number is a ratio
against the peer measured in the same repeat. EOS is ignored on both sides so every row decodes
exactly ``gen_tokens``.

* ``b1``: one request; decode tok/s after the first token. Ours goes through the continuous lane
  (a lone adopted row); the peer is mlx-lm ``stream_generate``. Each repeat runs ours, peer, peer,
  ours and compares the means, so a drift in machine speed within the repeat cancels.
* ``aggregate@B``: B requests submitted together; generated tokens / wall time from submission to
  the last token (prefill included, identical work on both sides). Peer: mlx-lm ``BatchGenerator``.
* ``aggregate_ragged@B`` (largest B): the same with prompt lengths spread over [L/2, 3L/2], so rows
  are left-padded and both sides attend through a padding mask. With equal lengths no row is
  padded and our engine skips the mask (mlx-lm builds one anyway); this metric shows the other case.
* ``prefill``: prompt tokens / time to first token for one request, both sides.
* ``b1_served_*`` (``served=``): the B=1 prompt through a running ``mlxb serve`` over our in-process
  engine, by decode rate and by request rate (``mlxb.bench.served``).

Before the timed repeats each arm runs every B once untimed, with the same prompt length and
``gen``: MLX compiles kernels for each new shape on first use (seconds on CUDA), and a row set that
retires in stages meets shapes a single warm-up at B=2 never shows. The late-joiner stall is judged
on the last of three joiners for the same reason (each joiner's stall is kept in the result).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.engine.warmup import freeze_heap, warm_up
from mlxb.request import Request
from mlxb.bench.load import decode_rates as _rates


def _prompts(n: int, length: int, vocab: int, seed: int, ragged: bool = False) -> list[list[int]]:
    """``n`` random prompts of ``length`` tokens; ``ragged``: lengths drawn from [length/2, 3*length/2]."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(max(1, length // 2), length * 3 // 2 + 1, size=n) if ragged else [length] * n
    return [rng.integers(3, vocab - 1, size=int(k)).tolist() for k in sizes]


def ours(engine: Engine, prompts: list[list[int]], gen: int) -> dict:
    engine.runner.timing.clear()  # the engine is idle between arms
    streams, reqs, t0 = [], [], time.perf_counter()
    for i, p in enumerate(prompts):
        r = Request(f"b{time.perf_counter_ns()}-{i}", p, gen, ignore_eos=True)
        st = OutputStream(r.request_id)
        engine.submit(r, st)
        streams.append(st)
        reqs.append(r)
    seen, n = [], 0  # per stream: arrival times of its first two and its last token
    for st in streams:
        ts = []
        for out in st:
            now = time.perf_counter()
            if out.token is not None:
                n += 1
                ts = _mark(ts, now)
        seen.append(ts)
    end = max(ts[-1] for ts in seen)
    joined = max(r.timings.first_token for r in reqs)  # engine-side: every row has token 0
    return {"tokens": n, "wall": end - t0, "ttft": seen[0][0] - t0, "all_first_s": joined - t0,
            "timing": engine.step_timing(), **_rates(seen[0], gen)}


def _mark(ts: list, now: float) -> list:
    """Arrival times kept per stream: the first two tokens' and the latest one's."""
    return ts[:2] + [now] if len(ts) == 3 else ts + [now]


def peer_single(model, tokenizer, prompt: list[int], gen: int) -> dict:
    from mlx_lm import stream_generate

    tok = copy.copy(tokenizer)
    tok._eos_token_ids = set()
    t0 = time.perf_counter()
    ts, n = [], 0
    for r in stream_generate(model, tok, prompt, max_tokens=gen):
        now = time.perf_counter()
        ts = _mark(ts, now)
        n += 1
    return {"tokens": n, "wall": ts[-1] - t0, "ttft": ts[0] - t0, **_rates(ts, gen)}


def peer_batch(model, prompts: list[list[int]], gen: int) -> dict:
    from mlx_lm.generate import BatchGenerator

    bg = BatchGenerator(model, max_tokens=gen, stop_tokens=None, completion_batch_size=max(len(prompts), 1),
                        prefill_batch_size=max(len(prompts), 1))
    t0 = time.perf_counter()
    bg.insert(prompts, max_tokens=[gen] * len(prompts))
    n, first = 0, None
    while True:
        resps = bg.next_generated()
        if not resps:
            break
        now = time.perf_counter()
        first = first or now
        n += len(resps)
    end = time.perf_counter()
    bg.close()
    return {"tokens": n, "wall": end - t0, "ttft": first - t0}


def guarded(fn, *args) -> dict:
    """Run a peer arm; one that fails (out of device memory prefilling many long prompts at once, an error
    inside mlx-lm) is recorded as failed with its reason, a result in its own right, never a crash of the bench."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 (the reason is the result)
        mx.clear_cache()
        return {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}


def late_joiner_stall(model, tokenizer, *, chunk: int = 256, chunks: int = 4, vocab: int = 8192,
                      joiners: int = 3) -> dict:
    """A row decodes; joiners with ``chunks`` x ``chunk`` prompt tokens arrive one after another.
    Returns, per joiner, the running row's largest inter-token gap while that joiner prefilled, next
    to the gap before the joins and the mean time of one prefill iteration (one chunk) and of the
    whole prompt: the scheduler promises a stall of at most one chunk (plus the decode step and the
    joiner's first-token step), not the whole prompt. The engine is warmed up first, as `mlxb serve`
    does; every joiner's stall is kept, and the last one is the headline."""
    import threading

    eng = Engine(model, tokenizer, max_batch=2, prefill_chunk=chunk)
    warm_up(eng)  # as `mlxb serve` does before traffic
    eng.start()
    try:
        runner = Request(f"stall-run-{time.perf_counter_ns()}", _prompts(1, 32, vocab, 7)[0], 100_000, ignore_eos=True)
        st = OutputStream(runner.request_id)
        stamps: list[float] = []
        eng.submit(runner, st)

        def read():
            for out in st:
                if out.token is not None:
                    stamps.append(time.perf_counter())

        th = threading.Thread(target=read, daemon=True)
        th.start()
        while len(stamps) < 20:
            time.sleep(0.005)
        t0_join = None
        windows, timings = [], []
        for j in range(joiners):
            time.sleep(0.15)
            eng.runner.timing.clear()
            joiner = Request(f"stall-join-{time.perf_counter_ns()}",
                             _prompts(1, chunk * chunks + 1, vocab, 9 + j)[0], 2, ignore_eos=True)
            js = OutputStream(joiner.request_id)
            t_submit = time.perf_counter()
            t0_join = t0_join or t_submit
            eng.submit(joiner, js)
            next(o for o in js if o.token is not None)
            t_first = time.perf_counter()
            list(js)
            windows.append((t_submit, t_first))
            timings.append(dict(eng.runner.timing))
        time.sleep(0.2)
        eng.cancel(runner.request_id)
        th.join(10)
    finally:
        eng.shutdown()
    before = [b - a for a, b in zip(stamps, stamps[1:]) if b < t0_join]
    per = []
    for (ts, tf), tm in zip(windows, timings):
        during = [b - a for a, b in zip(stamps, stamps[1:]) if b > ts and a < tf]
        iters = tm.get("prefill_iterations", 0) or 1
        per.append({"max_gap_during_s": max(during) if during else None, "joiner_ttft_s": tf - ts,
                    "prefill_iterations": int(tm.get("prefill_iterations", 0)),
                    "mean_chunk_prefill_s": tm.get("prefill_s", 0.0) / iters, "whole_prefill_s": tm.get("prefill_s", 0.0)})
    last = per[-1]
    return {"chunk": chunk, "joiner_prompt": chunk * chunks + 1, **last,
            "median_gap_before_s": statistics.median(before[-10:]) if before else None,
            "joiners": per, "running_row_tokens": len(stamps)}


def run(model, tokenizer, *, batches=(1, 2, 4, 8), prompt_len=64, gen=128, repeats=3, prefill_len=512,
        progress: Optional[Callable[[str], None]] = None, compile_decode: bool = False, skinny: bool = False,
        fused: bool = False, served: Optional[tuple[str, str]] = None, prefill_chunk: int = 2048,
        prefill_burst: Optional[int] = None) -> dict:
    """``fused``: each aggregate arm (B=1 included) also runs our engine with ``--fuse-projections`` on the same
    prompts, right after the plain one (rows ``aggregate_fused[_ragged]_over_plain``).
    ``skinny``: each aggregate arm at B >= ``MLXB_SKINNY_MIN_ROWS`` (2 unless set) also runs our engine with
    ``--skinny-matmul`` on the same prompts (rows ``aggregate_skinny_tps`` against mlx-lm and
    ``aggregate_skinny_over_plain``; CUDA only); at 1, B=1 decode arms too (``b1_decode_skinny_tps``,
    ``b1_skinny_over_plain``).
    ``compile_decode``: a second engine of ours with ``--compile-decode`` joins the B=1 decode arms
    (rows ``b1_decode_compiled_tps`` against mlx-lm and ``b1_compiled_over_plain`` against our plain step)
    and the aggregate arms (``aggregate_compiled_over_plain[_ragged]``).
    ``served``: (base URL, model id) of a running ``mlxb serve`` on the same folder; each B=1 repeat also
    sends its prompt there, first and last (served, ours, peer, peer, ours[, skinny, skinny], served), and
    rows ``b1_served_*`` give served over our in-process engine (``mlxb.bench.served``).
    ``prefill_chunk`` / ``prefill_burst``: our engine's prefill budget (serve's ``--prefill-step-size`` /
    ``--prefill-burst``); mlx-lm's BatchGenerator prefills each arm's prompts as one batch."""
    vocab = int(getattr(model.args, "vocab_size", 8192))
    engine = Engine(model, tokenizer, max_batch=max(batches), prefill_chunk=prefill_chunk, prefill_burst=prefill_burst)
    warm_up(engine)
    engine.start()
    comp = None
    if compile_decode:
        comp = Engine(model, tokenizer, max_batch=max(2, max(batches)), compile_decode="all")
        warm_up(comp)
        comp.start()
    freeze_heap()  # as `mlxb serve` does; both arms run in this process and share it
    say = progress or (lambda s: None)
    rows: list[dict] = []
    try:
        warm = _prompts(2, prompt_len, vocab, 99)  # ours is warmed by warm_up above
        peer_batch(model, warm, 8)
        peer_single(model, tokenizer, warm[0], 8)
        if comp is not None:  # its first trace and buffer growth, untimed
            ours(comp, [warm[0]], gen)
        if served is not None:
            from mlxb.bench.served import served_single

            served_single(*served, warm[0], gen)  # untimed: the server's first request
        pw = _prompts(1, prefill_len, vocab, 98)[0]  # the prefill metric's shapes, once per arm
        ours(engine, [pw], 2)
        peer_single(model, tokenizer, pw, 2)
        big = max(batches)
        shapes = [(B, False) for B in batches] + ([(big, True)] if big > 1 else [])
        for B, ragged in shapes:  # every shape each arm will meet, once, untimed
            say(f"warm-up B={B}{' ragged' if ragged else ''}")
            ps = _prompts(B, prompt_len, vocab, 5000 + B, ragged)
            ours(engine, ps, gen)
            guarded(peer_batch, model, ps, gen)
            if skinny and B >= skinny_min_rows():
                with skinny_on(model):
                    ours(engine, ps, gen)
            if fused:
                with fused_on(model):
                    ours(engine, ps, gen)
        for rep in range(repeats):
            p1 = _prompts(1, prompt_len, vocab, rep)[0]
            say(f"repeat {rep + 1}/{repeats}: B=1 decode")
            s1 = served_single(*served, p1, gen) if served is not None else None
            # ours, peer, peer, ours: a drift in machine speed within the repeat hits both arms alike
            a1, b1, b2, a2 = (ours(engine, [p1], gen), peer_single(model, tokenizer, p1, gen),
                              peer_single(model, tokenizer, p1, gen), ours(engine, [p1], gen))
            if skinny and skinny_min_rows() <= 1:  # lone rows on the skinny kernel too: its B=1 arms, after ours
                with skinny_on(model):
                    k1 = ours(engine, [p1], gen)
                    k2 = ours(engine, [p1], gen)
                kd = (k1["decode"] + k2["decode"]) / 2
                rows.append({"metric": "b1_decode_skinny_tps", "B": 1, "repeat": rep, "ours": kd,
                             "peer": (b1["decode"] + b2["decode"]) / 2, "peer_name": "mlx_lm.stream_generate"})
                rows.append({"metric": "b1_skinny_over_plain", "B": 1, "repeat": rep, "ours": kd,
                             "peer": (a1["decode"] + a2["decode"]) / 2, "peer_name": "mlxb plain step"})
            if served is not None:  # served over in-process, same prompt and tokens, bracketing our arms
                s2 = served_single(*served, p1, gen)
                for name, key in (("b1_served_decode_tps", "decode"), ("b1_served_decode_from1_tps", "decode_from1")):
                    if key in s1:
                        rows.append({"metric": name, "B": 1, "repeat": rep, "ours": (s1[key] + s2[key]) / 2,
                                     "peer": (a1[key] + a2[key]) / 2, "peer_name": "mlxb in-process"})
                rows.append({"metric": "b1_served_request_per_s", "B": 1, "repeat": rep,
                             "ours": 2 / (s1["wall"] + s2["wall"]), "peer": 2 / (a1["wall"] + a2["wall"]),
                             "peer_name": "mlxb in-process"})
            rows.append({"metric": "b1_decode_tps", "B": 1, "repeat": rep, "ours": (a1["decode"] + a2["decode"]) / 2,
                         "peer": (b1["decode"] + b2["decode"]) / 2, "peer_name": "mlx_lm.stream_generate"})
            if gen > 2:  # the same runs from token 1: token 0 is sent before step 1 by us, after it by mlx-lm
                rows.append({"metric": "b1_decode_from1_tps", "B": 1, "repeat": rep,
                             "ours": (a1["decode_from1"] + a2["decode_from1"]) / 2,
                             "peer": (b1["decode_from1"] + b2["decode_from1"]) / 2, "peer_name": "mlx_lm.stream_generate"})
            rows.append({"metric": "b1_request_per_s", "B": 1, "repeat": rep,  # 1 / (submit to last token)
                         "ours": 2 / (a1["wall"] + a2["wall"]), "peer": 2 / (b1["wall"] + b2["wall"]),
                         "peer_name": "mlx_lm.stream_generate"})
            if comp is not None:  # compiled, plain, peer, peer, plain, compiled: interleaved as above
                c1, d1, e1, e2, d2, c2 = (ours(comp, [p1], gen), ours(engine, [p1], gen),
                                          peer_single(model, tokenizer, p1, gen), peer_single(model, tokenizer, p1, gen),
                                          ours(engine, [p1], gen), ours(comp, [p1], gen))
                cd, pd = (c1["decode"] + c2["decode"]) / 2, (d1["decode"] + d2["decode"]) / 2
                rows.append({"metric": "b1_decode_compiled_tps", "B": 1, "repeat": rep, "ours": cd,
                             "peer": (e1["decode"] + e2["decode"]) / 2, "peer_name": "mlx_lm.stream_generate"})
                rows.append({"metric": "b1_compiled_over_plain", "B": 1, "repeat": rep, "ours": cd, "peer": pd,
                             "peer_name": "mlxb plain step"})
            pp = _prompts(1, prefill_len, vocab, 100 + rep)[0]
            a, b = ours(engine, [pp], 2), peer_single(model, tokenizer, pp, 2)
            rows.append({"metric": "prefill_tps", "B": 1, "repeat": rep, "ours": prefill_len / a["ttft"],
                         "peer": prefill_len / b["ttft"], "peer_name": "mlx_lm.stream_generate"})
            for B, ragged in shapes:
                say(f"repeat {rep + 1}/{repeats}: aggregate B={B}{' ragged' if ragged else ''}")
                ps = _prompts(B, prompt_len, vocab, 1000 * rep + B, ragged)
                a, b = ours(engine, ps, gen), guarded(peer_batch, model, ps, gen)
                assert a["tokens"] == B * gen and b.get("tokens", B * gen) == B * gen, (a, b)
                if skinny and B >= skinny_min_rows():  # the same engine with the skinny products, same prompts
                    with skinny_on(model):
                        c = ours(engine, ps, gen)
                    sfx = "_ragged" if ragged else ""
                    rows.append({"metric": "aggregate_skinny" + sfx + "_tps", "B": B, "repeat": rep,
                                 "ours": c["tokens"] / c["wall"], "peer": b["tokens"] / b["wall"],
                                 "peer_name": "mlx_lm.BatchGenerator"})
                    rows.append({"metric": "aggregate_skinny_over_plain" + sfx, "B": B, "repeat": rep,
                                 "ours": c["tokens"] / c["wall"], "peer": a["tokens"] / a["wall"],
                                 "peer_name": "mlxb plain step"})
                if fused:  # the same engine with q/k/v and gate/up fused, same prompts
                    with fused_on(model):
                        c = ours(engine, ps, gen)
                    rows.append({"metric": "aggregate_fused" + ("_ragged" if ragged else "") + "_over_plain", "B": B,
                                 "repeat": rep, "ours": c["tokens"] / c["wall"], "peer": a["tokens"] / a["wall"],
                                 "peer_name": "mlxb plain step", "fused_step_timing": c["timing"]})
                if comp is not None and B > 1:  # the compiled batch step against our plain one, same prompts
                    c = ours(comp, ps, gen)
                    rows.append({"metric": "aggregate_compiled_over_plain" + ("_ragged" if ragged else ""), "B": B,
                                 "repeat": rep, "ours": c["tokens"] / c["wall"], "peer": a["tokens"] / a["wall"],
                                 "peer_name": "mlxb plain step"})
                rows.append({"metric": "aggregate_ragged_tps" if ragged else "aggregate_tps", "B": B, "repeat": rep, "ours": a["tokens"] / a["wall"],
                             "peer": b["tokens"] / b["wall"] if "failed" not in b else None, "peer_name": "mlx_lm.BatchGenerator",
                             "peer_failed": b.get("failed"), "ours_wall_s": a["wall"], "peer_wall_s": b.get("wall"),
                             "ours_all_first_s": a["all_first_s"], "peer_first_s": b.get("ttft"), "ours_step_timing": a["timing"]})
    finally:
        engine.shutdown()
        if comp is not None:
            comp.shutdown()
    summary = summarize(rows)
    say("late-joiner stall")
    try:
        stall = late_joiner_stall(model, tokenizer, chunk=min(256, max(16, prefill_len // 4)), vocab=vocab)
    except Exception as e:  # keep the throughput results
        stall = {"error": repr(e)}
    try:
        peak = mx.get_peak_memory()
    except Exception:
        peak = None
    return {"rows": rows, "summary": summary, "peak_memory_bytes": peak, "late_joiner_stall": stall,
            "config": {"batches": list(batches), "prompt_len": prompt_len, "gen": gen, "repeats": repeats,
                       "prefill_len": prefill_len, "compile_decode": compile_decode, "skinny_matmul": skinny,
                       "fuse_projections": fused, "served": served is not None,
                       "prefill_step_size": prefill_chunk, "prefill_burst": engine.scheduler.prefill_burst}}


def summarize(rows: list[dict]) -> list[dict]:
    """Per (metric, B): medians and the ratio's min / median / max over repeats. Repeats whose peer arm failed
    count apart (``peer_failed``, with the first reason); their ours-side figures still count."""
    for r in rows:
        r["ratio"] = r["ours"] / r["peer"] if r.get("peer") else None
    summary = []
    for key in sorted({(r["metric"], r["B"]) for r in rows}):
        sel = [r for r in rows if (r["metric"], r["B"]) == key]
        rs = [r["ratio"] for r in sel if r["ratio"] is not None]
        peer_v = [r["peer"] for r in sel if r.get("peer")]
        failed = [r["peer_failed"] for r in sel if r.get("peer_failed")]
        summary.append({"metric": key[0], "B": key[1], "ours_median": statistics.median(r["ours"] for r in sel),
                        "peer_median": statistics.median(peer_v) if peer_v else None,
                        "ratio_min": min(rs) if rs else None, "ratio_median": statistics.median(rs) if rs else None,
                        "ratio_max": max(rs) if rs else None,
                        **({"peer_failed": len(failed), "peer_failed_reason": failed[0]} if failed else {})})
    return summary


@contextlib.contextmanager
def fused_on(model):
    """The model's q/k/v and gate/up projections fused for the block (``mlxb.models.fuse``)."""
    from mlxb.models.fuse import fuse, unfuse

    fuse(model)
    try:
        yield
    finally:
        unfuse(model)


def skinny_min_rows() -> int:
    """The fewest rows ``--skinny-matmul`` takes (``MLXB_SKINNY_MIN_ROWS``; 2 unless set)."""
    from mlxb.kernels import skinny

    return skinny.MIN_ROWS


@contextlib.contextmanager
def skinny_on(model):
    """The model's plain Linear layers on the skinny kernel for the block (the mlx-lm arms never see it)."""
    from mlxb.kernels import skinny

    skinny.install(model)
    try:
        yield
    finally:
        skinny.uninstall(model)
