"""Per-row LoRA on concatenated weights (``--lora-path concat``, asked for by name).

On MLX's CUDA backend a decode step of several rows is bound by the host's kernel launches, and the stacked
path adds three launches to each adapted projection (224 of them in an 8B Llama). Here the launches are cut
twice over:

* the projections of a block that read the same input (q/k/v; gate/up, as ``--fuse-projections`` groups
  them) are computed as one product, and
* every adapter's shrink factors ride on that product: the weight is ``[W_1; ...; W_k; A^T]``, so
  ``x @ W_cat^T`` gives the group's base outputs and all adapters' shrinks ``z`` at once.

Then one ``addmm`` adds ``(z * mask) @ B`` to the whole product (the mask keeps each row's own adapter's columns; every adapter's
scale is folded into its rows of ``B``, which maps each part's columns to that part's outputs). A forward
whose rows all use one adapter takes its columns of ``z`` and its rows of ``B`` and needs no mask; a forward
with no adapter row runs the group's base product only (the first rows of the same weight: a view), and a
lone row without an adapter each part's own rows (MLX's one-row product). So an adapted group costs its one
product plus two ops, where the stacked path spends three per projection on top of each projection's own.

The factors are cast to the base's dtype and summed in another order than mlx-lm's ``LoRALinear``, so this
path is not bit-exact (as the stacked one); only plain ``nn.Linear`` layers qualify (a quantized weight
cannot take the factors' rows unchanged): others keep the per-projection path.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxb.kernels import lora_cat
from mlxb.models.fuse import GROUPS, _Group


def _plain(m) -> bool:
    return type(m) is nn.Linear


class _CatGroup:
    """One group's concatenated layer, its expand factors, and the last input's split outputs."""

    def __init__(self, ctx, layers: list, factors: list, scales: list[float], rank: int):
        """``factors[j]``: None for a part no adapter touches, else ``(A [n, in, r], B [n, r, out_j])``."""
        self.ctx = ctx
        W = mx.concatenate([m.weight for m in layers], axis=0) if len(layers) > 1 else layers[0].weight
        dt, O = W.dtype, W.shape[0]
        self._split = _Group([m.weight.shape[0] for m in layers])  # one product for the parts fed the same input
        self.bounds = self._split.bounds
        touched = [j for j, f in enumerate(factors) if f is not None]
        n, r, k = len(scales), rank, len(touched)
        self.O, self.width = O, k * r  # each adapter's columns of z: one rank block per touched part
        # adapter-major rows: adapter i's block holds each touched part's A^T in turn
        at = [factors[j][0][i].T for i in range(n) for j in touched]
        cat = nn.Linear(1, 1, bias="bias" in layers[0])
        cat.weight = mx.concatenate([W] + [a.astype(dt) for a in at], axis=0)
        if "bias" in layers[0]:
            bias = mx.concatenate([m.bias for m in layers], axis=0) if len(layers) > 1 else layers[0].bias
            cat.bias = mx.concatenate([bias, mx.zeros((n * self.width,), dtype=bias.dtype)])
        rows = []
        for i in range(n):
            for j in touched:
                s, e = self.bounds[j]
                b = (scales[i] * factors[j][1][i].astype(mx.float32)).astype(dt)  # [r, out_j], the scale folded in
                rows.append(mx.pad(b, [(0, 0), (s, O - e)]))
        self.cat = cat
        # [n * width, O + n * width]: zero columns over z's own, so the addmm's addend is the whole (contiguous)
        # product, which MLX's CUDA addmm reads in place; a slice of it would be copied first
        self.b = mx.pad(mx.concatenate(rows, axis=0), [(0, 0), (0, n * self.width)])
        self.base = nn.Linear(1, 1, bias="bias" in cat)  # the group's base rows of the same weight (views)
        self.base.weight = cat.weight[:O]
        if "bias" in cat:
            self.base.bias = cat.bias[:O]
        self.views = []  # each part's own rows, for a lone row without an adapter
        for s, e in self.bounds:
            v = nn.Linear(1, 1, bias="bias" in cat)
            v.weight = cat.weight[s:e]
            if "bias" in cat:
                v.bias = cat.bias[s:e]
            self.views.append(v)
        self.b_one = [self.b[i * self.width : (i + 1) * self.width] for i in range(n)]
        self.bp = self.zoff = None  # the one-launch expand's factors (CUDA, ``ctx.cat_kernel``)
        if ctx.cat_kernel:
            self.bp, self.zoff = lora_cat.factors([f[1] if f is not None else None for f in factors], self.bounds,
                                                  scales, O, dt)
        for m in [cat, self.base] + self.views:
            m.freeze()

    def tensors(self) -> list:
        kernel = [self.bp, self.zoff] if self.bp is not None else []
        return [self.cat.weight, self.b] + self.b_one + [v.weight for v in self.views] + [self.base.weight] + kernel

    def forward(self, x: mx.array) -> mx.array:
        ctx = self.ctx
        if ctx.ids is None:
            return self.base(x)
        out = self.cat(x)
        if self.bp is not None and out.size // out.shape[-1] <= lora_cat.MAX_ROWS:  # the expand in one launch
            return lora_cat.expand(out, self.bp, self.zoff, ctx.row_slots(x), self.width)
        z, w, one = out[..., self.O :], self.width, ctx.one
        if one is not None:
            out = mx.addmm(out, z[..., one * w : (one + 1) * w], self.b_one[one])
        else:
            out = mx.addmm(out, z * ctx.block_mask(z.dtype, w), self.b)
        return out[..., : self.O]

    def part(self, x: mx.array, j: int) -> mx.array:
        if len(self.bounds) == 1:
            return self.views[0](x) if self.ctx.ids is None else self.forward(x)
        if x.size == x.shape[-1] and self.ctx.ids is None:  # a lone row without an adapter: its part's own rows
            return self.views[j](x)
        return self._split.part(self.forward, x, j)


class CatLoRAPart(nn.Module):
    """One projection of a concatenated LoRA group; part 0 holds the group's arrays in the module tree."""

    def __init__(self, group: _CatGroup, index: int):
        super().__init__()
        object.__setattr__(self, "_group", group)
        self._index = index
        if index == 0:
            self.cat, self.expand = group.cat, group.b
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return self._group.part(x, self._index)


def install_groups(model: nn.Module, ctx, adapters: list, paths: list[str], rank: int, pad) -> set:
    """Replace every qualifying group (module notes) of adapted projections with ``CatLoRAPart``s. ``pad(path,
    a, b)`` gives one adapter's factors padded to ``rank``. Returns the projection paths it took."""
    modules = dict(model.named_modules())
    adapted = set(paths)
    taken: set = set()
    for parent_path, mod in list(model.named_modules()):
        prefix = f"{parent_path}." if parent_path else ""
        groups = [g for g in GROUPS if all(getattr(mod, a, None) is not None for a in g)]
        singles = [(a,) for a in (p[len(prefix):] for p in adapted if p.startswith(prefix))
                   if "." not in a and not any(a in g for g in groups)]
        for names in groups + singles:
            full = [prefix + a for a in names]
            layers = [modules.get(p) for p in full]
            if not any(p in adapted for p in full) or any(p in taken for p in full):
                continue
            if not all(_plain(m) for m in layers) or len({m.weight.shape[1] for m in layers}) != 1 \
                    or len({m.weight.dtype for m in layers}) != 1 or len({"bias" in m for m in layers}) != 1:
                continue
            factors = []
            for p, m in zip(full, layers):
                if p not in adapted:
                    factors.append(None)
                    continue
                A, B = [], []
                for ad in adapters:
                    if f"{p}.lora_a" in ad.weights:
                        a, b = pad(ad.weights[f"{p}.lora_a"], ad.weights[f"{p}.lora_b"])
                    else:
                        a = mx.zeros((m.weight.shape[1], rank), dtype=m.weight.dtype)
                        b = mx.zeros((rank, m.weight.shape[0]), dtype=m.weight.dtype)
                    A.append(a), B.append(b)
                factors.append((mx.stack(A), mx.stack(B)))
            group = _CatGroup(ctx, layers, factors, [ad.scale for ad in adapters], rank)
            mx.eval(group.tensors())  # here, not lazily on whichever thread runs the model next
            for j, a in enumerate(names):
                setattr(mod, a, CatLoRAPart(group, j))
            taken.update(full)
    return taken
