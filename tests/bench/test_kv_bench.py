"""`mlxb bench kv`: admission ratios from the engine's own projection, decode ratios from both arms."""

from mlxb.bench.kv import run


def test_kv_bench_counts_rows_and_measures_both_arms(tiny_models):
    model, tok, _, _ = tiny_models("tiny-llama")
    seen = []
    res = run(model, tok, bits=(8, 4), group_size=32, batches=(2,), context=24, gen=6, repeats=1, admit_context=512,
              on_row=seen.append)
    assert seen == res["rows"] and len(seen) == 2  # each measurement reported as it is taken
    adm = {r["scheme"]: r for r in res["admission"]}
    assert adm["full"]["ratio_vs_full"] == 1.0
    assert adm["kv4"]["rows_admitted"] > adm["kv8"]["rows_admitted"] > adm["full"]["rows_admitted"]
    assert {(r["B"], r["scheme"]) for r in res["summary"]} == {(2, "kv8"), (2, "kv4")}
    assert all(r["full_tps"] > 0 and r["quant_tps"] > 0 for r in res["summary"])


def test_a_peer_arm_that_fails_is_a_recorded_result_not_a_crash():
    """Issue 46: mlx-lm's BatchGenerator ran out of device memory prefilling 32 long prompts and the bench died;
    such an arm is now a row with the reason, and ours still counts."""
    from mlxb.bench.engine import guarded, summarize

    def oom(*a):
        raise RuntimeError("[metal::malloc] Attempting to allocate 40 GB which is greater than the maximum")

    failed = guarded(oom, 1, 2)
    assert failed["failed"].startswith("RuntimeError: [metal::malloc]")
    assert guarded(lambda x: {"tokens": x}, 3) == {"tokens": 3}
    rows = [{"metric": "aggregate_tps", "B": 32, "repeat": 0, "ours": 100.0, "peer": None, "peer_failed": failed["failed"]},
            {"metric": "aggregate_tps", "B": 32, "repeat": 1, "ours": 110.0, "peer": 50.0},
            {"metric": "aggregate_tps", "B": 8, "repeat": 0, "ours": 40.0, "peer": 20.0}]
    by = {r["B"]: r for r in summarize(rows)}
    assert by[32]["peer_failed"] == 1 and "malloc" in by[32]["peer_failed_reason"]
    assert by[32]["ours_median"] == 105.0 and by[32]["ratio_median"] == 2.2 and by[32]["peer_median"] == 50.0
    assert by[8]["ratio_median"] == 2.0 and "peer_failed" not in by[8]
    only_failed = summarize(rows[:1])
    assert only_failed[0]["ratio_median"] is None and only_failed[0]["peer_median"] is None


def test_bench_engine_runs_our_engine_at_the_prefill_budget_it_is_given(tiny_models, monkeypatch):
    """`bench engine --prefill-step-size/--prefill-burst`: our engine is built with that budget (serve's flags), the
    result's config records it, and a prompt longer than the step is prefilled over several iterations."""
    from mlxb.bench import engine as bench_engine

    made = []

    class Recorded(bench_engine.Engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(bench_engine, "Engine", Recorded)
    model, tok, _, _ = tiny_models("tiny-llama")
    res = bench_engine.run(model, tok, batches=(2,), prompt_len=40, gen=4, repeats=1, prefill_len=32,
                           prefill_chunk=16, prefill_burst=24)
    ours = made[0]
    assert (ours.scheduler.prefill_chunk, ours.scheduler.prefill_burst) == (16, 24)
    assert res["config"]["prefill_step_size"] == 16 and res["config"]["prefill_burst"] == 24
    assert {r["metric"] for r in res["rows"]} >= {"aggregate_tps", "b1_decode_tps"}
    default = bench_engine.run(model, tok, batches=(2,), prompt_len=8, gen=2, repeats=1, prefill_len=8)
    assert default["config"]["prefill_step_size"] == 2048 and default["config"]["prefill_burst"] == 8 * 2048
