"""A shared golden (tokens from another machine) that disagrees on a token where this machine's live
mlx-lm oracle passes the same case is superseded (reported), never anything else."""

from mlxb.parity.compare import CaseResult, RowResult, supersede_shared


def shared_fail(label="tiny-llama-bf16 lora-b2", what="token", geo=([35, 0], [35, 0]), missing=0):
    r = CaseResult(label, "golden:shared")
    row = RowResult(0, steps=12, tokens_only=4, missing=missing)
    row.first_divergence = {"step": 4, "what": what, "ours_geometry": geo[0], "ref_geometry": geo[1],
                            "ours_token": 5688, "ref_token": 3959}
    r.rows = [row, RowResult(1, steps=12, tokens_only=12)]
    return r


def live(label="tiny-llama-bf16 lora-b2", ok=True):
    r = CaseResult(label, "live")
    row = RowResult(0, steps=12, exact=12 if ok else 3)
    if not ok:
        row.first_divergence = {"step": 3, "what": "logits"}
    r.rows = [row]
    return r


def test_live_pass_supersedes_a_shared_token_divergence():
    s = shared_fail()
    assert not s.ok
    notes = supersede_shared([live(), s])
    assert s.ok and s.superseded and "row 0 step 4: 5688 here, 3959" in s.superseded
    assert len(notes) == 1 and "golden-gen" in notes[0]
    assert s.to_dict()["superseded"] == s.superseded


def test_nothing_else_is_superseded():
    cases = [
        ([live(ok=False)], shared_fail()),  # the live oracle fails too
        ([], shared_fail()),  # no live run (--against golden)
        ([live()], shared_fail(geo=([35, 0], [36, 0]))),  # the cache geometry differs
        ([live()], shared_fail(what="cache geometry")),
        ([live()], shared_fail(missing=1)),  # steps missing
        ([live("other case")], shared_fail()),  # another case's live result
    ]
    for lives, s in cases:
        assert supersede_shared(lives + [s]) == [] and not s.ok and s.superseded is None
    m = shared_fail()
    m.against = "golden:machine"  # this machine's own goldens are never overruled
    assert supersede_shared([live(), m]) == [] and not m.ok
