"""Parity tier: the engine against mlx-lm's batch mode and the committed goldens, plus negative controls."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxb.parity.cases import make_case
from mlxb.parity.plan import plan
from mlxb.parity.protocol import Case, RowSpec

ROOT = Path(__file__).resolve().parents[2]


def mlxb(*args, goldens=None):
    cmd = [sys.executable, "-m", "mlxb.commands.main", *args]
    if goldens is not None:
        cmd += ["--goldens", str(goldens)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, COLUMNS="200"))


def test_plan_pipelined_retire_and_waiting_row():
    c = Case("m", "float32", "leave", 2, 0, [RowSpec([5] * 6, 2, 0), RowSpec([6] * 4, 3, 0), RowSpec([7] * 3, 2, 0)])
    its = plan(c)
    assert [(ch.row, ch.start, ch.end, ch.is_last) for ch in its[0].prefills] == [(0, 0, 5, True), (1, 0, 3, True)]
    assert its[0].forward == [0, 1] and its[0].emits == {0: 1, 1: 1}
    # row 0's last token came from forward 0; forward 1 is its lookahead, then it leaves
    assert its[1].forward == [0, 1] and its[1].emits == {1: 2} and its[1].retire == [0]
    # row 2 waited for the cap and joins after row 0 left
    assert [ch.row for ch in its[2].prefills] == [2] and its[2].forward == [1, 2] and its[2].retire == [1]
    assert its[-1].retire == [2]


def test_cases_are_deterministic_and_distinct():
    a, b = make_case("tiny-llama", "float32", "join", 3), make_case("tiny-llama", "float32", "join", 3)
    assert a.digest() == b.digest()
    assert make_case("tiny-llama", "float32", "join", 3, seed=1).digest() != a.digest()
    ring = make_case("tiny-gemma3", "float32", "ring", 4)
    assert all(len(r.prompt) > 64 for r in ring.rows) and ring.rows[-1].arrive > 0


def test_oracle_imports_no_engine_code():
    code = ("import sys, mlxb.oracle.reference, mlxb.oracle.__main__; "
            "print(any(m.startswith(('mlxb.engine', 'mlxb.cache')) for m in sys.modules))")
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


@pytest.mark.parity  # 6-7 minutes on 2 cores: the parity tier
def test_all_presets_cases_and_b_against_live_oracle_and_goldens():
    r = mlxb("parity", "--all", "--against", "both", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout)
    res = out["results"]
    assert out["ok"] and all(x["ok"] for x in res)
    live = [x for x in res if x["against"] == "live"]
    gold = [x for x in res if x["against"].startswith("golden")]
    # 6 presets x (9 general + special + prefix) cases (+ quant on 2, spec on 3, shared on 5) x B=1..4 x 2 dtypes
    assert len(live) == len(gold) == 592
    assert sum(x["steps"] for x in live) == 17246  # coverage: row-steps incl. burst, prefix, grammar, quant, lora, spec, tools, shared
    # every step bit-exact, except shared-prefix steps, which may pass within the shared case's stated envelope
    assert sum(x["exact"] for x in live) + sum(x["envelope"] for x in live if " shared-" in x["case"]) == \
        sum(x["steps"] for x in live)
    mine = ROOT / "goldens" / out["machine_key"]
    for x in gold:  # this machine's file is used wherever one is committed, the shared layer otherwise
        label, key = x["case"].split()
        want = "golden:machine" if (mine / label / f"{key}.json").exists() else "golden:shared"
        assert x["against"] == want, (x["case"], x["against"])


@pytest.mark.parametrize("fault,case", [("scalar_rope", "join"), ("no_filter_trim", "leave"),
                                        ("double_last_token", "static"), ("always_aligned", "join"),
                                        ("prefix_off_by_one", "prefix"), ("grammar_one_step_late", "grammar"), ("grammar_one_step_late", "tools"),
                                        ("kv_stale_scale", "quant"), ("lora_shift", "lora"),
                                        ("spec_rollback_off_by_one", "spec"), ("shared_offset", "shared"),
                                        ("shared_merge", "shared")])
def test_negative_control_fails(fault, case):
    r = mlxb("parity", "-m", "tiny-llama", "--b", "3", "-c", case, "--against", "both", "--plant-fault", fault)
    assert r.returncode == 1, r.stdout
    assert "FAIL" in r.stdout and "first divergence" in r.stdout


def test_grammar_case_constrains_its_rows_and_leaves_the_others_as_in_join():
    """Rows 0 and 2 follow the regex; the unconstrained rows give the join case's records bit for bit."""
    import re

    from mlxb.models import load_model
    from mlxb.parity.protocol import GRAMMAR_REGEX
    from mlxb.parity.run import run_ours

    _, tok, _, _ = load_model("tiny-llama")
    g, j = make_case("tiny-llama", "float32", "grammar", 4), make_case("tiny-llama", "float32", "join", 4)
    rg, rj = run_ours([g, j])
    for r in range(4):
        a, b = rg["records"][str(r)], rj["records"][str(r)]
        if g.regex(r):
            text = tok.decode([x["t"] for x in a])
            assert re.fullmatch(GRAMMAR_REGEX.replace("{60,}", "*") + "(ab?|cd?)?", text), text  # a prefix of a match
            assert a != b
        else:
            assert a == b


def test_clean_run_of_the_same_cases_passes():
    r = mlxb("parity", "-m", "tiny-llama", "--b", "3", "-c", "join", "-c", "leave", "-c", "static")
    assert r.returncode == 0, r.stdout


@pytest.mark.parity
def test_golden_gen_refuses_overwrite_and_reports_changes(tmp_path):
    g = tmp_path / "g"
    assert mlxb("golden-gen", "-m", "tiny-llama", "--b", "2", "-c", "join", goldens=g).returncode == 0
    again = mlxb("golden-gen", "-m", "tiny-llama", "--b", "2", "-c", "join", goldens=g)
    assert "kept (exists; use --force)" in again.stdout.replace("\n", " ")
    machine = [p for p in g.iterdir() if p.is_dir() and p.name.startswith(("cpu-", "cuda-", "apple-"))][0]
    f = machine / "tiny-llama" / "join-b2.json"
    d = json.loads(f.read_text())
    d["records"]["1"][3]["h"] = "0" * 64  # a golden that disagrees with the engine
    f.write_text(json.dumps(d))
    bad = mlxb("parity", "-m", "tiny-llama", "--b", "2", "-c", "join", "--against", "golden", goldens=g)
    assert bad.returncode == 1 and "row 1: first divergence at step 3 (logits)" in bad.stdout
    fixed = mlxb("golden-gen", "-m", "tiny-llama", "--b", "2", "-c", "join", "--force", goldens=g)
    assert "row 1 step 3: logits changed" in fixed.stdout and "1 CHANGED" in fixed.stdout


def test_missing_golden_is_an_error_not_a_pass(tmp_path):
    r = mlxb("parity", "-m", "tiny-llama", "--b", "2", "-c", "join", "--against", "golden", goldens=tmp_path)
    assert r.returncode == 1 and "no golden" in r.stdout


@pytest.mark.parity
@pytest.mark.parametrize("bits", [8, 4])
def test_quant_oracle_keeps_the_batch_layout_for_rows_padded_against_a_long_one(bits):
    """The ``quant`` oracle runs rows in the batch's own layout (three mlx-lm BatchKVCache lanes for the
    packed values, scales and biases). Joiners padded against a 300-token lead row, where a row's solo
    run differs in the last bits on a CPU BLAS, still match it exactly, geometry included; a stale
    scale after a filter (planted) does not."""
    import numpy as np

    from mlxb.parity.compare import compare
    from mlxb.parity.run import run_oracle, run_ours

    rng = np.random.default_rng(7)
    rows = [RowSpec(rng.integers(5, 8000, size=n).tolist(), 10, a) for n, a in ((300, 0), (9, 20), (25, 23))]
    case = Case("tiny-llama", "float32", "quant", 3, 0, rows, 16, "extend",
                kv={"bits": bits, "group_size": 32, "start": 0})
    (ref,) = run_oracle([case])
    (ours,) = run_ours([case])
    res = compare("long-lead", "live", ours["records"], ref["records"])
    assert res.error is None and res.schedule_mismatch is None
    assert all(r.exact == r.steps == 10 for r in res.rows), res
    assert all(s["g"] is not None for v in ref["records"].values() for s in v)  # geometry is compared
    (bad,) = run_ours([case], faults=frozenset({"kv_stale_scale"}))
    assert any(r.first_divergence is not None for r in compare("bad", "live", bad["records"], ref["records"]).rows)


@pytest.mark.parity
def test_a_case_that_cannot_run_fails_alone_with_its_reason(tmp_path):
    """A case neither side can load (a dtype the preset has not) fails in the oracle and in the engine;
    it is reported with the reason and the next case still runs and passes (before, one such case
    aborted the whole run, as a kernel a backend lacks did on CUDA)."""
    from mlxb.parity.run import parity, run_oracle, target

    good = make_case("tiny-llama", "float32", "join", 2)
    bad = Case("tiny-llama", "int8", "join", 2, 0, good.rows, good.prefill_chunk, good.join_full)
    ref = run_oracle([bad, good])
    assert ref[0]["error"] and ref[0]["records"] is None and ref[1]["records"]
    res = parity(target("tiny-llama", None), [bad, good], "live", tmp_path, "cpu-test")
    assert not res[0].ok and "failed on this case" in res[0].error
    assert res[1].ok and res[1].counts()["exact"] == res[1].counts()["steps"] > 0


def test_spec_plan_settles_verify_steps_with_the_executors_gains():
    """A verify step's gains advance a row by several tokens and retire it at once (no lookahead);
    a plain step retires after the lookahead; a gain past max_tokens is refused."""
    from mlxb.parity.plan import Planner

    c = Case("m", "float32", "spec", 2, 0, [RowSpec([5] * 4, 6, 0), RowSpec([6] * 3, 3, 0)], spec={"ngram": 3, "rows": [4, 0]})
    p = Planner(c)
    it = p.end(p.begin(), {0: 3, 1: 1}, verify=True)  # row 0: two drafts kept + the bonus token
    assert it.forward == [0, 1] and it.emits == {0: 1, 1: 1} and it.gains == {0: 3} and it.retire == []
    it = p.end(p.begin(), {0: 2, 1: 1}, verify=True)  # row 0 reaches 6, row 1 reaches 3: both leave now
    assert it.retire == [0, 1] and p.finished
    p = Planner(c)
    p.end(p.begin(), {0: 1, 1: 1})
    with pytest.raises(ValueError):
        p.end(p.begin(), {0: 5, 1: 1}, verify=True)  # row 0 has 4 tokens left


def test_spec_case_speculates_partly_and_the_oracle_agrees_on_the_rule():
    """The spec case really exercises verification (accepted and rejected drafts, rows without drafts in
    a verify step) and the oracle's written-out lookup proposes what the engine's proposer does."""
    import numpy as np

    from mlxb.spec.verify import HOLE_FRACTION, HOLE_MIN, LookupProposer
    from mlxb.models import load_model
    from mlxb.oracle.spec import lookup
    from mlxb.parity.driver import run_engine
    from mlxb.parity.protocol import SPEC_HOLE_FRACTION, SPEC_HOLE_MIN

    assert (HOLE_MIN, HOLE_FRACTION) == (SPEC_HOLE_MIN, SPEC_HOLE_FRACTION)
    rng = np.random.default_rng(0)
    for _ in range(300):
        h = rng.integers(0, 4, size=int(rng.integers(0, 30)))
        k, n = int(rng.integers(0, 6)), int(rng.integers(1, 5))
        assert LookupProposer(n).propose(h, k) == lookup(h.tolist(), k, n), (h.tolist(), k, n)
    m, tok, _, _ = load_model("tiny-llama", "float32")
    out = run_engine(m, tok, make_case("tiny-llama", "float32", "spec", 4))
    st = out["spec"]
    assert out["schedule_mismatch"] is None
    assert st["verify_steps"] >= 5 and 0 < st["accepted"] < st["drafted"], st


@pytest.mark.parity
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # 40-50 s each
def test_compiled_decode_passes_every_case_on_the_presets_it_serves(dtype):
    """--compile-decode against the same oracle and goldens: every case, B=1..4, exact."""
    r = mlxb("parity", "-m", "tiny-llama", "-m", "tiny-minicpm", "--dtype", dtype, "--b", "1,2,3,4", "--against", "both",
             "--compile-decode", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"], r.stdout[-3000:]
    assert len(out["results"]) >= 150
    # live and this machine's goldens: every row-step exact; the shared layer has no logit hashes (written on
    # another key), so a case this key has no goldens of yet compares tokens and geometry only, every step
    # (the shared-prefix case may pass steps within its stated envelope instead: protocol.SHARED_ENVELOPE)
    envelope = lambda x: x["envelope"] if " shared-" in x["case"] else 0  # noqa: E731
    assert all(x["exact"] + envelope(x) == x["steps"] for x in out["results"] if x["against"] != "golden:shared")
    assert all(x["exact"] + x["tokens_only"] + envelope(x) == x["steps"] for x in out["results"]
               if x["against"] == "golden:shared")
    assert sum(x["against"] == "live" for x in out["results"]) >= len(out["results"]) // 2


def test_compiled_decode_negative_control_fails():
    """A mask that hides the lone row's newest key, planted in the compiled step only: parity fails with
    --compile-decode and, since the plain step never reaches it, passes without it."""
    args = ("parity", "-m", "tiny-llama", "--b", "1,2", "-c", "join", "-c", "leave", "--against", "both",
            "--plant-fault", "compiled_mask_late")
    bad = mlxb(*args, "--compile-decode")
    assert bad.returncode == 1 and "FAIL" in bad.stdout and "first divergence" in bad.stdout, bad.stdout[-2000:]
    assert mlxb(*args).returncode == 0


def test_shared_prefix_case_passes_against_the_oracle_and_its_goldens():
    r = mlxb("parity", "-m", "tiny-llama", "--b", "3", "-c", "shared", "--against", "both", "--json")
    assert r.returncode == 0, r.stdout[-2000:]
    res = json.loads(r.stdout)["results"]
    assert len(res) == 2 and all(x["ok"] and x["steps"] == 32 for x in res)
