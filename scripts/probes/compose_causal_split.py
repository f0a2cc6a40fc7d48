"""Composition check of mlxb.kernels.causal_split on the CPU (forced in): greedy lookup speculation with the split
in the verify attention gives plain decoding's tokens on a model folder (e.g. an mlx_lm.convert -q folder; head_dim 64),
full-width KV and KV8, lone rows and B=3 with joins. Counts the calls the split took.

    python scripts/probes/compose_causal_split.py FOLDER
"""
import sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import mlx.core as mx
from mlx_lm import load
from mlxb.cache.kv_plan import KVScheme
from mlxb.spec.verify import SpecConfig
from mlxb.kernels import causal_split
from tests.tiny.test_spec import run, repetitive_prompts, tokens

model, tok = load(sys.argv[1])
prompts = repetitive_prompts()
spec = SpecConfig("lookup", 4, 3, max_batch=8, adaptive=False)
calls = {"split": 0}
orig_split = causal_split.split_causal
def counted(*a, **k):
    calls["split"] += 1
    return orig_split(*a, **k)
causal_split.split_causal = counted
assert causal_split.install(force=True) is not None
try:
    for kv in (None, KVScheme(8, 32, 0)):
        for batch, arrive in ((1, [0, 0, 0, 0]), (3, [0, 0, 2, 5])):
            kw = {"kv_scheme": kv} if kv else {}
            plain, _ = run(model, tok, prompts, arrive, batch, 24, **kw)
            before = calls["split"]
            sp, eng = run(model, tok, prompts, arrive, batch, 24, spec=spec, **kw)
            same = [tokens(a) == tokens(b) for a, b in zip(plain, sp)]
            c = eng.runner.spec_counts
            print(f"kv={'KV8 gs32' if kv else 'full'} B={batch}: tokens equal {same}, drafted {c['drafted']} "
                  f"accepted {c['accepted']}, split calls {calls['split'] - before}")
            assert all(same)
finally:
    causal_split.uninstall()
