"""Where a lone row's step time goes when steps are chained without reading (mlx-lm's model and KVCache,
no engine): per step, the host time to build the graph, the time ``mx.async_eval`` takes, and the time
to read the step before it, for one-token steps and [1, 1+K] verify forwards (the input of each step is
the unread argmax of the one before, as ``mlxb.spec.ahead`` chains them), each pipelined (launch
t+1, then read t) and synchronized (launch t, read t). Answers: does launching a step wait for the one in
flight, and what does the host spend on a verify graph against a one-token one; on CUDA also with the split
attention and the skinny matmul (attention weights, then every weight); with q/k/v and gate/up fused
(``--fuse-projections``). Prints and writes JSON.

    python3 scripts/probes/verify_pipeline_probe.py MODEL --out probe.json [--context 512] [--k 4] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxb.kernels import causal_split, skinny
from mlxb.models.fuse import fuse, unfuse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    model, _ = load(a.model)
    vocab = model.args.vocab_size
    prompt = mx.random.randint(0, vocab, (1, a.context), key=mx.random.key(0))
    drafts = mx.random.randint(0, vocab, (1, a.k), key=mx.random.key(1)).astype(mx.uint32)

    def arm(width: int, pipelined: bool) -> dict:
        cache = make_prompt_cache(model)
        mx.eval(model(prompt, cache=cache))
        tok = mx.array([[7]], dtype=mx.uint32)
        build, launch, read, wall = [], [], [], []
        prev = None
        for i in range(a.steps + 3):
            t0 = time.perf_counter()
            x = tok if width == 1 else mx.concatenate([tok, drafts], axis=1)
            logits = model(x, cache=cache)
            choice = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
            t1 = time.perf_counter()
            mx.async_eval(choice)
            t2 = time.perf_counter()
            if pipelined:
                if prev is not None:
                    prev.tolist()
            else:
                choice.tolist()
            t3 = time.perf_counter()
            prev, tok = choice, choice[:, -1:]
            if i >= 3:  # first shapes compile
                build.append(t1 - t0), launch.append(t2 - t1), read.append(t3 - t2), wall.append(t3 - t0)
        mx.eval(prev)
        ms = lambda v: round(1000 * statistics.median(v), 3)  # noqa: E731
        return {"width": width, "pipelined": pipelined, "build_ms": ms(build), "async_eval_ms": ms(launch),
                "read_ms": ms(read), "step_ms": ms(wall)}

    rows = []
    cuda = causal_split.available()
    arms = [(False, "none"), (False, "fused")] + ([(True, "none"), (True, "fused"), (True, "skinny"), (True, "skinny-all")]
                                                   if cuda else [])
    for split, sk in arms:
        if split:
            causal_split.install()
        if sk == "fused":
            fuse(model)
        elif sk != "none":
            skinny.MAX_WEIGHT = 4096 * 4096 if sk == "skinny" else 1 << 40  # skinny-all: the MLP weights too
            if not skinny.install(model):
                print("skinny took no weight")
        for width in (1, 1 + a.k):
            for pipelined in (False, True):
                r = {"split": split, "skinny": sk, **arm(width, pipelined)}
                rows.append(r)
                print(r, flush=True)
        skinny.uninstall(model)
        unfuse(model)
        causal_split.uninstall()
    json.dump({"model": a.model, "context": a.context, "k": a.k, "device": str(mx.default_device()),
               "mlx": mx.__version__, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
