"""Fused projections (``--fuse-projections``): the projections of one block that read the same input (q, k
and v; gate and up) become one product over their concatenated weights, split afterwards.

Why: on MLX's CUDA backend a product of 2 or more rows goes to cuBLAS, whose launch costs the host 14-31 us
against about 4 us for the one-row gemv (``scripts/probes/gemm_block_probe.py``, H100), and a batch or verify step
there is bound by the host's launch (README, "Pipelined verify steps"). Fusing q/k/v and gate/up makes
4 products per Llama block instead of 7.

How, for any mlx-lm model: every module that holds a whole group (``q_proj``, ``k_proj``, ``v_proj``; or
``gate_proj``, ``up_proj``) of plain ``nn.Linear`` layers, or of ``nn.QuantizedLinear`` layers with one
group size, bits and mode, all of one input width and all with or all without bias, gets ``FusedPart``
modules in their place. The first of them owns the fused layer (one ``nn.Linear`` / ``nn.QuantizedLinear``
whose weight rows are the group's, in order). A part called with the same input array (the same object)
as the last call takes its columns of that product; any other input computes the product anew, so a
model that feeds the group's members different inputs is still right, only not faster. The product is
dropped once every part has taken its columns. A one-row input (a lone row's decode step) takes each
part's own rows of the fused weight instead (a view, MLX's gemv): there launches cost little and the
slices of a fused product only add work (H200, synth-llama-8b: B=1 0.91x fused throughout).

Each output element is the same dot product as before, but the matmul may sum it in another order for
another output width, so a fused model is not promised to be bit-exact with mlx-lm's (CUDA's cuBLAS picks
its algorithm by shape); it is asked for by name. ``unfuse`` puts the layers back (their weights views of
the fused rows).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Group:
    """The last input of a fused group and its product's parts."""

    def __init__(self, sizes: list[int]):
        self.bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
        self.x = None
        self.parts: Optional[list] = None
        self.taken: set = set()

    def part(self, fused: nn.Module, x: mx.array, i: int) -> mx.array:
        if self.parts is None or x is not self.x or i in self.taken:
            y = fused(x)
            self.x, self.parts, self.taken = x, [y[..., s:e] for s, e in self.bounds], set()
        out = self.parts[i]
        self.taken.add(i)
        if len(self.taken) == len(self.bounds):  # every part taken: hold nothing between forwards
            self.x = self.parts = None
        return out


class FusedPart(nn.Module):
    """One projection of a fused group; part 0 owns the fused layer (``self.fused``)."""

    def __init__(self, group: _Group, index: int, view: nn.Module, head: "FusedPart" = None, fused: nn.Module = None):
        super().__init__()
        self._group, self._index = group, index
        object.__setattr__(self, "_head", head)  # not child modules: the fused weights appear once in the tree
        object.__setattr__(self, "_view", view)
        if fused is not None:
            self.fused = fused

    def __call__(self, x: mx.array) -> mx.array:
        if x.size == x.shape[-1]:  # one row: MLX's one-row gemv over this part's rows (a launch costs little there)
            return self._view(x)
        owner = self if self._head is None else self._head
        return self._group.part(owner.fused, x, self._index)


def _kind(layers: list) -> Optional[str]:
    """'linear' or 'quantized' if the layers can be fused, else None."""
    if all(type(m) is nn.Linear for m in layers):
        kind = "linear"
    elif all(type(m) is nn.QuantizedLinear for m in layers):
        kind = "quantized"
        if len({(m.group_size, m.bits, m.mode) for m in layers}) != 1:
            return None
    else:
        return None
    if len({m["weight"].shape[1] for m in layers}) != 1 or len({"bias" in m for m in layers}) != 1:
        return None
    return kind


KEYS = ("weight", "scales", "biases", "bias")  # a (quantized) Linear's arrays, each with one row per output


def _layer_like(template: nn.Module, arrays: dict) -> nn.Module:
    """A layer of ``template``'s class and quantization holding ``arrays``, frozen (as mlx-lm leaves loaded
    layers) and evaluated here, not lazily in whichever thread runs the model next."""
    if type(template) is nn.Linear:
        m = nn.Linear(1, 1, bias="bias" in arrays)
    else:
        t = template
        m = nn.QuantizedLinear(32 * 8, 1, bias="bias" in arrays, group_size=t.group_size, bits=t.bits, mode=t.mode)
        if "biases" not in arrays and "biases" in m:
            del m["biases"]
    for k, v in arrays.items():
        m[k] = v
    m.freeze()
    mx.eval(m.parameters())
    return m


def _fused_layer(layers: list) -> nn.Module:
    """One layer whose rows are ``layers``' rows, in order."""
    keys = [k for k in KEYS if layers[0].get(k) is not None]
    return _layer_like(layers[0], {k: mx.concatenate([m[k] for m in layers], axis=0) for k in keys})


def _views(f: nn.Module, bounds: list) -> list:
    """Layers of the fused layer's rows ``[s, e)`` each (views of its arrays)."""
    keys = [k for k in KEYS if f.get(k) is not None]
    return [_layer_like(f, {k: f[k][s:e] for k in keys}) for s, e in bounds]


def fuse(model: nn.Module) -> int:
    """Fuse every group of ``model`` that qualifies (module notes). Returns how many groups were fused."""
    n = 0
    for _, mod in list(model.named_modules()):
        for names in GROUPS:
            layers = [getattr(mod, a, None) for a in names]
            if any(m is None for m in layers):
                continue
            kind = _kind(layers)
            if kind is None:
                continue
            sizes = [m["weight"].shape[0] if kind == "linear" else m["scales"].shape[0] for m in layers]
            group = _Group(sizes)
            fused = _fused_layer(layers)  # evaluated layer by layer: the old weights go as the new ones arrive
            views = _views(fused, group.bounds)
            head = FusedPart(group, 0, views[0], fused=fused)
            setattr(mod, names[0], head)
            for i, a in enumerate(names[1:], start=1):
                setattr(mod, a, FusedPart(group, i, views[i], head=head))
            n += 1
    return n


def unfuse(model: nn.Module) -> int:
    """Put every fused group's layers back (weights as row slices of the fused ones). Returns the groups."""
    n = 0
    for _, mod in list(model.named_modules()):
        for names in GROUPS:
            head = getattr(mod, names[0], None)
            if not isinstance(head, FusedPart) or head._head is not None:
                continue
            for a, m in zip(names, _views(head.fused, head._group.bounds)):
                setattr(mod, a, m)
            n += 1
    return n
