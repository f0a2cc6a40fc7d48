"""A lone row paused after ``MISS_LIMIT`` lookups that found nothing drafts again as soon as its (free) shadow
lookups find drafts that hold, instead of sitting out the whole pause; the output stays that of plain decoding."""

import numpy as np

from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.request import Request
from mlxb.spec.control import COOLDOWN, StepCost
from mlxb.spec.verify import SpecConfig

GAP = (10, 16)  # generated-token counts over which lookups find nothing


class FixedCost(StepCost):
    """A verify step costs one plain step here whatever the clock says (the bar opens on evidence alone)."""

    def ratio_at(self, rows, aligned=False):
        return 1.0

    def stale_at(self, rows):
        return False


class Script:
    """Right drafts (the row's greedy continuation), except while the row has generated GAP tokens: nothing."""

    shadows = True

    def __init__(self, full, n0):
        self.full, self.n0 = full, n0

    def propose(self, history, k):
        n = history.shape[0]
        if GAP[0] <= n - self.n0 < GAP[1] or list(history) != self.full[:n]:
            return []
        return self.full[n : n + k]


def _run(model, tok, prompt, n, spec=None, proposer=None):
    eng = Engine(model, tok, max_batch=2, prefill_chunk=64, spec=spec)
    if proposer is not None:
        eng.runner.proposer, eng.runner.step_cost = proposer, FixedCost()
    r = Request("p", prompt, n, ignore_eos=True)
    st = OutputStream(r.request_id)
    eng.accept(r, st)
    while eng._live:
        eng.iterate()
    out = []
    while not st._q.empty():
        x = st._q.get()
        if hasattr(x, "request_id") and x.token is not None:
            out.append(x.token)
    return out, eng


def test_a_paused_row_drafts_again_once_its_shadow_lookups_hold(tiny_models):
    model, tok = tiny_models("tiny-llama")[:2]
    prompt = np.random.default_rng(3).integers(5, 8000, size=20).tolist()
    plain, _ = _run(model, tok, prompt, 60)
    spec = SpecConfig("lookup", 4, 3, max_batch=8)  # adaptive
    got, eng = _run(model, tok, prompt, 60, spec, Script(prompt + plain, len(prompt)))
    assert got == plain
    why = [w[0] for w in eng.runner.step_cost.trace]
    assert "paused" in why, why  # the empty lookups paused the row
    first = why.index("paused")
    resumed = next(i for i in range(first, len(why)) if why[i] == "verify")
    # the pause began at the 4th empty lookup (token 15); drafts hold again from token 16: a few plain
    # steps later it verifies, where the whole pause is COOLDOWN plain steps
    assert why[first:resumed].count("paused") <= COOLDOWN // 2, why
