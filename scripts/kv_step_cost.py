"""One decode step at B rows of ``context`` tokens: full-width batch KV against KV8 and KV4 (and, on CUDA,
KV8/KV4 read by the fused kernel of ``--kv-attention fused``; where mlx-lm's read is trusted, also KV8/KV4
read the other way: ``-mlxlm`` arms (``MLXB_KV_READ=mlx-lm``) where the default folds, as on the CPU, or
``-folded`` arms (``MLXB_KV_READ=folded``) elsewhere), on the model's
own forward (no engine, no prefill in the timing). On the CPU, where quantized reads are split across
streams, also KV8/KV4 on one stream (``MLXB_KV_SPLIT=1``). One row is prefilled and copied into B rows; the arms
are timed in interleaved rounds of 8 steps, each step synchronized.

    python scripts/kv_step_cost.py MODEL_DIR B CONTEXT [GROUP_SIZE]
"""
import os, sys, time, json, statistics
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlxb.models import load_model
from mlxb.cache.protocol import AlignedBatchKVCache
from mlxb.cache.quantized import quantize_batch
from mlxb.cache.quantized_read import kv_reads
from mlxb.kernels.quantized_attention import fused_available, set_kv_attention
from mlxb.kernels.quantized_paths import broadcast_exact, fold_reads
m, tok, spec, _ = load_model(sys.argv[1]); B = int(sys.argv[2]); ctx = int(sys.argv[3])
print("kv reads", kv_reads(), "| mlx-lm's grouped-query read trusted:", broadcast_exact(), flush=True)
ids = mx.random.randint(3, 8000, (ctx,))
c = make_prompt_cache(m)
t0 = time.perf_counter()
for s in range(0, ctx, 2048):
    m(ids[s:s + 2048][None], cache=c); mx.eval([x.state for x in c])
print("prefill s", time.perf_counter() - t0, flush=True)
full = [AlignedBatchKVCache.merge([x] * B) for x in c]
for x in full: x.aligned = True
mx.eval([x.state for x in full])
arms = {"full": full}
for bits in (8, 4):
    arms[f"kv{bits}"] = [quantize_batch(x, int(sys.argv[4]) if len(sys.argv) > 4 else 64, bits) for x in full]
    for x in arms[f"kv{bits}"]: x.aligned = True
    mx.eval([x.keys for x in arms[f"kv{bits}"]])
if fused_available():  # the same packed caches read through the fused kernel (--kv-attention fused)
    for bits in (8, 4):
        arms[f"kv{bits}-fused"] = arms[f"kv{bits}"]
if broadcast_exact():  # mlx-lm's read is right here: the folded one against it, whichever is the default
    for bits in (8, 4):
        arms[f"kv{bits}-{'mlxlm' if fold_reads() else 'folded'}"] = arms[f"kv{bits}"]
from mlxb.kernels.split_read import split_parts
if split_parts() > 1:  # CPU reads split across streams (the default there): also one stream, MLXB_KV_SPLIT=1
    for bits in (8, 4):
        arms[f"kv{bits}-onestream"] = arms[f"kv{bits}"]
del c
tokens = mx.zeros((B, 1), dtype=mx.uint32)
res = {k: [] for k in arms}
def mode(k):
    os.environ["MLXB_KV_READ"] = "folded" if k.endswith("folded") else "mlx-lm" if k.endswith("mlxlm") else "auto"
    os.environ["MLXB_KV_SPLIT"] = "1" if k.endswith("onestream") else "auto"
    set_kv_attention("fused" if k.endswith("fused") else "mlx-lm")  # also makes the caches' reads be marked again
for k, cs in arms.items():
    mode(k)
    for _ in range(3): mx.eval(m(tokens, cache=cs))
for rnd in range(int(os.environ.get("ROUNDS", 3))):
    for k, cs in arms.items():
        mode(k)
        t0 = time.perf_counter()
        for _ in range(8): mx.eval(m(tokens, cache=cs))
        res[k].append((time.perf_counter() - t0) / 8)
    print(rnd, {k: round(v[-1] * 1e3, 2) for k, v in res.items()}, flush=True)
out = {k: {"ms_per_step": statistics.median(v) * 1e3, "tok_s": B / statistics.median(v)} for k, v in res.items()}
for k in out: out[k]["ratio_vs_full"] = out["full"]["ms_per_step"] / out[k]["ms_per_step"]
print(json.dumps({"B": B, "context": ctx, "model": spec.name, "arms": out}))
