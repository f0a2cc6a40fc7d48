"""Would folding a LoRA adapter's shrink into the base product help on a CPU? One projection at B=8 (synth-llama-30m
shapes, float32, rank 8): the base product alone, mlx-lm's order (``x @ W.T + s * ((x @ A) @ B)``, the engine's exact
path for rows sharing one adapter) and the concatenated form (``x @ [W; A.T].T``, then the base columns plus the
expand of the rest); median microseconds of 400 evaluations, and whether the results are bit-equal.
Run it with OpenBLAS preloaded (LD_PRELOAD=.../libopenblas.so.0) and without.

    python3 scripts/probes/lora_concat_probe.py
"""
import time, statistics, mlx.core as mx
mx.random.seed(0)
def t(f, n=400):
    for _ in range(20): mx.eval(f())
    ts=[]
    for _ in range(n):
        a=time.perf_counter(); mx.eval(f()); ts.append(time.perf_counter()-a)
    return statistics.median(ts)*1e6
B,r,s=8,8,2.0
for (o,i) in ((512,512),(256,512),(1536,512),(512,1536)):
    x=mx.random.normal((B,1,i)); W=mx.random.normal((o,i))*0.02; A=mx.random.normal((i,r))*0.02; Bm=mx.random.normal((r,o))*0.02
    Wc=mx.concatenate([W,A.T],0); Wv=Wc[:o]; mx.eval(x,W,A,Bm,Wc,Wv)
    base=lambda: x@W.T
    exact=lambda: x@W.T + s*((x@A)@Bm)
    def cat():
        out=x@Wc.T
        return out[..., :o] + s*(out[..., o:]@Bm)
    y1=exact(); y2=cat(); yb=x@Wv.T
    print((o,i),"base %.1f exact %.1f concat %.1f us"%(t(base),t(exact),t(cat)),
          "bit-equal:", mx.array_equal(y1,y2).item(), "base-part-equal:", mx.array_equal((x@Wc.T)[..., :o], x@W.T).item(), mx.array_equal(yb, x@W.T).item())
