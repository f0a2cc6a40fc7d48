"""`mlxb report` (placeholder until the benchmark issue lands)."""

from mlxb.commands._common import not_implemented


def report() -> None:
    """Render benchmark results (not implemented yet)."""
    not_implemented("report", "issue 6")
