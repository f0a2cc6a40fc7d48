"""Many LoRA adapters over one base model, each row of a batch with its own (or none).

Adapters are mlx-lm adapter folders (``adapter_config.json`` + ``adapters.safetensors``, as
``mlx_lm.lora`` writes them). Every base module an adapter touches becomes one ``MultiLoRALinear``
holding all adapters' factors stacked (slot i = adapter i; a slot an adapter does not cover is zero).
Before each forward the engine says which slot each row of the batch uses (``LoRAContext.set``);
the layer gathers each row's A and B and adds ``scale * (x @ A) @ B`` to the base output, in the
order and dtype of mlx-lm's ``LoRALinear``. A forward whose rows use no adapter skips all of it, so
base rows pay nothing. The base weights are shared (plain or quantized ``Linear``s).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxb.errors import ValidationError
from mlxb.kernels import lora_fused


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    scale: float
    weights: dict  # "<module path>.lora_a|lora_b" -> array
    digest: str = ""  # sha256 of adapters.safetensors (names the adapter's prompt-cache namespace)


def read_adapter(name: str, path: str | Path) -> Adapter:
    p = Path(path).expanduser()
    cfg_file, w_file = p / "adapter_config.json", p / "adapters.safetensors"
    if not cfg_file.exists() or not w_file.exists():
        raise ValidationError(f"adapter {name!r}: {p} is not an mlx-lm adapter folder (it needs adapter_config.json "
                              "and adapters.safetensors, as mlx_lm.lora writes them)")
    cfg = json.loads(cfg_file.read_text())
    kind = cfg.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ValidationError(f"adapter {name!r} is a {kind!r} adapter; only LoRA adapters can be served per row "
                              "(fuse it into the model with mlx_lm.fuse and serve that folder)")
    lp = cfg.get("lora_parameters", {})
    weights = mx.load(str(w_file))
    ranks = {int(w.shape[-1]) for k, w in weights.items() if k.endswith(".lora_a")}
    if not ranks:
        raise ValidationError(f"adapter {name!r}: {w_file} holds no lora_a/lora_b weights")
    import hashlib

    digest = hashlib.sha256(w_file.read_bytes()).hexdigest()[:16]
    return Adapter(name, str(p), max(ranks), float(lp.get("scale", 20.0)), weights, digest)


class LoRAContext:
    """Which adapter slot each row of the next forward uses (-1: none)."""

    def __init__(self, names: list[str], paths: Optional[dict] = None, digests: Optional[list[str]] = None):
        self.names = names
        self.paths = paths or {}  # name -> adapter folder
        self.digests = digests or [""] * len(names)
        self.scales: list[float] = [20.0] * len(names)  # each adapter's lora_parameters.scale
        self.ids: Optional[mx.array] = None
        self.one: Optional[int] = None
        self.rank = 0  # every adapter's factors padded to this rank (install)
        self.path = "exact"  # "stacked" / "fused" / "concat" where any projection takes that path (install)
        self.cat_kernel = False  # the concat path's expand runs in one CUDA launch (mlxb.kernels.lora_cat)
        self.cat_kernel_off: Optional[str] = None  # why not, where the concat path runs on CUDA without it
        self._slots: list[int] = []
        self._masks: dict = {}

    def stats(self) -> dict:
        return {"adapters": [{"name": n, "path": self.paths.get(n), "scale": s, "sha256": d}
                             for n, s, d in zip(self.names, self.scales, self.digests)],
                "lora_path": self.path,
                **({"concat_kernel": self.cat_kernel, "concat_kernel_off": self.cat_kernel_off}
                   if self.path == "concat" else {})}

    def slot(self, name: Optional[str]) -> int:
        return -1 if name is None else self.names.index(name)

    def set(self, slots) -> None:
        slots = list(slots)
        self._masks = {}  # built lazily on the calling thread: a pending array must not reach another thread's step
        if slots == self._slots and self._slots:  # a steady batch: keep its row arrays (made from lists, no pending work)
            return
        self.ids = mx.array([max(s, 0) for s in slots], dtype=mx.uint32) if any(s >= 0 for s in slots) else None
        # each row's scale; 0 for a row without an adapter (its factors, slot 0's, then add nothing)
        self.row_scale = mx.array([self.scales[s] if s >= 0 else 0.0 for s in slots], dtype=mx.float32)
        # every row with the same adapter: no gather, one adapter's factors (mlx-lm's LoRALinear exactly)
        self.one = slots[0] if slots and slots[0] >= 0 and all(s == slots[0] for s in slots) else None
        self._slots = slots
        self._row_slots = {}  # made on first use: the fused kernel and the concat kernel read them

    def row_slots(self, x: mx.array) -> mx.array:
        """int32 [rows]: each row's slot (-1: none) for a forward over ``x`` [batch, L, in] (rows batch-major)."""
        per = x.size // x.shape[-1] // len(self._slots)
        r = self._row_slots.get(per)
        if r is None:
            r = self._row_slots[per] = mx.array([s for s in self._slots for _ in range(per)], dtype=mx.int32)
        return r

    def block_mask(self, dtype, width: int) -> mx.array:
        """[rows, 1, adapters * width]: 1 over each row's adapter's block, 0 elsewhere (the concat path's
        selector: its scales are folded into the expand factors)."""
        m = self._masks.get((dtype, width))
        if m is None:
            import numpy as np

            host = np.zeros((len(self._slots), 1, len(self.names) * width), dtype=np.float32)
            for i, s in enumerate(self._slots):
                if s >= 0:
                    host[i, 0, s * width : (s + 1) * width] = 1.0
            m = self._masks[(dtype, width)] = mx.array(host).astype(dtype)
        return m

    def mask(self, dtype) -> mx.array:
        """[rows, 1, adapters * rank]: each row's scale over its adapter's block of the stacked factors,
        zero elsewhere (the stacked path's selector; built once per forward and dtype)."""
        m = self._masks.get(dtype)
        if m is None:
            import numpy as np

            r, host = self.rank, np.zeros((len(self._slots), 1, len(self.names) * self.rank), dtype=np.float32)
            for i, s in enumerate(self._slots):
                if s >= 0:
                    host[i, 0, s * r : (s + 1) * r] = self.scales[s]
            m = self._masks[dtype] = mx.array(host).astype(dtype)
        return m


class MultiLoRALinear(nn.Module):
    def __init__(self, base: nn.Module, ctx: LoRAContext, a: mx.array, b: mx.array, scale: mx.array, group=None,
                 path: Optional[str] = None):
        super().__init__()
        self.base = base
        self._ctx = ctx
        self._group = group  # --tp, over a sharded-to-all layer: x @ A is a partial sum over the ranks
        self.lora_a, self.lora_b, self.lora_scale = a, b, scale  # [n, in, r], [n, r, out], [n]
        self._scales = [float(v) for v in scale.tolist()]
        self._each = [(a[i], b[i]) for i in range(a.shape[0])]  # one adapter's factors: views, sliced once
        cuda = mx.cuda.is_available() and mx.default_device() == mx.gpu
        self._gather = not cuda  # the exact decode path (below)
        kind = _path_for(cuda, a.shape[0] * a.shape[2], b.shape[2], path, a.shape[2], group is None)
        self._fused = kind == "fused"
        self._stacked = kind == "stacked"
        self._scale_arrays: dict = {}  # the fused kernel's per-adapter scales, by promoted dtype
        if self._stacked:  # all adapters' factors side by side, in the base's dtype, each one's B scaled
            n, d_in, r = a.shape
            dt = _compute_dtype(base)
            self._dt = dt
            self._a_cat = a.transpose(1, 0, 2).reshape(d_in, n * r).astype(dt)
            self._b_cat = b.reshape(n * r, b.shape[2]).astype(dt)
            self._one = [(a[i].astype(dt), (self._scales[i] * b[i]).astype(dt)) for i in range(n)]
        self.freeze()

    def tensors(self) -> list:
        """Arrays made here that are no module parameters (evaluated at install, on the loading thread)."""
        out = [t for pair in self._each for t in pair]
        if self._stacked:
            out += [self._a_cat, self._b_cat] + [t for pair in self._one for t in pair]
        return out

    def __call__(self, x):
        y = self.base(x)
        ids = self._ctx.ids
        if ids is None:
            return y
        if ids.shape[0] != x.shape[0]:
            raise RuntimeError(f"LoRA slots for {ids.shape[0]} rows, forward over {x.shape[0]}")
        one = self._ctx.one
        if self._fused and y.dtype == x.dtype and lora_fused.supports(self.lora_a.shape[2], x.size // x.shape[-1]):
            return lora_fused.fused_delta(x, y, self.lora_a, self.lora_b, self._ctx.row_slots(x), self._fused_scales(x))
        if self._stacked and x.dtype == self._dt:
            return self._stacked_delta(x, y, one)
        if one is not None:
            a, b = self._each[one]
            return y + _as(self._scales[one] * (self._sum(x @ a) @ b), x.dtype)
        if x.shape[-2] == 1 and self._gather:  # decode: each row's factors gathered by the matmul
            z = mx.gather_mm(self._sum(mx.gather_mm(x, self.lora_a, rhs_indices=ids)), self.lora_b, rhs_indices=ids)
        else:  # NOTE: a batched matmul over each row's taken factors (the same products): prefill everywhere
            # (CUDA's gather_mm failed to launch at B=8 x L=256 on an 8B model: "invalid argument"), and
            # decode on CUDA, where gather_mm made a B=8 decode forward of synth-llama-8b (rank 16, 224
            # projections) 69 ms against 36 ms for one adapter's plain matmuls (scripts/lora_cost.py);
            # on the CPU gather_mm is the faster one (mixed / base 0.88 against 0.74-0.79 taken)
            z = self._sum(x @ mx.take(self.lora_a, ids, axis=0)) @ mx.take(self.lora_b, ids, axis=0)
        s = self._ctx.row_scale.astype(z.dtype).reshape(-1, *([1] * (z.ndim - 1)))
        return y + _as(s * z, x.dtype)


    def _stacked_delta(self, x, y, one):
        """Three ops per projection, whatever the mix: ``x @ A_all`` (every adapter's shrink at once),
        times the rows' mask, added through ``addmm`` with ``B_all``; one op less when every row uses
        one adapter. Not mlx-lm's rounding (factors in the base's dtype, the scale folded into B), so
        it is CUDA's default only for what the concat path does not take (quantized layers, --tp), where
        per-op cost dominates a decode step (the exact path took about nine ops per projection there) and
        where the batched LoRA matmuls were not bit-exact anyway; ``MLXB_LORA_PATH=exact`` restores the
        exact path."""
        if one is not None:
            a, b = self._one[one]
            return mx.addmm(y, self._sum(x @ a), b)
        return mx.addmm(y, self._sum(x @ self._a_cat) * self._ctx.mask(self._dt), self._b_cat)

    def _fused_scales(self, x: mx.array) -> mx.array:
        dt = mx.result_type(x.dtype, self.lora_a.dtype)  # mlx-lm multiplies z (this dtype) by a Python float
        s = self._scale_arrays.get(dt)
        if s is None:
            s = self._scale_arrays[dt] = mx.array(self._scales, dtype=dt)  # made, not lazy: any thread may read it
        return s

    def _sum(self, xa: mx.array) -> mx.array:
        return xa if self._group is None else mx.distributed.all_sum(xa, group=self._group)


def _compute_dtype(base):
    return base.scales.dtype if hasattr(base, "scales") else base.weight.dtype


def _path_for(cuda: bool, stacked_rank: int, out_dim: int, path: Optional[str] = None, rank: int = 0,
              unsharded: bool = True) -> str:
    """How one projection the concat groups did not take computes its rows' deltas: exact | stacked | fused.
    ``path`` (``--lora-path``; when not given, ``MLXB_LORA_PATH``, else auto; concat counts as auto here). auto
    takes the stacked path on CUDA while all adapters' ranks
    together stay under a quarter of the layer's outputs (so the extra factor reads stay small), else the exact
    path. ``fused`` (``mlxb.kernels.lora_fused``) is asked for by name only: on the H200 it was not reliably
    faster than stacked in the engine (README, LoRA); it needs CUDA and passes a device check at install, and a
    projection it cannot take (rank above its limit, a --tp sharded-to-all input) takes the stacked path."""
    want = path or os.environ.get("MLXB_LORA_PATH") or "auto"
    if want not in LORA_PATHS:
        raise ValidationError(f"LoRA path {want!r}: use one of {', '.join(LORA_PATHS)} (--lora-path or MLXB_LORA_PATH)",
                              param="lora_path")
    if want == "concat":  # what install's concatenated groups did not take
        want = "auto"
    if want == "fused":
        if not lora_fused.available():
            raise ValidationError("--lora-path fused needs MLX's CUDA backend (a CUDA GPU as the default device); "
                                  "use --lora-path exact or stacked here", param="lora_path")
        if rank <= lora_fused.MAX_RANK and unsharded and _fused_checked():
            return "fused"
    if want in ("fused", "stacked") or (want == "auto" and cuda and 4 * stacked_rank <= out_dim):
        return "stacked"
    return "exact"


_FUSED_OK = False  # the fused kernel passed its device check in this process


def _fused_checked() -> bool:
    """The fused kernel's device check, once per process; a kernel that fails it refuses the path."""
    global _FUSED_OK
    if not _FUSED_OK:
        try:
            lora_fused.self_check()
            lora_fused.self_check(mx.bfloat16, mx.float32)
        except ValueError as e:
            raise ValidationError(str(e), param="lora_path") from e
        _FUSED_OK = True
    return True


LORA_PATHS = ("auto", "exact", "stacked", "fused", "concat")


def _cat_kernel(cuda: bool) -> tuple[bool, Optional[str]]:
    """Whether the concat path takes its one-launch expand: on CUDA unless ``MLXB_LORA_CAT_KERNEL=0``, and only
    once the kernel passed its device check in this process (a failure keeps the ``addmm`` and says why in
    ``/stats``)."""
    from mlxb.kernels import lora_cat

    if not cuda:
        return False, None
    if not lora_cat.available():
        return False, "MLXB_LORA_CAT_KERNEL=0"
    try:
        lora_cat.self_check()
    except ValueError as e:
        return False, str(e)
    return True, None


def _pad_rank(la: mx.array, lb: mx.array, r: int) -> tuple[mx.array, mx.array]:
    """One adapter's factors padded with zeros to rank ``r`` (A's columns, B's rows)."""
    a = mx.pad(la, [(0, 0), (0, r - la.shape[1])]) if la.shape[1] < r else la
    b = mx.pad(lb, [(0, r - lb.shape[0]), (0, 0)]) if lb.shape[0] < r else lb
    return a, b


def _as(z: mx.array, dtype) -> mx.array:
    """mlx-lm's ``(scale * z).astype(x.dtype)``, without the op when the dtype already matches (same values)."""
    return z if z.dtype == dtype else z.astype(dtype)


# mlx-lm architectures whose Model.shard() splits every projection into equal contiguous parts
# (no fused segments), so an adapter's factors can be split the same way under --tp
TP_LORA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "ministral3")


def _sharding(base) -> Optional[str]:
    """How ``--tp`` split this linear layer: "out" (all-to-sharded), "in" (sharded-to-all) or None."""
    name = type(base).__name__
    return "out" if "AllToSharded" in name else "in" if "ShardedToAll" in name else None


def _shard_factors(path: str, base, kind: Optional[str], la: mx.array, lb: mx.array) -> tuple[mx.array, mx.array]:
    """This rank's part of an adapter's factors: B's output columns under an all-to-sharded layer, A's
    input rows under a sharded-to-all one (its partial ``x @ A`` is then summed over the ranks)."""
    if kind is None:
        return la, lb
    n, rank = base.group.size(), base.group.rank()
    full, have = (lb.shape[1], base.weight.shape[0]) if kind == "out" else (la.shape[0], la.shape[0] // n)
    if kind == "out" and full != n * have:
        raise ValidationError(f"LoRA on {path}: its factors do not split over --tp {n} like the layer does")
    if kind == "out":
        return la, lb[:, rank * have : (rank + 1) * have]
    if full % n:
        raise ValidationError(f"LoRA on {path}: {full} input features do not split over --tp {n}")
    return la[rank * have : (rank + 1) * have], lb


def install(model: nn.Module, adapters: list[Adapter], max_rank: Optional[int] = None,
            lora_path: Optional[str] = None) -> LoRAContext:
    """Replace every module an adapter touches with a ``MultiLoRALinear`` over all adapters (under
    ``--tp``, on a sharded model: each rank keeps its part of the factors). ``lora_path``: exact | stacked |
    auto | fused | concat. ``concat`` (and auto on CUDA, unsharded) first gives the groups of plain ``Linear``
    layers to ``mlxb.adapters.concat``; every other projection takes its path from ``_path_for``."""
    ctx = LoRAContext([a.name for a in adapters], {a.name: a.path for a in adapters}, [a.digest for a in adapters])
    ctx.scales = [a.scale for a in adapters]
    modules = dict(model.named_modules())
    paths = sorted({k.rsplit(".", 1)[0] for a in adapters for k in a.weights if k.endswith(".lora_a")})
    for a in adapters:
        if max_rank is not None and a.rank > max_rank:
            raise ValidationError(f"adapter {a.name!r} has rank {a.rank}, above --max-lora-rank {max_rank}")
        unknown = [p for p in {k.rsplit(".", 1)[0] for k in a.weights} if p not in modules]
        if unknown:
            raise ValidationError(f"adapter {a.name!r} does not fit this model: no module {unknown[0]!r}")
    r = max(a.rank for a in adapters)
    swaps = []
    want = lora_path or os.environ.get("MLXB_LORA_PATH") or "auto"
    concat = set()
    sharded = any(_sharding(m) for m in modules.values())
    cuda = mx.cuda.is_available() and mx.default_device() == mx.gpu
    if want == "concat" and sharded:
        raise ValidationError("--lora-path concat is not supported under --tp; use stacked or exact", param="lora_path")
    if want == "concat" or (want == "auto" and cuda and not sharded):  # auto: concat on CUDA (README, LoRA)
        from mlxb.adapters.concat import install_groups

        ctx.cat_kernel, ctx.cat_kernel_off = _cat_kernel(cuda)
        concat = install_groups(model, ctx, adapters, paths, r, lambda la, lb: _pad_rank(la, lb, r))
        ctx.path = "concat" if concat else ctx.path
    mtype = getattr(getattr(model, "args", None), "model_type", None)
    if sharded and mtype not in TP_LORA_MODEL_TYPES:
        raise ValidationError(f"LoRA adapters under --tp are supported for {', '.join(TP_LORA_MODEL_TYPES)} models, not "
                              f"{mtype} (its sharding may split fused projections); run it without --tp", param="adapters")
    for path in paths:
        if path in concat:
            continue
        base = modules[path]
        kind = _sharding(base)
        quant = isinstance(base, nn.QuantizedLinear) or "Quantized" in type(base).__name__
        if not isinstance(base, (nn.Linear, nn.QuantizedLinear)) and kind is None:
            raise ValidationError(f"LoRA on {path} ({type(base).__name__}) is not supported; only Linear layers")
        out_dim = base.weight.shape[0]
        in_dim = base.weight.shape[1] * (32 // base.bits if quant else 1)
        dt = base.scales.dtype if quant else base.weight.dtype
        A = [mx.zeros((in_dim, r), dtype=dt) for _ in adapters]
        B = [mx.zeros((r, out_dim), dtype=dt) for _ in adapters]
        for i, ad in enumerate(adapters):
            if f"{path}.lora_a" in ad.weights:
                la, lb = _shard_factors(path, base, kind, ad.weights[f"{path}.lora_a"], ad.weights[f"{path}.lora_b"])
                A[i], B[i] = _pad_rank(la, lb, r)
        scale = mx.array([a.scale for a in adapters], dtype=mx.float32)
        swaps.append((path, MultiLoRALinear(base, ctx, mx.stack(A), mx.stack(B), scale,
                                            group=base.group if kind == "in" else None, path=lora_path)))
    model.update_modules(tree_unflatten(swaps))
    mx.eval(model.parameters())
    # NOTE: the per-adapter views too, here: an array left lazy on this thread's stream cannot be
    # evaluated later on the engine thread ("There is no Stream(cpu, 0) in current thread")
    mx.eval([t for _, m in swaps for t in m.tensors()])
    ctx.rank = r
    if not concat:
        ctx.path = ("fused" if any(m._fused for _, m in swaps) else "stacked" if any(m._stacked for _, m in swaps)
                    else "exact")
    model.mlxb_lora = ctx  # the engine's runner finds it here
    return ctx
