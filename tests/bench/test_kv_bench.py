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
