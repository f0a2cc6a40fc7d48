"""LoRA adapters per row against the base and against a fused adapter, on our engine in one process.

Arms, each an aggregate decode tok/s at B rows (``mlxb.bench.kv._decode_tps``), interleaved per repeat:

* ``base``: the model with the adapters installed, every row without one (a forward skips all LoRA work);
* ``mixed``: the same engine, rows cycling through N adapters (one forward gathers each row's factors);
* ``one``: every row with adapter 0;
* ``fused``: adapter 0 fused into the weights by mlx-lm (``LoRALinear.fuse``), no adapter machinery.

Ratios: mixed / base (the cost of serving N adapters at once), one / fused (the cost of per-row LoRA
against a model made for that one adapter) and mixed / fused (N adapters at once against a model with no
adapter machinery, which costs what a server without adapters does; where the adapter path fuses the base's
projections, base rows can run faster than that).
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from mlxb.bench.kv import _decode_tps
from mlxb.engine.engine import Engine
from mlxb.engine.warmup import warm_up


def _fused(source: str, folder: str):
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.utils import load_adapters

    from mlxb.models.registry import load_model

    m, tok, *_ = load_model(source)
    load_adapters(m, folder)
    fused = [(n, mod.fuse()) for n, mod in m.named_modules() if hasattr(mod, "fuse")]
    m.update_modules(tree_unflatten(fused))
    mx.eval(m.parameters())  # made here: the engine thread cannot evaluate this thread's pending arrays
    return m, tok


def run(source: str, *, adapters: int = 4, rank: int = 8, batches=(8, 32), context: int = 256, gen: int = 64,
        repeats: int = 2, prefill_chunk: int = 2048, progress: Optional[Callable[[str], None]] = None,
        lora_path: Optional[str] = None) -> dict:
    from mlxb.adapters.lora import install, read_adapter
    from mlxb.models.adapters import ensure_adapters
    from mlxb.models.registry import load_model

    say = progress or (lambda s: None)
    folders = ensure_adapters(source, None, f"bench:{source}",
                              [{"seed": 100 + i, "rank": rank, "num_layers": -1} for i in range(adapters)])
    model, tok, *_ = load_model(source)
    ctx = install(model, [read_adapter(f"a{i}", f) for i, f in enumerate(folders)], lora_path=lora_path)
    fmodel, ftok = _fused(source, folders[0])
    # NOTE: warmed on this thread before they start, as `mlxb serve` does: on the H200 the lora engine's
    # first prefill on its fresh thread failed (mx.array from a list: "cudaMemcpy ... invalid argument")
    lora = Engine(model, tok, max_batch=max(batches), prefill_chunk=prefill_chunk)
    fused = Engine(fmodel, ftok, max_batch=max(batches), prefill_chunk=prefill_chunk)
    for e in (lora, fused):
        warm_up(e)
        e.start()
    vocab = int(getattr(model.args, "vocab_size", 8192))
    rng = np.random.default_rng(0)
    rows = []
    try:
        for B in batches:
            ps = [rng.integers(3, vocab - 1, size=context).tolist() for _ in range(B)]
            arms = {"base": (lora, [-1] * B), "mixed": (lora, [i % adapters for i in range(B)]),
                    "one": (lora, [0] * B), "fused": (fused, None)}
            for k, (e, slots) in arms.items():
                say(f"warm-up {k} B={B}")
                _decode_tps(e, ps, 8, prefill_chunk, slots)
            for rep in range(repeats):
                say(f"repeat {rep + 1}/{repeats}: B={B}")
                order = list(arms) + list(reversed(arms))  # each arm twice, mirrored, so drift hits all
                got: dict = {k: [] for k in arms}
                for k in order:
                    e, slots = arms[k]
                    got[k].append(_decode_tps(e, ps, gen, prefill_chunk, slots))
                tps = {k: sum(v) / len(v) for k, v in got.items()}
                rows.append({"B": B, "repeat": rep, **{f"{k}_tps": v for k, v in tps.items()},
                             "mixed_vs_base": tps["mixed"] / tps["base"], "one_vs_fused": tps["one"] / tps["fused"],
                             # against a model with no adapter machinery (what a server without adapters runs)
                             "mixed_vs_fused": tps["mixed"] / tps["fused"]})
    finally:
        lora.shutdown()
        fused.shutdown()
    summary = []
    for B in batches:
        rs = [r for r in rows if r["B"] == B]
        summary.append({"B": B, **{f"{k}_tps": statistics.median(r[f"{k}_tps"] for r in rs)
                                   for k in ("base", "mixed", "one", "fused")},
                        **{f"{q}_{f.__name__}": f(r[q] for r in rs) for q in ("mixed_vs_base", "one_vs_fused", "mixed_vs_fused")
                           for f in (min, statistics.median, max)}})
    return {"rows": rows, "summary": summary,
            "config": {"lora_path": ctx.path, "concat_kernel": ctx.cat_kernel, "adapters": adapters, "rank": rank, "batches": list(batches), "context": context, "gen": gen,
                       "repeats": repeats, "prefill_chunk": prefill_chunk, "model": source,
                       "window": "all rows decoding"}}
