"""The ``lora`` parity case's reference: each row through mlx-lm's own ``LoRALinear`` of its adapter.

mlx-lm applies one adapter to a whole model. Here every adapted module keeps the base layer and one
mlx-lm ``LoRALinear`` per adapter (built with ``LoRALinear.from_base`` and given the adapter's
``lora_a`` / ``lora_b``, as ``load_adapters`` would); a forward over B rows runs the base and each
adapter's ``LoRALinear`` over the whole batch and takes every row's output from its own adapter (or
the base). No mlxb engine code is imported.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.tuner.lora import LoRALinear


class Slots:
    """Which adapter each row of the next forward uses (-1: the base)."""

    def __init__(self):
        self.slots: list[int] = []


class _RowLoRA(nn.Module):
    def __init__(self, base: nn.Module, loras: dict, state: Slots):
        super().__init__()
        self.base, self.loras, self._state = base, loras, state

    def __call__(self, x):
        slots = self._state.slots
        assert len(slots) == x.shape[0], (slots, x.shape)
        outs = {s: (self.loras[str(s)](x) if str(s) in self.loras else self.base(x)) for s in set(slots)}
        if len(outs) == 1:
            return next(iter(outs.values()))
        return mx.concatenate([outs[s][b : b + 1] for b, s in enumerate(slots)], axis=0)


def attach(model: nn.Module, folders: list[str]) -> Slots:
    """Give ``model`` every adapter of ``folders`` (slot i = folder i), selected per row by ``Slots``."""
    state = Slots()
    modules = dict(model.named_modules())
    per_path: dict[str, dict] = {}
    for i, folder in enumerate(folders):
        cfg = json.loads((Path(folder) / "adapter_config.json").read_text())["lora_parameters"]
        weights = mx.load(str(Path(folder) / "adapters.safetensors"))
        for name in weights:
            if not name.endswith(".lora_a"):
                continue
            path = name.rsplit(".", 1)[0]
            lora = LoRALinear.from_base(modules[path], r=cfg["rank"], scale=cfg["scale"], dropout=0.0)
            lora.lora_a, lora.lora_b = weights[f"{path}.lora_a"], weights[f"{path}.lora_b"]
            per_path.setdefault(path, {})[str(i)] = lora
    model.update_modules(tree_unflatten([(p, _RowLoRA(modules[p], loras, state)) for p, loras in per_path.items()]))
    mx.eval(model.parameters())
    model.eval()
    return state
