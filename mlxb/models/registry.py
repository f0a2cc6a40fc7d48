"""Resolve ``--model`` to a loadable folder: preset, alias, local folder or Hugging Face id."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mlxb.errors import ModelNotFoundError
from mlxb.models.presets import ALIASES, PRESETS, DEFAULT_MODEL


@dataclass
class ModelSpec:
    name: str  # what the user typed (or the default)
    kind: str  # "preset" | "folder" | "hf"
    source: str  # preset name, folder path or HF repo id
    dtype: str | None = None
    synthetic: bool = False


def _looks_like_hf_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "/", "~"))


def resolve_model(name: str | None = None, dtype: str | None = None) -> ModelSpec:
    name = name or DEFAULT_MODEL
    if name in PRESETS:
        return ModelSpec(name, "preset", name, dtype or PRESETS[name].dtype, synthetic=True)
    if name in ALIASES:
        return ModelSpec(name, "hf", ALIASES[name], dtype)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{name} is a folder but has no config.json; point --model at an mlx-lm model folder")
        return ModelSpec(name, "folder", str(path.resolve()), dtype)
    if _looks_like_hf_id(name):
        return ModelSpec(name, "hf", name, dtype)
    raise ModelNotFoundError(
        f"unknown model {name!r}. Use a synthetic preset ({', '.join(PRESETS)}), an alias "
        f"({', '.join(ALIASES)}), a local mlx-lm folder, or a Hugging Face id (org/name)"
    )


def model_path(spec: ModelSpec) -> Path:
    """Materialize ``spec`` as a local folder (building presets, downloading HF ids)."""
    if spec.kind == "preset":
        from mlxb.models.synth import ensure_preset

        return ensure_preset(PRESETS[spec.source], spec.dtype)
    if spec.kind == "folder":
        return Path(spec.source)
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                spec.source,
                allow_patterns=["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"],
            )
        )
    except Exception as e:  # offline, missing repo, auth
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise ModelNotFoundError(
            f"could not fetch {spec.source!r} from Hugging Face ({'offline mode' if offline else type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Without a network use a synthetic preset: "
            f"{', '.join(PRESETS)}"
        ) from None


def load_model(name: str | None = None, dtype: str | None = None, lazy: bool = False, engine_view: bool = True):
    """Return ``(model, tokenizer, spec, path)`` loaded through mlx-lm (``lazy``: weights not read yet;
    ``engine_view``: with the engine's corrections, ``mlxb.models.model_fixes``; the parity oracle runs
    mlx-lm's model as shipped)."""
    from mlx_lm import load

    from mlxb.models import model_fixes

    spec = resolve_model(name, dtype)
    path = model_path(spec)
    model, tokenizer = load(str(path), lazy=lazy)
    if spec.dtype and spec.kind != "preset":
        import mlx.core as mx

        model.set_dtype(getattr(mx, spec.dtype))
    return (model_fixes.engine_view(model) if engine_view else model), tokenizer, spec, path
