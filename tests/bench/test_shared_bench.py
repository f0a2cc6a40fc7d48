"""`mlxb bench shared`: both sharing arms against copies on the same prompts, ratios per arm."""

from mlxb.bench.shared import run, summarize
from mlxb.cache.protocol import layer_kinds


def test_shared_bench_arms_hold_fewer_bytes_than_copies_and_the_default_arm_fewest():
    from mlxb.models import load_model

    model, _, _, _ = load_model("tiny-llama", "bfloat16")  # half precision: the float32 copy of the values exists
    rows = run(model, layer_kinds(model), rows=3, prefix=96, own=4, gen=3, plain_rows=2, plain_len=16, repeats=1,
               share_min=16, f32_arm=True, seed=5)
    assert {(r["cell"], r["arm"]) for r in rows} == {("fleet", "shared"), ("fleet", "copies"), ("fleet", "shared-f32"),
                                                     ("unshared", "shared"), ("unshared", "copies"),
                                                     ("b1", "shared"), ("b1", "copies")}
    fleet = {r["arm"]: r for r in rows if r["cell"] == "fleet"}
    assert fleet["shared"]["rows_sharing"] == fleet["shared-f32"]["rows_sharing"] == 3
    # the default prefix is stored once; --share-f32-values adds a float32 copy of its values
    assert fleet["copies"]["kv_bytes"] > fleet["shared-f32"]["kv_bytes"] > fleet["shared"]["kv_bytes"]
    summ = {s["cell"]: s for s in summarize(rows)}
    assert set(summ) == {"fleet", "fleet (shared-f32)", "unshared", "b1"}
    assert summ["fleet"]["kv_ratio_median"] > summ["fleet (shared-f32)"]["kv_ratio_median"] > 1.0
    assert summ["unshared"]["kv_ratio_median"] == 1.0  # nothing in common: the same bytes
