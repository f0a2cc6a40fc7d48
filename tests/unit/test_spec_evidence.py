"""The speculation controller under the every-row rule without a model: every row of a large batch gets
evidence from shadow drafts soon, and one unlucky check does not hold a well-accepting batch plain (split from
test_spec_control.py)."""

import numpy as np

from mlxb.spec.verify import SpecConfig


def test_every_row_of_a_large_batch_gets_shadow_evidence_soon():
    """Under the every-row rule a row without evidence keeps its batch plain, so shadow drafts must reach every
    row: rows without evidence are looked up first, up to one in SHADOW_SPREAD of the batch a step. Picking one
    row a step by ``step % free rows`` left rows of 32 without evidence for 98 steps (the sweep's replay
    proposer, every draft right), and the batch never verified. Once every row has evidence, one lookup a step."""
    from types import SimpleNamespace as NS

    from mlxb.spec.control import SHADOW_SPREAD
    from mlxb.spec.verify import LookupProposer, RowSpec, shadow

    block = list(range(11, 27))
    rows = [NS(spec=RowSpec(4, 4, np.array(block * 3)), tokens=[]) for _ in range(32)]
    r = NS(rows=rows, num_steps=0)
    lookup = LookupProposer(3)
    looked = []
    for step in range(4 * 32 // SHADOW_SPREAD + 8):
        r.num_steps = step
        before = sum(1 for w in rows if w.spec.shadow)
        shadow(r, lookup)
        looked.append(sum(1 for w in rows if w.spec.shadow) - before)
        for w in rows:
            w.tokens.append(block[step % len(block)])  # every row goes on copying the block
    assert all(w.spec.evidence > 0 for w in rows)
    assert max(looked) <= 32 // SHADOW_SPREAD
    r.num_steps += 1
    settled = [w for w in rows if not w.spec.shadow]
    shadow(r, lookup)
    assert sum(1 for w in settled if w.spec.shadow) <= 1  # all have evidence: one lookup a step again


def test_one_unlucky_check_does_not_hold_a_well_accepting_batch_plain():
    """A row's estimate is drawn toward the batch's pooled acceptance (POOL_W draft positions): one check that
    failed at its first draft puts a row that shares the batch's 0.9 at 0.42 on its own, under a cost of two
    plain steps, which under the every-row rule held a batch of 32 such rows plain. Drawn toward the pool it clears
    the bar; a row whose drafts keep failing at once is judged by its own evidence and still holds the batch."""
    from types import SimpleNamespace as NS

    from mlxb.spec.control import gain, pooled_alpha
    from mlxb.spec.verify import RowSpec, StepCost, pays

    cost = StepCost()
    cost.observe(True, 0.020, rows=32)
    for _ in range(StepCost.REFILL + 1):
        cost.observe(False, 0.010, rows=32)

    def row(checks):
        st = RowSpec(8, 8)
        for n, a in checks:
            st.learn(n, a)
        return NS(spec=st)

    good = [(8, 8), (8, 6), (8, 8)]
    rows = [row(good) for _ in range(31)]
    unlucky = row([(8, 0)])
    batch = NS(spec=SpecConfig(), rows=rows + [unlucky], step_cost=cost)
    pool = pooled_alpha(batch.rows)
    assert gain(unlucky.spec) < cost.ratio_at(32) <= gain(unlucky.spec, pool)
    assert pays(batch)
    hopeless = row([(8, 0)] * 8)
    assert not pays(NS(spec=SpecConfig(), rows=rows + [hopeless], step_cost=cost))


def test_a_verify_step_slower_than_any_kept_cost_is_not_sampled():
    """A first verify step at a new shape compiles (1-3 s on a GPU against ~10 ms plain steps). Kept as the
    only sample it read as the cap (33 plain steps) and held the batch plain until a probe ~1,000 steps later;
    dropped, the next verify step (compiled) measures the real cost."""
    from mlxb.spec.verify import MIN_GAIN, StepCost

    cost = StepCost()
    for _ in range(6):
        cost.observe(False, 0.010, rows=8)
    cost.observe(True, 2.4, rows=8)  # the compile
    for _ in range(StepCost.REFILL + 2):
        cost.observe(False, 0.010, rows=8)
    assert cost.ratio_at(8) == MIN_GAIN and cost.dropped == 1  # as if no verify step had been measured
    cost.observe(True, 0.022, rows=8)
    for _ in range(StepCost.REFILL + 2):
        cost.observe(False, 0.010, rows=8)
    assert abs(cost.ratio_at(8) - 2.2) < 1e-9


def test_a_row_with_shadow_drafts_is_held_by_the_bar_not_paused():
    """A pause reset the row to the starting guess (0.7), so every pause of a row whose drafts were all wrong
    ended in another verify step that failed: 7 in 64 tokens for a lone row (an H100 sweep: 0.91x plain).
    Where shadow drafts check a row for free, it is not paused: it keeps its low estimate (the bar holds its
    batch plain) and shadow checks that hold bring it back at once. A proposer without shadows (a draft model)
    still pauses and then probes at the guess."""
    from mlxb.spec.control import ALPHA0, RowSpec, gain

    shadowed, drafted = RowSpec(8, 8), RowSpec(8, 8)
    for st, shadows in ((shadowed, True), (drafted, False)):
        st.learn(8, 0)
        st.adapt(8, 0, 1.7, shadows=shadows)
        assert st.k == 8
    assert shadowed.cooldown == 0 and shadowed.alpha < 0.3 and gain(shadowed) < 1.7
    assert drafted.cooldown > 0 and drafted.alpha == ALPHA0 and gain(drafted) > 1.7
    for _ in range(2):  # two shadow checks in which 5 of 8 held: drafting pays again
        shadowed.learn(8, 5)
    assert gain(shadowed) > 1.7
