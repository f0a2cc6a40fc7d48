"""The ``replay`` regime of ``mlxb bench spec``: the proposer replays each row's own greedy continuation with a
seeded share of wrong tokens, so the acceptance follows ``replay_miss``: all drafts kept at 0, none at 1."""

import numpy as np
import pytest

from mlxb.bench.spec import ReplayProposer, run
from mlxb.spec.verify import SpecConfig


def test_replay_proposes_the_reference_with_seeded_misses_and_stops_off_it():
    ref = list(range(100, 140))
    p = ReplayProposer([ref], miss=0.0, vocab=1000)
    assert p.propose(np.array(ref[:20]), 4) == ref[20:24]
    assert p.propose(np.array(ref[:38]), 4) == ref[38:40]  # the reference's end
    assert p.propose(np.array(ref[:40]), 4) == []
    off = np.array(ref[:19] + [7])  # the row left its reference
    assert p.propose(off, 4) == []
    assert p.propose(np.array(list(range(16)) + [5]), 4) == []  # an unknown row
    all_wrong = ReplayProposer([ref], miss=1.0, vocab=1000)
    assert all(a != b for a, b in zip(all_wrong.propose(np.array(ref[:20]), 4), ref[20:24]))
    half = ReplayProposer([ref], miss=0.5, vocab=1000, seed=3)
    got = half.propose(np.array(ref[:20]), 8)
    assert got == half.propose(np.array(ref[:20]), 8)  # seeded: the same misses at the same positions
    assert 0 < sum(a != b for a, b in zip(got, ref[20:28])) < 8


@pytest.mark.full
def test_replay_regime_acceptance_follows_the_miss_rate(tiny_models):
    model, tok = tiny_models("tiny-llama")[:2]
    spec = SpecConfig("lookup", 4, 3, max_batch=8, adaptive=False)
    acc = {}
    for miss in (0.0, 1.0):
        res = run(model, tok, spec=spec, batches=(2,), regimes=("replay",), context=48, gen=16, repeats=1,
                  replay_miss=miss)
        (s,) = res["summary"]
        assert s["regime"] == "replay" and s["drafted"] > 0 and res["config"]["replay_miss"] == miss
        acc[miss] = s["acceptance"]
    assert acc[0.0] > 0.9 and acc[1.0] == 0.0


def test_sweep_summary_names_the_best_fixed_k_and_floors_it_at_plain():
    from mlxb.bench.spec_sweep import summarize

    def row(arm, ratio, miss=0.1, drafted=10, accepted=5):
        return {"B": 8, "repeat": 0, "miss": miss, "arm": arm, "ratio": ratio, "drafted": drafted, "accepted": accepted}

    rows = [row("auto", 1.2), row("fixed2", 1.3), row("fixed4", 1.5), row("plain", None),
            row("auto", 0.99, 1.0), row("fixed2", 0.6, 1.0), row("fixed4", 0.4, 1.0)]
    hi, lo = sorted(summarize(rows), key=lambda r: r["miss"])
    assert hi["best_fixed"] == "fixed4" and hi["auto_vs_best"] == pytest.approx(1.2 / 1.5)
    assert hi["arms"]["auto"]["acceptance"] == 0.5
    # every fixed K loses at P=1: the best choice is not to speculate, so the controller is held to plain
    assert lo["best_fixed"] == "fixed2" and lo["auto_vs_best"] == pytest.approx(0.99)
    # an arm that failed (out of device memory at this B) is counted, not ranked, and the rest still compare
    failed = [row("fixed8", None, 0.3), row("fixed8", None, 0.3), row("fixed2", 1.1, 0.3), row("auto", 1.05, 0.3)]
    (mid,) = [r for r in summarize(rows + failed) if r["miss"] == 0.3]
    assert mid["arms"]["fixed8"] == {"ratio_median": None, "failed": 2}
    assert mid["best_fixed"] == "fixed2" and mid["auto_vs_best"] == pytest.approx(1.05 / 1.1)


@pytest.mark.full
def test_sweep_runs_every_arm_at_every_miss(tiny_models):
    from mlxb.bench.spec_sweep import sweep

    model, tok = tiny_models("tiny-llama")[:2]
    parts = []
    res = sweep(model, tok, spec=SpecConfig(num_draft_tokens=3, max_batch=4), fixed=(2,), misses=(0.0, 1.0),
                batches=(2,), context=48, gen=12, repeats=1, checkpoint=parts.append)
    # a run cut short keeps what it measured: the result so far after each repeat, then the whole
    assert len(parts) == 1 and not parts[0]["complete"] and parts[0]["rows"] == res["rows"] and res["complete"]
    arms = {(r["miss"], r["arm"]) for r in res["rows"]}
    assert arms == {(m, a) for m in (0.0, 1.0) for a in ("plain", "auto", "fixed2")}
    fixed = {r["miss"]: r for r in res["rows"] if r["arm"] == "fixed2"}
    assert fixed[0.0]["accepted"] == fixed[0.0]["drafted"] > 0 and fixed[1.0]["accepted"] == 0
    # every arm records its device memory: its peak covers at least what stays in use after it
    assert all(r["peak_gb"] > 0 and r["peak_gb"] >= r["active_gb"] >= 0 and r["pool_gb"] >= 0 for r in res["rows"])
    # and every arm after the first starts from an empty pool of free buffers (what one arm left behind ran the
    # next out of device memory on the H100); the first arm follows the untimed reference tails
    assert any(r["pool_gb"] > 0 for r in res["rows"])
    assert all(r["pool_start_gb"] == 0 for r in res["rows"][1:])
    # the untimed warm arm's verify times (first-shape compiles on a GPU) are not what the timed arms start from
    auto = [r for r in res["rows"] if r["arm"] == "auto"]
    assert auto[0]["verify_samples_at_start"] == 0
