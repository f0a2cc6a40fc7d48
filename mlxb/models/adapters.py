"""Random-weight LoRA adapters in mlx-lm's format, so LoRA serving and its parity gate work offline.

``build_adapter`` writes one for a base model (``mlx_lm.tuner.utils.load_adapters``, ``mlx_lm.fuse`` and
``mlxb serve --adapters`` read it); ``ensure_adapters`` materializes a parity case's adapter recipe once
under ``MLXB_HOME`` (deterministic: the same base and recipe give the same bytes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


def build_adapter(base: nn.Module, out: str | Path, rank: int = 8, num_layers: int = -1, scale: float = 20.0,
                  seed: int = 0, keys: Optional[list[str]] = None) -> Path:
    """Write a random-weight LoRA adapter for ``base`` in mlx-lm's format (``mlx_lm.tuner.utils.load_adapters``
    and ``mlx_lm.fuse`` read it). ``lora_b`` is random too (training starts it at zero), so the adapter
    changes the model's outputs."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    n = len(base.layers)
    num_layers = n if num_layers < 0 else num_layers
    params = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys:
        params["keys"] = keys
    linear_to_lora_layers(base, num_layers, params)
    mx.random.seed(seed)
    lora = {k: v for k, v in tree_flatten(base.parameters()) if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    lora = {k: (mx.random.normal(v.shape) * (0.02 if k.endswith("lora_b") else 1.0 / rank ** 0.5)).astype(v.dtype)
            for k, v in lora.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), lora)
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}, indent=2) + "\n")
    return out


def ensure_adapters(source: str, dtype: Optional[str], model_id: str, recipes: list[dict]) -> list[str]:
    """Folders of the adapters ``recipes`` (``{"seed", "rank", "num_layers"}`` each) over the model loaded
    from ``source``; built on first use under ``MLXB_HOME/adapters``."""
    from mlxb.models.registry import load_model
    from mlxb.models.synth import mlxb_home

    key = hashlib.sha256(json.dumps([model_id, dtype, recipes], sort_keys=True).encode()).hexdigest()[:16]
    root = mlxb_home() / "adapters" / key
    out = []
    for i, r in enumerate(recipes):
        d = root / str(i)
        if not (d / "adapters.safetensors").exists():
            base, *_ = load_model(source, dtype)
            tmp = root / f"{i}.tmp"
            build_adapter(base, tmp, rank=r["rank"], num_layers=r.get("num_layers", -1), seed=r["seed"])
            tmp.replace(d)
        out.append(str(d))
    return out
