"""How long llguidance takes to compute one row's mask for a forced tool call, a regex and a small schema, over
tiny-llama's tokenizer, each stepped through 80 random allowed tokens. A probe, not a benchmark."""
import time, random, numpy as np, llguidance
from mlxb.models import load_model
from mlxb.constrain.grammar import Grammars
from mlxb.constrain.tools import ToolFormat
from mlxb.bench.datasets import AGENT_TOOLS
_, tok, _, _ = load_model("tiny-llama", lazy=True)
g = Grammars(tok, len(tok._tokenizer), sorted(tok.eos_token_ids))
print("vocab", g.n_vocab)
fmt = ToolFormat.of(tok)
grams = {"forced": g.tool_calls(AGENT_TOOLS, fmt, None, False, "x"),
         "regex": g.from_regex("(ab |cd ){400,}", "r"),
         "schema": g.from_schema({"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}, "s")}
rng = random.Random(0)
for name, gr in grams.items():
    m = llguidance.LLMatcher(g.tokenizer, gr, log_level=0)
    ts = []
    for step in range(80):
        t = time.perf_counter(); bm = m.compute_bitmask(); ts.append(time.perf_counter() - t)
        bits = np.unpackbits(np.frombuffer(bm, dtype=np.uint8), bitorder="little")[:g.n_vocab]
        allowed = np.flatnonzero(bits)
        allowed = [a for a in allowed if a not in g.eos_ids] or list(allowed)
        if not allowed or m.is_stopped(): break
        m.consume_token(int(rng.choice(allowed)))
    ts = np.array(ts) * 1e3
    print(f"{name}: steps {len(ts)} median {np.median(ts):.3f} ms p90 {np.percentile(ts,90):.3f} max {ts.max():.2f}")
