"""`mlxb parity` (placeholder until the parity issue lands)."""

from mlxb.commands._common import not_implemented


def parity() -> None:
    """Gate the engine against mlx-lm's batch mode (not implemented yet)."""
    not_implemented("parity", "issue 5")
