"""`mlxb golden-gen` (placeholder until the parity issue lands)."""

from mlxb.commands._common import not_implemented


def golden_gen() -> None:
    """Write goldens for this machine from the oracle (not implemented yet)."""
    not_implemented("golden-gen", "issue 5")
