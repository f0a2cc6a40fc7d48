"""What the speculation controller decides at a verify cost you choose. A diagnostic, not a benchmark.

Usage: python scripts/spec_decisions.py MODEL --batch 32 --misses 0,0.1,0.3,1.0,mixed [--cost 2.0] [--repeats 2]

The controller's choices depend on the measured cost of a verify step (``StepCost``), which on a CPU is what a
compute-bound [B, K+1] forward costs (5-10 plain steps: it rightly stays plain) and on a GPU about two. This pins
that cost (and the mask penalty, and no stale probes) so the decisions a GPU would see can be read on any machine:
per miss rate (the replay proposer, ``mlxb.bench.spec.ReplayProposer``; ``mixed``: even rows 10% of drafts wrong,
odd rows every one wrong, a stand-in for rows that copy text beside rows that do not), the steps by decision and the
drafts made and kept. Throughput here means nothing (the forwards are this machine's).
"""

from __future__ import annotations

import argparse
import collections

from mlxb.bench.kv import _decode_tps
from mlxb.bench.spec import ReplayProposer, greedy_tails, prompts_for
from mlxb.engine.engine import Engine
from mlxb.engine.warmup import warm_up
from mlxb.models import load_model
from mlxb.spec import control as C
from mlxb.spec.verify import SpecConfig


class Mixed:
    """Two replay proposers over disjoint rows: each row drafts from whichever knows its reference."""

    shadows = True

    def __init__(self, a, b):
        self.a, self.b = a, b

    def propose(self, history, k):
        return self.a.propose(history, k) or self.b.propose(history, k)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--misses", default="0,0.1,0.3,1.0,mixed")
    ap.add_argument("--cost", type=float, default=2.0, help="a verify step's cost in plain steps (pinned)")
    ap.add_argument("--k", type=int, default=8, help="--num-draft-tokens")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    C.StepCost.ratio_at = lambda self, rows, aligned=False: a.cost
    C.StepCost.penalty_at = lambda self, rows: 1.0
    C.StepCost.stale_at = lambda self, rows: False
    model, tok, _, _ = load_model(a.model)
    vocab = int(getattr(model.args, "vocab_size", 8192))
    plain = Engine(model, tok, max_batch=a.batch, prefill_chunk=2048)
    auto = Engine(model, tok, max_batch=a.batch, prefill_chunk=2048,
                  spec=SpecConfig(method="lookup", num_draft_tokens=a.k, max_batch=max(64, a.batch)))
    for e in (plain, auto):
        warm_up(e)
        e.start()
    try:
        for miss in a.misses.split(","):
            for rep in range(a.repeats):
                prompts = prompts_for("random", a.batch, a.context, vocab, seed=5 + rep)
                refs = [p + t for p, t in zip(prompts, greedy_tails(plain, prompts, a.gen + a.k + 2))]
                if miss == "mixed":
                    prop = Mixed(ReplayProposer(refs[0::2], 0.1, vocab, seed=rep), ReplayProposer(refs[1::2], 1.0, vocab, seed=rep))
                else:
                    prop = ReplayProposer(refs, float(miss), vocab, seed=rep)
                auto.runner.proposer = prop
                auto.runner.step_cost.trace.clear()
                c0 = dict(auto.runner.spec_counts)
                _decode_tps(auto, prompts, a.gen, 2048)
                why = collections.Counter(t[0] for t in auto.runner.step_cost.trace)
                c = auto.runner.spec_counts
                print(f"B={a.batch} miss={miss} repeat={rep} cost={a.cost} steps={dict(why)} "
                      f"drafted={c['drafted'] - c0.get('drafted', 0)} kept={c['accepted'] - c0.get('accepted', 0)}", flush=True)
    finally:
        for e in (plain, auto):
            e.shutdown()


if __name__ == "__main__":
    main()
