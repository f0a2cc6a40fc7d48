"""Model registry: local folders, Hugging Face ids, aliases and synthetic presets."""

from mlxb.models.registry import ModelSpec, load_model, resolve_model

__all__ = ["ModelSpec", "load_model", "resolve_model"]
