"""The adaptive speculation controller's decisions step by step (``StepCost.trace``), for one prompt
regime and B, over a few rounds on one engine: what decided each step, drafts, kept, seconds, the cost
ratio. Usage: python scripts/spec_trace.py MODEL REGIME:B[,REGIME:B...] [rounds] [gen] [--fixed]."""
import statistics
import sys
from collections import Counter

from mlxb.bench.kv import _decode_tps
from mlxb.bench.spec import prompts_for
from mlxb.engine.engine import Engine
from mlxb.spec.verify import SpecConfig
from mlxb.models.registry import load_model


def main():
    src, combos = sys.argv[1], [(c.split(":")[0], int(c.split(":")[1])) for c in sys.argv[2].split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3][0] != "-" else 3
    gen = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4][0] != "-" else 96
    model, tok, *_ = load_model(src)
    for regime, B in combos:
        print(f"== {regime} B={B}", flush=True)
        one(model, tok, regime, B, rounds, gen)


def one(model, tok, regime, B, rounds, gen):
    eng = Engine(model, tok, max_batch=max(B, 2), prefill_chunk=2048,
                 spec=SpecConfig(max_batch=64, adaptive="--fixed" not in sys.argv)).start()
    plain = Engine(model, tok, max_batch=max(B, 2), prefill_chunk=2048).start()
    vocab = int(model.args.vocab_size)
    try:
        for rnd in range(rounds):
            ps = prompts_for(regime, B, 512, vocab, seed=1000 * rnd + B)
            tp = _decode_tps(plain, ps, gen, 2048)
            eng.runner.step_cost.trace.clear()
            ts = _decode_tps(eng, ps, gen, 2048)
            tr = list(eng.runner.step_cost.trace)
            why = Counter(t[0] for t in tr)
            ver = [t for t in tr if t[0] == "verify"]
            pl = [t for t in tr if t[0] != "verify" and t[1] == B]
            print(f"round {rnd}: plain {tp:.1f} tok/s, spec {ts:.1f} tok/s ({ts / tp:.3f}x); steps {dict(why)}; "
                  f"verify {len(ver)} steps, drafts {sum(t[2] for t in ver)}, kept {sum(t[3] for t in ver)}, "
                  f"median {1000 * statistics.median(t[4] for t in ver) if ver else 0:.2f} ms; "
                  f"other steps median {1000 * statistics.median(t[4] for t in pl) if pl else 0:.2f} ms; "
                  f"ratio at end {tr[-1][5] if tr else 0:.2f}", flush=True)
            for st in "AMH":  # plain steps by the cache's state after them: aligned, masked, holes
                xs = [t[4] for t in pl if t[6] == st]
                if xs:
                    print(f"   plain steps in state {st}: {len(xs)}, median {1000 * statistics.median(xs):.2f} ms", flush=True)
            line = " ".join(f"{t[0][0]}{t[6]}{t[2]}/{t[3]}:{1000 * t[4]:.1f}@{t[5]:.1f}" for t in tr[:160])
            print("  ", line, flush=True)
    finally:
        eng.shutdown()
        plain.shutdown()


if __name__ == "__main__":
    main()
