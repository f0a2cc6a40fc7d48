"""The speculation controller without a model: the verify cost measured per batch size from steady
plain steps, the bar a batch must clear, pauses, stale-cost probes, shadow drafts and aligned batches
(split from tests/tiny/test_spec.py, which runs the mechanism on the tiny presets)."""

import numpy as np

from mlxb.spec.verify import SpecConfig


def test_pauses_follow_the_verify_cost_measured_on_this_machine():
    """A row pauses when the tokens a verify step should give fall below what a verify step costs in
    plain steps here (median wall times): the same acceptance keeps speculating where a verify step
    costs 1.8 plain steps (an H200) and pauses where it costs 4.7 (a compute-bound CPU); --spec-fixed
    never pauses. A pause resets the draft length to the longest, so the probe after it drafts fully."""
    from mlxb.spec.verify import MIN_GAIN, RowSpec, StepCost

    cost = StepCost()
    assert cost.ratio == MIN_GAIN  # nothing measured yet
    for dt in (0.005, 0.005, 0.5):  # a first-shape compile does not move the median
        cost.observe(True, 1.8 * dt)
        for _ in range(StepCost.REFILL + 1):  # the refill steps after a verify step are not counted
            cost.observe(False, dt)
    assert abs(cost.ratio - 1.8) < 1e-9
    gpu, cpu, fixed = RowSpec(4, 4), RowSpec(4, 4), RowSpec(4, 4, adaptive=False)
    for st, c in ((gpu, cost.ratio), (cpu, 4.7), (fixed, 4.7)):
        st.adapt(4, 2, c)  # alpha 0.68 (2 of 3 tried positions held): a verify step should give 2.65 tokens
    assert gpu.cooldown == 0 and cpu.cooldown > 0 and fixed.cooldown == 0
    assert (gpu.k, cpu.k, fixed.k) == (3, 4, 4)


def test_the_verify_cost_counts_steady_plain_steps_per_batch_size():
    """Plain steps that wait for a whole forward (the two refilling the pipeline after a verify step, one
    that read the pipeline early and found no drafts) are not what a plain step costs: counted, they made
    a verify step look free on the H200. What they take beyond a steady step is the verify step's: it
    broke the pipeline. And a verify step's cost at B=8 says nothing about B=1."""
    from mlxb.spec.verify import MIN_GAIN, StepCost

    cost = StepCost()
    for _ in range(5):
        cost.observe(True, 0.015, rows=8)
        cost.observe(False, 0.003, rows=8)  # launch only (nothing pending to read)
        cost.observe(False, 0.022, rows=8)  # waits for a whole forward
        cost.observe(False, 0.022, rows=8, steady=False)  # looked for drafts, found none
        cost.observe(False, 0.022, rows=8)  # refilling again
        cost.observe(False, 0.022, rows=8)
        for _ in range(3):
            cost.observe(False, 0.0075, rows=8)
    charged = (0.015 + 0.003 + 4 * 0.022 - 5 * 0.0075) / 0.0075  # 9.1 steady plain steps, not 2
    assert abs(cost.ratio_at(8) - charged) < 1e-9 and abs(cost.ratio_at(7) - charged) < 1e-9
    assert cost.ratio_at(1) == MIN_GAIN and cost.ratio_at(16) == MIN_GAIN
    cost.observe(True, 0.011, rows=1)
    for _ in range(StepCost.REFILL + 2):
        cost.observe(False, 0.005, rows=1)  # refill steps as fast as steady ones: nothing charged
    assert abs(cost.ratio_at(1) - 2.2) < 1e-9 and abs(cost.ratio_at(8) - charged) < 1e-9
    back = StepCost()  # verify steps back to back pay no refill; the one before plain steps does
    for _ in range(4):
        back.observe(True, 0.015, rows=8)
    for dt in (0.022, 0.022, 0.0075, 0.0075, 0.0075):
        back.observe(False, dt, rows=8)
    assert abs(back.ratio_at(8) - 2.0) < 1e-9
    for dt in (0.015, 0.022, 0.022, 0.0075):
        back.observe(dt == 0.015, dt, rows=8)
    assert abs(back.ratio_at(8) - 2.0) < 1e-9  # median of verify costs 2, 2, 2, 5.9, 5.9


def test_a_row_whose_draft_length_fell_can_still_clear_the_bar():
    """One rejected block sets a row's draft length to 1; the bar weighs it at the longest draft, so a row
    that accepts well is not held under a cost of 1.9 plain steps that 1 + alpha can never reach."""
    from types import SimpleNamespace as NS

    from mlxb.spec.verify import RowSpec, StepCost, pays

    cost = StepCost()
    cost.observe(True, 0.0095)
    for _ in range(StepCost.REFILL + 1):
        cost.observe(False, 0.005)
    st = RowSpec(4, 4, alpha=0.95)
    st.adapt(4, 0, cost.ratio)  # the first draft failed: alpha 0.52, gain at 4 drafts 2.0 > 1.9: no pause
    assert st.k == 1 and st.cooldown == 0
    assert pays(NS(spec=SpecConfig(), rows=[NS(spec=st)], step_cost=cost))


def test_a_verify_step_runs_only_when_the_whole_batch_gains():
    """Every row of the batch pays for a verify step; one well-accepting row among seven plain ones does
    not make it worth 1.8 plain steps, eight of them do."""
    from types import SimpleNamespace as NS

    from mlxb.spec.verify import RowSpec, StepCost, pays

    cost = StepCost()
    cost.observe(True, 0.009, rows=8)
    for _ in range(StepCost.REFILL + 1):
        cost.observe(False, 0.005, rows=8)
    cost.observe(True, 0.009, rows=1)
    for _ in range(StepCost.REFILL + 1):
        cost.observe(False, 0.005, rows=1)
    good = lambda: NS(spec=RowSpec(4, 4, alpha=0.8, evidence=2))  # noqa: E731
    one = NS(spec=SpecConfig(), rows=[good()] + [NS(spec=None) for _ in range(7)], step_cost=cost)
    eight = NS(spec=SpecConfig(), rows=[good() for _ in range(8)], step_cost=cost)
    alone = NS(spec=SpecConfig(), rows=[good()], step_cost=cost)
    assert not pays(one) and pays(eight) and pays(alone)
    assert pays(NS(spec=SpecConfig(adaptive=False), rows=one.rows, step_cost=cost))  # --spec-fixed


def test_no_row_pays_for_another_rows_drafts(monkeypatch):
    """Half a batch drafting well (forced tool calls copying the schema's JSON) and half not (free text): where a
    verify step costs 2.3 plain steps, the batch stays plain, though the rows' expected tokens average more than that
    (the free rows would decode at 1/2.3 of their speed); the whole batch drafting well verifies. MLXB_SPEC_BATCH=mean
    (the rule before) verifies the mixed batch too."""
    from types import SimpleNamespace as NS

    from mlxb.spec import control
    from mlxb.spec.verify import RowSpec, StepCost, pays

    cost = StepCost()
    cost.observe(True, 0.023, rows=8)
    for _ in range(StepCost.REFILL + 1):
        cost.observe(False, 0.010, rows=8)
    good = lambda: NS(spec=RowSpec(4, 4, alpha=0.95, evidence=4))  # noqa: E731  gain 4.5 tokens a step
    free = lambda: NS(spec=RowSpec(4, 4, alpha=0.05, evidence=4))  # noqa: E731
    mixed = NS(spec=SpecConfig(), rows=[good() for _ in range(4)] + [free() for _ in range(4)], step_cost=cost)
    plain_rows = NS(spec=SpecConfig(), rows=[good() for _ in range(4)] + [NS(spec=None) for _ in range(4)], step_cost=cost)
    every = NS(spec=SpecConfig(), rows=[good() for _ in range(8)], step_cost=cost)
    assert abs(cost.ratio_at(8) - 2.3) < 1e-9
    assert not pays(mixed) and not pays(plain_rows) and pays(every)
    for _ in range(int(StepCost.PROBE * 2.3) + 1):  # the measured cost goes stale: a probe is due
        cost.observe(False, 0.010, rows=8)
    assert cost.stale_at(8) and not pays(plain_rows) and pays(every)  # the probe, too, only where every row gains
    monkeypatch.setattr(control, "BATCH_RULE", "mean")
    assert pays(mixed) and pays(plain_rows) and pays(every)


def test_a_high_verify_cost_is_measured_again_after_a_while():
    """A cost that shut the bar (a first-shape compile, another batch size) does not keep it shut: after
    StepCost.PROBE plain steps one verify step may run and measure it again, for rows expected to gain
    from it (``PROBE_GAIN``), not for rows whose drafts are rarely kept."""
    from types import SimpleNamespace as NS

    from mlxb.spec.verify import RowSpec, StepCost, pays

    cost = StepCost()
    settle(cost, 0.15, 0.005)  # slow verify steps (30 plain steps each), a settled cost
    r = NS(spec=SpecConfig(), rows=[NS(spec=RowSpec(4, 4, alpha=0.9))], step_cost=cost)
    assert cost.ratio > 29 and not pays(r)
    for _ in range(int(StepCost.PROBE * StepCost.SPAN) - StepCost.REFILL - 2):  # a probe waits PROBE x the cost (<= SPAN)
        cost.observe(False, 0.005)
    assert not pays(r)
    cost.observe(False, 0.005)
    assert pays(r)
    hopeless = NS(spec=SpecConfig(), rows=[NS(spec=RowSpec(4, 4, alpha=0.1, evidence=3))], step_cost=cost)
    assert cost.stale and not pays(hopeless)  # shadow drafts kept nothing: no probe for that row
    cost.observe(True, 0.009)  # measured again: 1.8 plain steps now
    assert pays(r) and not cost.stale


def test_shadow_drafts_measure_acceptance_without_a_verify_step():
    """While the bar keeps the batch plain, a row's lookup drafts are checked against the tokens it then
    emits: the prefix that held moves its acceptance estimate (copied text up, shuffled text down), one
    row per step looks drafts up."""
    from types import SimpleNamespace as NS

    from mlxb.spec.verify import LookupProposer, RowSpec, shadow

    block = [11, 12, 13, 14, 15, 16, 17, 18]
    copy = NS(spec=RowSpec(4, 4, np.array(block * 3)), tokens=[])
    other = NS(spec=RowSpec(4, 4, np.array(block * 3)), tokens=[])
    r = NS(rows=[copy, other], num_steps=0)
    lookup = LookupProposer(3)
    rng = np.random.default_rng(0)
    for step in range(16):
        r.num_steps = step
        shadow(r, lookup)
        copy.tokens.append(block[step % 8])  # goes on copying the block
        other.tokens.append(int(rng.choice(block)))  # the block's tokens in a random order
    assert copy.spec.evidence >= 2 and other.spec.evidence >= 2
    assert copy.spec.alpha > 0.9 and other.spec.alpha < 0.3
    assert copy.spec.drafted == 0 and other.spec.drafted == 0  # no verify step ran


def test_an_aligned_batch_speculates_only_on_evidence():
    """An aligned batch (no mask on its steps) loses that with its first verify step: fresh rows (the
    starting guess only) do not open the bar there, rows with measured high acceptance do, and the bar
    includes what a masked step costs over an aligned one. A padded batch waits for evidence too (every
    row would pay for a probe at the guess); a lone row too. That is prompt lookup's rule (shadow drafts
    give evidence for free); a draft model's rows have no check but a verify step, so they probe at the
    guess once, at any batch size, aligned or padded, and their evidence decides after it."""
    from types import SimpleNamespace as NS

    from mlxb.spec.verify import RowSpec, StepCost, pays

    cost = StepCost()
    cost.observe(True, 0.016, rows=8)
    for _ in range(StepCost.REFILL + 1):
        cost.observe(False, 0.008, rows=8, aligned=True)
    for _ in range(3):
        cost.observe(False, 0.010, rows=8)
    assert abs(cost.ratio_at(8, True) - 2.0) < 1e-9 and abs(cost.penalty_at(8) - 1.25) < 1e-9
    layer = NS(aligned=True, holes=None)
    fresh = [NS(spec=RowSpec(4, 4)) for _ in range(8)]
    draft, lookup = NS(shadows=False), NS(shadows=True)
    r = NS(spec=SpecConfig(), rows=fresh, step_cost=cost, merged=True, _geo_layer=0, caches=[layer], proposer=lookup)
    drafted = NS(**{**vars(r), "proposer": draft})
    assert not pays(r)  # guess 2.77 tokens a row, but no evidence
    assert pays(drafted)  # a draft model's fresh rows probe: 2.77 >= 2.0 x 1.25
    layer.aligned = False
    assert not pays(r)  # padded: the mask is paid anyway, but eight rows would pay for a guess
    assert pays(drafted)
    for row in fresh:
        row.spec.learn(4, 0)
        row.spec.learn(4, 0)  # two verify steps kept nothing: alpha 0.25, 1.3 tokens against 1.6 (padded)
    assert not pays(drafted)
    for row in fresh:
        row.spec.alpha, row.spec.evidence = 0.7, 0
    cost.observe(True, 0.016, rows=1)
    for _ in range(StepCost.REFILL + 1):
        cost.observe(False, 0.008, rows=1)
    lone = lambda proposer: NS(spec=SpecConfig(), rows=[NS(spec=RowSpec(4, 4))], step_cost=cost,  # noqa: E731
                               merged=False, proposer=proposer)
    assert pays(lone(draft))  # a draft model's lone row probes at the guess: 2.77 >= 2
    assert not pays(lone(lookup))  # prompt lookup's waits for its shadow drafts
    ev = lone(lookup)
    ev.rows[0].spec.learn(4, 4)
    assert pays(ev)
    for row in fresh:
        row.spec.learn(4, 3)  # alpha 0.74 measured: 3.0 tokens against 1.6 padded
    assert pays(r)
    for row in fresh:
        row.spec.alpha, row.spec.evidence = 0.7, 0
    layer.aligned = True
    for row in fresh:
        row.spec.learn(4, 1)  # alpha 0.62: 2.40 tokens, under 2.0 x 1.25
    assert not pays(r)
    for row in fresh:
        for _ in range(4):
            row.spec.learn(4, 4)  # alpha 0.95: 4.5 tokens
    assert pays(r)


def test_an_aligned_batch_measures_a_stale_cost_again_on_evidence():
    """A first verify step that compiled its shapes (0.5 s) does not shut an aligned batch's bar for good:
    once stale, the cost counts as the default and rows with measured high acceptance speculate."""
    from types import SimpleNamespace as NS

    from mlxb.spec.verify import RowSpec, StepCost, pays

    cost = StepCost()
    cost.observe(True, 0.5, rows=8)
    for _ in range(StepCost.REFILL + 1):
        cost.observe(False, 0.008, rows=8, aligned=True)
    rows = [NS(spec=RowSpec(4, 4, alpha=0.9, evidence=3)) for _ in range(8)]
    r = NS(spec=SpecConfig(), rows=rows, step_cost=cost, merged=True, _geo_layer=0, caches=[NS(aligned=True, holes=None)],
           proposer=NS(shadows=True))
    assert not pays(r)
    for _ in range(int(StepCost.PROBE * StepCost.SPAN) - StepCost.REFILL - 1):
        cost.observe(False, 0.008, rows=8, aligned=True)
    assert cost.stale_at(8) and pays(r)
    for row in rows:
        row.spec.evidence = 0  # the starting guess alone still does not
    assert not pays(r)


def test_lookup_matches_the_reference_search_and_the_history_buffer_follows_the_row():
    """The vectorized lookup (narrowed from the positions of the last token) proposes exactly what the
    oracle's plain search over every n-gram proposes, on short and long histories of small and large
    vocabularies; a row's history buffer equals prompt + emitted tokens as they grow past its size."""
    from mlxb.spec.verify import LookupProposer, RowSpec
    from mlxb.oracle.spec import lookup

    rng = np.random.default_rng(3)
    for _ in range(400):
        vocab = int(rng.choice([2, 5, 50, 8000]))
        h = rng.integers(0, vocab, size=int(rng.integers(0, 700)))
        if rng.random() < 0.3 and h.size > 8:  # a repeated block: long matches
            h = np.concatenate([h, h[: int(rng.integers(1, h.size))]])
        k, n = int(rng.integers(0, 7)), int(rng.integers(1, 6))
        assert LookupProposer(n).propose(h, k) == lookup(h.tolist(), k, n), (k, n)
    h = np.array([1, 2, 3, 5, 2, 3, 7, 1, 2, 3])  # the only 3-gram match starts the history
    assert LookupProposer(3).propose(h, 4) == lookup(h.tolist(), 4, 3) == [5, 2, 3, 7]
    st = RowSpec(4, 4, np.arange(5, dtype=np.int64))
    tokens: list = []
    for step in range(600):
        tokens += rng.integers(0, 99, size=int(rng.integers(1, 4))).tolist()
        if step % 7 == 0:
            assert st.history(tokens).tolist() == list(range(5)) + tokens
    assert st.history([1, 2]).tolist() == [0, 1, 2, 3, 4, 1, 2]  # fewer tokens: another row's list, rebuilt


def test_the_draft_length_shrinks_only_where_a_wider_verify_costs_more(monkeypatch):
    """After a partly kept block the next draft is one longer than what held, where a verify step costs
    more than a plain one (compute-bound, or synchronous where plain steps pipeline); where it costs about one plain step (an H200 at B=8) every
    position is free and the row keeps drafting the longest."""
    from mlxb.spec import control as spec_control
    from mlxb.spec.verify import RowSpec

    monkeypatch.setattr(spec_control, "CHEAP_VERIFY", 0.0)  # MLXB_SPEC_CHEAP_VERIFY=0: always the shrink
    off = RowSpec(4, 4, alpha=0.9)
    off.adapt(4, 1, 1.0)
    assert off.k == 2
    CHEAP_VERIFY = 1.5  # the default
    monkeypatch.setattr(spec_control, "CHEAP_VERIFY", CHEAP_VERIFY)
    cpu, gpu = RowSpec(4, 4, alpha=0.9), RowSpec(4, 4, alpha=0.9)
    cpu.adapt(4, 1, 2.0)  # alpha falls to 0.65: a verify step should still give 2.53 tokens, no pause
    gpu.adapt(4, 1, 1.0)
    assert cpu.k == 2 and gpu.k == 4
    edge = RowSpec(4, 4, alpha=0.9)
    edge.adapt(4, 1, CHEAP_VERIFY + 0.01)
    assert edge.k == 2


def test_acceptance_is_estimated_per_tried_position():
    """Drafts are checked in order and the first miss ends a check, so a long draft keeps far less than its
    per-position acceptance suggests (at 0.9 and 8 drafts, 5.1 of 8 on average). The estimate counts held
    positions over tried ones and lands on the per-position rate, for long and short drafts alike; the kept
    fraction would read 0.64 here and hold a well-accepting row under bars it clears."""
    from mlxb.spec.control import RowSpec

    rng = np.random.default_rng(5)
    for true, n in ((0.9, 8), (0.9, 2), (0.5, 8), (0.0, 8)):
        est = []
        st = RowSpec(n, n)
        for _ in range(400):
            a = 0
            while a < n and rng.random() < true:
                a += 1
            st.learn(n, a)
            est.append(st.alpha)
        mean = float(np.mean(est[20:]))
        assert abs(mean - true) < 0.05, (true, n, mean)


def test_a_probe_waits_longer_where_a_verify_step_costs_more():
    """The period of stale-cost probes scales with the measured cost (PROBE plain steps per plain step a verify
    step costs, up to SPAN): a verify step worth 1.5 plain steps (an H200) is measured again after 192 steps,
    one worth 5 (a 2-core CPU) after 640, so probes stay near 1/PROBE of the decode time."""
    from mlxb.spec.verify import StepCost

    for ratio in (1.0, 1.5, 5.0, 20.0):
        cost = StepCost()
        settle(cost, 0.01 * ratio, 0.01)
        due = StepCost.PROBE * min(max(ratio, 1.0), StepCost.SPAN)
        for _ in range(int(round(due)) - StepCost.REFILL - 2):
            cost.observe(False, 0.01)
        assert not cost.stale, ratio
        cost.observe(False, 0.01)
        assert cost.stale, ratio


def settle(cost, verify_s: float, plain_s: float) -> None:
    """StepCost.SETTLE verify steps of ``verify_s``, each followed by its refill and one steady plain step."""
    from mlxb.spec.verify import StepCost

    for _ in range(StepCost.SETTLE):
        cost.observe(True, verify_s)
        for _ in range(StepCost.REFILL + 1):
            cost.observe(False, plain_s)


def test_a_cost_on_fewer_than_settle_samples_is_measured_again_within_a_few_steps():
    """One verify sample is provisional: on an H100 (synth-llama-8b, B=8) the first timed verify step read 6.9
    plain steps and, with the next probe ~880 steps away, the bar stayed shut for a whole sweep while a fixed K=8
    ran 1.73x plain. Until SETTLE samples the cost is stale after EARLY plain steps (a probe for a row that
    gains); once settled, the slow PROBE period holds again."""
    from types import SimpleNamespace as NS

    from mlxb.spec.verify import RowSpec, StepCost, pays

    cost = StepCost()
    r = NS(spec=SpecConfig(), rows=[NS(spec=RowSpec(8, 8, alpha=0.9))], step_cost=cost)
    for i in range(StepCost.SETTLE):
        cost.observe(True, 0.069 if i == 0 else 0.025, rows=8)  # the first sample high, the next ones true
        for _ in range(StepCost.REFILL + 1):
            cost.observe(False, 0.01, rows=8)
        cost.rows = 8
        if i == 0:
            assert cost.ratio_at(8) > 6 and not pays(NS(**{**vars(r), "rows": r.rows * 8}))
        for _ in range(StepCost.EARLY - StepCost.REFILL - 2):
            cost.observe(False, 0.01, rows=8)
        if i < StepCost.SETTLE - 1:
            assert not cost.stale_at(8)
            cost.observe(False, 0.01, rows=8)
            assert cost.stale_at(8), i  # measured again within EARLY steps
    assert cost.ratio_at(8) < 3  # the median of three: the true cost
    for _ in range(StepCost.EARLY * 4):
        cost.observe(False, 0.01, rows=8)
    assert not cost.stale_at(8)  # settled: the next probe is PROBE x the cost away
