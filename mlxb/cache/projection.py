"""How many KV bytes a row will hold, per layer kind: what admission (``--kv-budget``) charges.
Plain records (no mlx): the scheduler reads them; ``mlxb.cache.protocol.kv_projection`` measures them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LayerBytes:
    """KV bytes of one cache layer: grows per token (capped at ``window``) plus a fixed part."""

    kind: str  # "full" | "rotating" | "ssm" | "latent"
    bytes_per_token: int = 0
    window: Optional[int] = None  # sliding-window cap on tokens held
    fixed_bytes: int = 0  # state that does not grow (SSM)
    full_bytes_per_token: int = 0  # quantized layers: bytes of the first ``full_tokens`` (not yet converted)
    full_tokens: int = 0


@dataclass(frozen=True)
class KVProjection:
    """Worst-case KV bytes of one row, per layer kind and dtype, window-capped for sliding layers."""

    layers: tuple[LayerBytes, ...]

    def row_bytes(self, num_tokens: int) -> int:
        total = 0
        for layer in self.layers:
            n = num_tokens if layer.window is None else min(num_tokens, layer.window)
            if layer.full_tokens and n < layer.full_tokens:  # not converted yet (--quantized-kv-start)
                total += n * layer.full_bytes_per_token + layer.fixed_bytes
                continue
            total += n * layer.bytes_per_token + layer.fixed_bytes
        return total

    def shared_bytes(self, num_tokens: int) -> int:
        """What ``num_tokens`` of a shared prefix hold once (full-attention layers at full width, the layers
        that share: ``mlxb.cache.shared``), and what a row that reads them does not hold itself."""
        return sum(num_tokens * layer.bytes_per_token for layer in self.layers
                   if layer.kind == "full" and not layer.full_tokens)
